"""The ahead-of-time compile behind tests/test_triton_aot.py, in a process of its own (batchgen_kernels/triton_aot.py
says why and how): `python tests/aot_runner.py --target sm_90 [--specialisations] --out report.json`.

It writes the report of every case of the engine's matrix and of the planted bugs, the kernels the Triton modules
define, and with --specialisations the variants a realistic run compiles: after the engine's warm-up, then after a
sequence of eager and CUDA-graph steps on a Llama-3.2-1B-shaped model whose first layer has a sliding window, as
Gemma 3's local layers do (on the meta device, 132 SMs as an H200), over a bf16 cache and over an int8 one; and the
MoE experts' grouped matmul (triton_moe.py) through grouped_experts at Mixtral-8x7B's and Qwen3-30B-A3B's expert
shapes, in bf16 and fp16; and the per-row LoRA deltas (triton_lora.py) through lora_delta at SmolLM2-135M's
projections (rank 8 per part) in bf16 and fp16, and at the widest shape the kernel takes (rank triton_lora.MAX_RANK,
16,384 features in and out).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from transformers import LlamaConfig
from triton.runtime.jit import JITFunction

from batchgen.engine.cuda_graphs import DecodeGraphRunner
from batchgen.engine.kernel_warmup import warm_up_attention
from batchgen.models.registry import build_model
from batchgen_kernels import (AttentionMetadata, triton_aot, triton_decode, triton_lora, triton_moe, triton_prefill,
                              triton_store)
from batchgen_kernels.elementwise import TorchElementwise
from batchgen_kernels.triton_common import triton_error_reason

KERNEL_MODULES = (triton_store, triton_decode, triton_prefill)  # attention: the engine's matrix, the specialisations
MOE_MODULES = (triton_moe,)
LORA_MODULES = (triton_lora,)
# (hidden, expert intermediate, experts, top-k, fp32 routing weights)
MOE_SHAPES = {"Mixtral-8x7B": (4096, 14336, 8, 2, True), "Qwen3-30B-A3B": (2048, 768, 128, 8, False)}
# Steps of 1 to 4,096 tokens: decode-sized ones (16-row blocks) and prefill-sized ones (64-row blocks)
MOE_TOKENS = (1, 3, 8, 16, 100, 511, 512, 4096)
# LoRA: (in, out, slot rank) per projection. SmolLM2-135M (hidden 576, q 576, k/v 192, intermediate 1,536) with
# rank 8 adapters on every module: q/k/v packed (3 parts), o, gate/up packed (2), down; and the widest shape.
LORA_SHAPES = {"SmolLM2-135M": ((576, 576 + 2 * 192, 3 * 8), (576, 576, 8), (576, 2 * 1536, 2 * 8), (1536, 576, 8)),
               "widest": ((16384, 16384, triton_lora.MAX_RANK),)}
LORA_CASES = (("bfloat16", "SmolLM2-135M"), ("float16", "SmolLM2-135M"), ("bfloat16", "widest"), ("float32", "widest"))
LORA_SLOTS = 4
# Steps of 1 to 4,096 rows: decode-sized (16-row blocks, the input features split) and prefill-sized
LORA_ROWS = (1, 3, 16, 63, 64, 100, 511, 4096)
MAX_MODEL_LEN = 131072  # Llama 3's context: what the CUDA graphs' metadata holds
WINDOW = 512  # Gemma 3's sliding window: a multiple of 16, which Triton would specialise on
BLOCK_SIZE = 16
H200_SMS = 132


def defined_kernels() -> list[str]:
    """Every kernel the Triton modules define (their helpers live in triton_common)."""
    return sorted(fn.fn.__name__ for module in KERNEL_MODULES + MOE_MODULES + LORA_MODULES
                  for fn in vars(module).values()
                  if isinstance(fn, JITFunction) and fn.fn.__module__ == module.__name__)


def meta_model(kv_int8: bool = False) -> torch.nn.Module:
    """Llama-3.2-1B's attention (32 query heads over 8 KV heads of 64) in bf16, two layers, the first one local
    (a sliding window, as in Gemma 3) and the second global, on the meta device, bound to a meta KV cache (int8
    with its scales: engine.kv_cache_dtype int8) and the Triton backend."""
    config = LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=MAX_MODEL_LEN)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to(device="meta", dtype=torch.bfloat16).eval()
    model.model.layers[0].self_attn.attn.sliding_window = WINDOW
    cache = torch.empty((model.num_layers, 2, 4096, BLOCK_SIZE, model.num_kv_heads, model.head_dim),
                        dtype=torch.int8 if kv_int8 else torch.bfloat16, device="meta")
    scales = torch.empty(cache.shape[:-1], dtype=torch.float32, device="meta")
    model.bind_kv_cache([cache[i, 0] for i in range(model.num_layers)], [cache[i, 1] for i in range(model.num_layers)],
                        "triton", [(scales[i, 0], scales[i, 1]) for i in range(model.num_layers)] if kv_int8 else None)
    return model


def realistic_steps() -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of eager steps as a run schedules them: prefills alone, decodes (0, 1, 3, 16 of them)
    next to a prefill chunk, decode-only batches from 1 to 256 sequences with contexts from one block (a block
    table one entry wide) to 40,000 tokens (1 to 32 splits)."""
    steps = [([37, 120, 5], [37, 120, 5]), ([1, 30], [15, 46]), ([1, 1, 1, 64], [38, 121, 6, 264]),
             ([1] * 16 + [200], [300] * 16 + [700])]
    for batch in (1, 2, 7, 16, 64, 256):
        for context in (9, 300, 2000, 40000):
            steps.append(([1] * batch, [context] * batch))
    return steps


@torch.inference_mode()
def run_steps(model: torch.nn.Module) -> None:
    device = torch.device("meta")
    for query_lens, seq_lens in realistic_steps():
        tables = np.zeros((len(seq_lens), -(-max(seq_lens) // BLOCK_SIZE)), dtype=np.int32)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, np.zeros(sum(query_lens), dtype=np.int64),
                                           device)
        tokens = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
        model(tokens, tokens, metadata)
    graphs = DecodeGraphRunner(model, BLOCK_SIZE, 64, MAX_MODEL_LEN, device, capture=False)
    for size in graphs.sizes:  # what capturing every bucket's graph launches
        model(graphs.input_ids[:size], graphs.positions[:size], graphs.metadata(size))


@contextmanager
def sms(count: int) -> Iterator[None]:
    """The decode's split count as on a GPU with `count` SMs (off CUDA it assumes 8)."""
    saved = triton_decode.num_sms
    triton_decode.num_sms = lambda device: count
    try:
        yield
    finally:
        triton_decode.num_sms = saved


def specialise_everything() -> None:
    """The planted bug of the specialisation count: every argument specialised again, as without do_not_specialize."""
    for module in KERNEL_MODULES:
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                for param in fn.params:
                    param.do_not_specialize = False
                fn.device_caches.clear()  # rebuilt, with the binder of the new params, on the next launch


def specialisations(target: triton_aot.Target, kv_int8: bool = False) -> dict:
    """Distinct compiled variants per kernel after the engine's warm-up and after the realistic steps."""
    model = meta_model(kv_int8)

    def variants(launched) -> dict[str, int]:
        hashes: dict[str, set[str]] = {}
        for name, kernel in launched:
            hashes.setdefault(name, set()).add(kernel.hash)
        return {name: len(found) for name, found in sorted(hashes.items())}

    with sms(H200_SMS), triton_aot.compile_only(target) as launched:
        warm_up_attention(model, MAX_MODEL_LEN)
        warm = variants(launched)
        run_steps(model)
        return {"after_warm_up": warm, "after_run": variants(launched), "launches": len(launched)}


def moe_reports(target: triton_aot.Target) -> list[dict]:
    """grouped_experts compiled for `target` on meta tensors (which also shows it reads nothing back to the host: a
    meta tensor has no value), per dtype and model shape, at every step size of MOE_TOKENS, and checked as the
    attention's dot kernels are: shared memory within the target, tensor cores and no spills in 16-bit."""
    reports = []
    meta = torch.device("meta")
    for dtype_name in ("bfloat16", "float16"):
        dtype = getattr(torch, dtype_name)
        for shape, (hidden, intermediate, experts, top_k, fp32_weights) in MOE_SHAPES.items():
            report = {"case": f"{dtype_name} {shape}", "variants": [], "problems": []}
            launched = []
            try:
                with triton_aot.compile_only(target) as launched:
                    w_gate_up = torch.empty(experts, 2 * intermediate, hidden, dtype=dtype, device=meta)
                    w_down = torch.empty(experts, hidden, intermediate, dtype=dtype, device=meta)
                    for tokens in MOE_TOKENS:
                        x = torch.empty(tokens, hidden, dtype=dtype, device=meta)
                        weights = torch.empty(tokens, top_k, dtype=torch.float32 if fp32_weights else dtype,
                                              device=meta)
                        expert_ids = torch.empty(tokens, top_k, dtype=torch.int64, device=meta)
                        triton_moe.grouped_experts(x, w_gate_up, w_down, weights, expert_ids,
                                                   TorchElementwise.silu_mul)
            except Exception as exc:  # noqa: BLE001 -- a compile error is the finding
                report["problems"].append(f"does not compile: {type(exc).__name__}: {triton_error_reason(exc)}")
            check_variants(report, launched, target, sixteen_bit=True)
            reports.append(report)
    return reports


def check_variants(report: dict, launched: list, target: triton_aot.Target, sixteen_bit: bool) -> None:
    """Each distinct compiled kernel into report["variants"], checked as the attention's dot kernels are: within
    the target's shared memory (else a problem: the case fails); in 16-bit on tensor cores and without spills (else
    a problem); in fp32 (IEEE: no tensor cores) spills are a note."""
    seen = set()
    for name, kernel in launched:
        if kernel.hash in seen:
            continue
        seen.add(kernel.hash)
        variant = triton_aot.analyse(name, kernel)
        report["variants"].append(dataclasses.asdict(variant))
        if variant.shared > target.shared_memory:
            report["problems"].append(f"{name} needs {variant.shared:,} bytes of shared memory, more "
                                      f"than the {target.shared_memory:,} of {target.name}")
        if sixteen_bit and not variant.tensor_cores:
            report["problems"].append(f"{name} has no tensor-core instruction (wgmma / mma)")
        if variant.spill_bytes:
            (report["problems"] if sixteen_bit else report["notes"]).append(
                f"{name} spills registers: {variant.spill_bytes} bytes of stack")


def lora_reports(target: triton_aot.Target) -> list[dict]:
    """lora_delta compiled for `target` on meta tensors (nothing read back to the host) for each of LORA_CASES:
    every projection of the shape, at every step size of LORA_ROWS, with rows of LORA_SLOTS slots. Checked as the
    MoE kernel is (16-bit: tensor cores, no spills; fp32: spills noted, no tensor cores: IEEE fp32)."""
    reports = []
    meta = torch.device("meta")
    for dtype_name, shape in LORA_CASES:
        dtype = getattr(torch, dtype_name)
        report = {"case": f"{dtype_name} {shape}", "variants": [], "problems": [], "notes": []}
        launched = []
        try:
            with triton_aot.compile_only(target) as launched:
                for size_in, size_out, rank in LORA_SHAPES[shape]:
                    a = torch.empty(LORA_SLOTS * rank, size_in, dtype=dtype, device=meta)
                    b = torch.empty(LORA_SLOTS * rank, size_out, dtype=dtype, device=meta)
                    for rows in LORA_ROWS:
                        x = torch.empty(rows, size_in, dtype=dtype, device=meta)
                        out = torch.empty(rows, size_out, dtype=dtype, device=meta)
                        row_slots = torch.empty(rows, dtype=torch.int32, device=meta)
                        triton_lora.lora_delta(x, a, b, row_slots, LORA_SLOTS, rank, out)
        except Exception as exc:  # noqa: BLE001 -- a compile error is the finding
            report["problems"].append(f"does not compile: {type(exc).__name__}: {triton_error_reason(exc)}")
        check_variants(report, launched, target, sixteen_bit=dtype != torch.float32)
        reports.append(report)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=sorted(triton_aot.TARGETS), required=True)
    parser.add_argument("--specialisations", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = triton_aot.TARGETS[args.target]

    def compiled(cases: list[triton_aot.Case]) -> list[dict]:
        return [dataclasses.asdict(triton_aot.compile_case(case, target)) for case in cases]

    report = {"target": target.name, "defined_kernels": defined_kernels(), "cases": compiled(triton_aot.engine_cases()),
              "planted": compiled(triton_aot.PLANTED), "moe": moe_reports(target), "lora": lora_reports(target)}
    if args.specialisations:
        report["specialisations"] = specialisations(target)
        report["specialisations_int8"] = specialisations(target, kv_int8=True)
        specialise_everything()
        report["specialisations_planted"] = specialisations(target)
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
