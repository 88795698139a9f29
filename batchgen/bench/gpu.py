"""The GPU check: batchgen on one CUDA device, with random-weight Llama models of real shapes built in the run.

For each model (Llama-3.2-1B's shape, then Llama-3.1-8B's), saved with save_pretrained in bf16 to a temp dir:
  1. greedy equality with transformers on the same GPU, for a few random-token prompts, alone and batched: in bf16
     every divergence must be a near-tie (the two tokens within a couple of bf16 ulps in transformers' own logits);
     for the small model also in fp32, under tests/greedy_check.py's rule (within 1e-3, at most 1 prompt in 20);
  2. output tokens/s on a synthetic offline workload (ignore_eos, random prompts), against transformers' `generate`
     with static batching (rows sorted by length, left-padded) on a random subset of the same workload;
  3. the decode step time at batch sizes 1, 32 and 256 against its floor: max(bytes read per step (weights + the
     batch's KV) / measured copy bandwidth, FLOPs per step / measured bf16 matmul rate).
It prints one short table last and writes every figure as JSON (--out). Nothing but the tree: no network, no
tokenizer, no installs (torch, transformers, triton, numpy, safetensors).

    PYTHONPATH=.:kernels python -m batchgen.bench.gpu [--quick]
    PYTHONPATH=.:kernels python batchgen/bench/gpu.py [--quick]     # the same, without importing batchgen.bench
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file, this folder is sys.path[0]: take it out so that its modules cannot shadow top-level ones.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse
import gc
import json
import math
import platform
import random
import shutil
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.sequence import Sequence

# ------------------------------------------------------------------------------------------- models of real shapes

_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", bos_token_id=128000, eos_token_id=128001,
               initializer_range=0.02)
MODEL_CONFIGS = {  # LlamaConfig keyword arguments
    "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
               tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
}
MODEL_CONFIGS["tiny"] = dict(_LLAMA3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # dry runs (--device cpu)
MODEL_NAMES = {"1b": "Llama-3.2-1B shape", "8b": "Llama-3.1-8B shape", "tiny": "tiny Llama-3 (dry runs)"}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, c: dict) -> "ModelShape":
        heads = c["num_attention_heads"]
        return cls(c["hidden_size"], c["num_hidden_layers"], heads, c.get("num_key_value_heads") or heads,
                   c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"], c["vocab_size"],
                   bool(c.get("tie_word_embeddings", False)))

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o, gate, up, down of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by: all layers' projections and the lm_head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        norms = (2 * self.layers + 1) * self.hidden
        embedding = 0 if self.tied else self.vocab * self.hidden  # tied: the lm_head is the embedding
        return self.matmul_params + norms + embedding

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def decode_step_cost(shape: ModelShape, batch_size: int, total_context: int, dtype_bytes: int = 2) -> dict:
    """Bytes read and FLOPs of one decode step of `batch_size` sequences whose contexts (the new token included)
    add up to total_context tokens. Weights are read once per step; of an untied embedding table only the batch's
    rows. Attention reads every context token's K and V and does 2 x 2 x heads x head_dim FLOPs on it per layer."""
    norms = (2 * shape.layers + 1) * shape.hidden
    embedding_rows = 0 if shape.tied else batch_size * shape.hidden
    weight_bytes = (shape.matmul_params + norms + embedding_rows) * dtype_bytes
    kv_bytes = total_context * shape.kv_bytes_per_token(dtype_bytes)
    matmul_flops = 2 * batch_size * shape.matmul_params
    attention_flops = 4 * shape.layers * shape.heads * shape.head_dim * total_context
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes": weight_bytes + kv_bytes,
            "matmul_flops": matmul_flops, "attention_flops": attention_flops, "flops": matmul_flops + attention_flops}


def decode_floor(cost: dict, copy_bandwidth: float, matmul_rate: float) -> dict:
    """The fastest a step can be: its bytes at the copy bandwidth or its FLOPs at the matmul rate, the larger."""
    memory_s, compute_s = cost["bytes"] / copy_bandwidth, cost["flops"] / matmul_rate
    return {"memory_s": memory_s, "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute"}


def synthetic_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                       vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request: lengths uniform in the inclusive ranges, ids uniform over the
    vocabulary (no shared prefixes), the same for a given seed."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))]
        workload.append((prompt, rng.randint(*output_lens)))
    return workload


# --------------------------------------------------------------------------------------------- the greedy rule

def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def is_near_tie(reference_logit: float, other_logit: float, rel_tol: float, abs_tol: float) -> bool:
    """tests/greedy_check.py's rule, |logit(reference token) - logit(our token)| <= tol in the reference's logits,
    with a tolerance that may scale with the logit: bf16 logits are rounded to 8 significant bits, so two
    candidates a few units in the last place apart are a tie that rounding in either implementation can break."""
    return abs(reference_logit - other_logit) <= abs_tol + rel_tol * max(abs(reference_logit), abs(other_logit))


def greedy_verdict(references: list[list[int]], reference_logits: list, outputs: list[list[int]], rel_tol: float,
                   abs_tol: float, max_divergences: int) -> dict:
    """Every output equals its reference, except at most max_divergences that first differ at a near-tie.
    reference_logits[i][step][token] is the reference's logit of `token` at that step of prompt i."""
    divergences = []
    for i, (ref, ours) in enumerate(zip(references, outputs)):
        step = first_divergence(ref, ours)
        if step is None:
            continue
        entry = {"prompt": i, "step": step, "near_tie": False}
        if step < len(ref) and step < len(ours):  # else one stopped early: not a tie between two tokens
            a, b = float(reference_logits[i][step][ref[step]]), float(reference_logits[i][step][ours[step]])
            entry.update(reference_token=ref[step], our_token=ours[step], reference_logit=a, our_token_logit=b,
                         near_tie=is_near_tie(a, b, rel_tol, abs_tol))
        divergences.append(entry)
    ok = all(d["near_tie"] for d in divergences) and len(divergences) <= max_divergences
    return {"ok": ok, "prompts": len(references), "identical": len(references) - len(divergences),
            "divergences": divergences, "rule": {"rel_tol": rel_tol, "abs_tol": abs_tol,
                                                 "max_divergences": max_divergences}}


# ------------------------------------------------------------------------------------------- device measurements

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, reps: int, device: torch.device) -> float:
    """Best-of-reps seconds of fn() (CUDA events on the current stream on a GPU), after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        if device.type != "cuda":
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, reps: int = 10) -> float:
    """Bytes per second a large device-to-device copy moves, reads and writes counted (2 x nbytes per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), reps, device)
    del src, dst
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, n: int = 8192, reps: int = 10, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = best_time(lambda: a @ b, reps, device)
    return 2 * n**3 / seconds


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_memory_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# -------------------------------------------------------------------------------------------------- transformers

def build_hf_model(config_kwargs: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """transformers' Llama with its own random initialisation, on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**config_kwargs, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _for_generation(model.to(device))


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return _for_generation(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device))


def _for_generation(model):
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt alone: transformers' greedy tokens, and its raw logits at each step ([steps, vocab], fp32, CPU)."""
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float().cpu())
    return tokens, logits


@torch.inference_mode()
def hf_static_throughput(model, workload: list[tuple[list[int], int]], batch_size: int, time_limit_s: float) -> dict:
    """transformers' static batching as people write it: rows sorted by prompt length, left-padded batches, each
    generating up to its longest max_tokens. Counts each row's own max_tokens as output (ignore_eos)."""
    device = model.device
    ordered = sorted(workload, key=lambda item: len(item[0]))
    rows = output_tokens = 0
    synchronize(device)
    started = time.perf_counter()
    for first in range(0, len(ordered), batch_size):
        batch = ordered[first:first + batch_size]
        width = max(len(prompt) for prompt, _ in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        model.generate(input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
                       max_new_tokens=max(m for _, m in batch))
        rows += len(batch)
        output_tokens += sum(m for _, m in batch)
        if time.perf_counter() - started > time_limit_s:
            break
    synchronize(device)
    wall = time.perf_counter() - started
    return {"rows": rows, "batch_size": batch_size, "output_tokens": output_tokens, "wall_s": wall,
            "output_tokens_per_s": output_tokens / wall, "truncated_by_time_limit": rows < len(workload)}


# ------------------------------------------------------------------------------------------------------ batchgen

def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def batchgen_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int, together: bool) -> list[list[int]]:
    if together:
        results = {r.request_id: r for r in engine.generate(
            Request(i, prompt, greedy_params(max_tokens)) for i, prompt in enumerate(prompts))}
        return [results[i].token_ids for i in range(len(prompts))]
    return [next(iter(engine.generate([Request(0, prompt, greedy_params(max_tokens))]))).token_ids
            for prompt in prompts]


def reset_engine(engine: Engine) -> None:
    """Drop every unfinished sequence (a run cut short), giving back its blocks."""
    scheduler = engine.scheduler
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    scheduler.waiting.clear()


def batchgen_throughput(engine: Engine, workload: list[tuple[list[int], int]], time_limit_s: float) -> dict:
    requests = (Request(i, prompt, greedy_params(max_tokens)) for i, (prompt, max_tokens) in enumerate(workload))
    steps_before = engine.num_steps
    finished = output_tokens = errors = short = 0
    synchronize(engine.device)
    started = time.perf_counter()
    truncated = False
    for result in engine.generate(requests):
        finished += 1
        output_tokens += result.output_tokens
        errors += result.finish_reason == "error"
        short += result.finish_reason != "error" and result.output_tokens != workload[result.request_id][1]
        if time.perf_counter() - started > time_limit_s:
            truncated = True
            break
    in_flight = sum(seq.num_output_tokens for seq in engine.scheduler.running) if truncated else 0
    wall = time.perf_counter() - started
    if truncated:
        reset_engine(engine)
    return {"requests": len(workload), "finished": finished, "errors": errors, "wrong_length": short,
            "output_tokens": output_tokens + in_flight, "wall_s": wall,
            "output_tokens_per_s": (output_tokens + in_flight) / wall, "steps": engine.num_steps - steps_before,
            "truncated_by_time_limit": truncated, "stats": engine.stats(),
            "max_memory_allocated_bytes": max_memory_allocated(engine.device)}


def decode_step_times(engine: Engine, shape: ModelShape, batch_size: int, context: int, steps: int, rates: dict,
                      seed: int) -> dict:
    """Time `steps` whole engine steps (schedule, inputs, forward, sampling, sync) once `batch_size` sequences with
    `context`-token prompts are all decoding, and set each against its floor."""
    rng = random.Random(seed)
    params = greedy_params(engine.max_model_len - context - 1)
    seqs = [Sequence.from_request(Request(f"decode-{i}", [rng.randrange(shape.vocab) for _ in range(context)],
                                          params), seed=0) for i in range(batch_size)]
    for seq in seqs:
        engine.scheduler.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):  # prefill (chunked) until every sequence decodes
        engine.step()
    times, contexts = [], []
    for _ in range(steps):
        contexts.append(sum(seq.num_tokens for seq in seqs))  # each decodes its last token: context = num_tokens
        started = time.perf_counter()
        engine.step()  # ends with the sampled ids copied to the host: a full device sync
        times.append(time.perf_counter() - started)
    reset_engine(engine)
    median = statistics.median(times)
    total_context = round(statistics.mean(contexts))
    cost = decode_step_cost(shape, batch_size, total_context)
    floor = decode_floor(cost, rates["copy_bandwidth_bytes_per_s"], rates["bf16_matmul_flops_per_s"])
    return {"batch_size": batch_size, "context": context, "steps": steps, "median_s": median,
            "mean_s": statistics.mean(times), "min_s": min(times), "max_s": max(times),
            "mean_total_context": total_context, **cost, **floor, "ratio_to_floor": median / floor["floor_s"]}


def open_engine(model_dir: Path, dtype: str, args, **overrides) -> tuple[Engine, float]:
    settings = dict(model=str(model_dir), dtype=dtype, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory=args.kv_cache_memory)
    settings.update(overrides)
    started = time.perf_counter()
    engine = Engine(EngineArgs(**settings))
    return engine, time.perf_counter() - started


# ------------------------------------------------------------------------------------------------- one model

class Phases:
    """Runs the steps of a check one by one, keeping each one's result or error and its time: one failing step
    must not cost the figures of the others (a GPU session is short)."""

    def __init__(self, record: dict, label: str) -> None:
        self.record, self.label = record, label

    def run(self, key: str, fn, keep: bool = True):
        """fn()'s value (None if it raised); kept in the record under `key` when `keep` (JSON-able values only)."""
        started = time.perf_counter()
        print(f"[{self.label}] {key} ...", file=sys.stderr, flush=True)
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 -- recorded, and the check goes on
            value = None
            self.record[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"[{self.label}] {key} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            if keep:
                self.record[key] = value
        self.record.setdefault("phase_s", {})[key] = time.perf_counter() - started
        return value


def check_model(key: str, work_dir: Path, device: torch.device, rates: dict, args) -> dict:
    config = MODEL_CONFIGS[key]
    shape = ModelShape.from_config(config)
    record = {"name": MODEL_NAMES[key], "config": config, "shape": asdict(shape), "params": shape.num_params}
    phases = Phases(record, key)
    rng = random.Random(args.seed)
    low, high = min(16, args.prompt_min), min(512, args.prompt_max)
    prompts = [[rng.randrange(shape.vocab) for _ in range(rng.randint(low, high))] for _ in range(args.greedy_prompts)]
    workload = synthetic_workload(args.requests, (args.prompt_min, args.prompt_max),
                                  (args.output_min, args.output_max), shape.vocab, args.seed)
    hf_subset = random.Random(args.seed + 1).sample(workload, min(args.hf_requests, len(workload)))
    model_dir = work_dir / key

    # transformers first, then batchgen: never both models on the device at once.
    hf = phases.run("build_and_save", lambda: _build_and_save(config, model_dir, device, args.seed), keep=False)
    references = None
    if hf is not None:
        references = phases.run("hf_greedy_bf16", lambda: hf_greedy(hf, prompts, args.greedy_tokens), keep=False)
        if not args.skip_hf_throughput:
            phases.run("hf_static", lambda: hf_static_throughput(hf, hf_subset, args.hf_batch_size,
                                                                 args.hf_time_limit))
    del hf
    free_device_memory()
    if not (model_dir / "config.json").is_file():
        return record

    opened = phases.run("engine_load", lambda: open_engine(model_dir, "bfloat16", args), keep=False)
    if opened is not None:
        engine, load_s = opened
        del opened
        graphs = engine.runner.decode_graphs
        record["engine_load"] = {"load_s": load_s, "kv_cache_tokens": engine.kv_capacity,
                                 "max_model_len": engine.max_model_len,
                                 "cuda_graph_batch_sizes": graphs.sizes if graphs is not None else None}
        if device.type == "cuda" and graphs is None:
            record["engine_load"]["error"] = "the engine runs without CUDA graphs (see the warning in its log)"
        if references is not None:
            phases.run("greedy_bf16", lambda: _greedy_check(engine, prompts, references, args.bf16_rel_tol, 1e-3,
                                                            len(prompts)))
        phases.run("batchgen", lambda: batchgen_throughput(engine, workload, args.time_limit))
        record["decode"] = {}
        for batch_size in args.decode_batch_sizes:
            if batch_size > args.max_num_seqs:
                continue
            Phases(record["decode"], f"{key} decode").run(str(batch_size), lambda b=batch_size: decode_step_times(
                engine, shape, b, args.decode_context, args.decode_steps, rates, args.seed))
        del engine, graphs
        free_device_memory()

    if args.fp32_check and shape.num_params < 3e9:
        phases.run("greedy_fp32", lambda: _fp32_check(model_dir, prompts, device, args))
    return record


def _build_and_save(config: dict, model_dir: Path, device: torch.device, seed: int):
    model = build_hf_model(config, torch.bfloat16, device, seed)
    model.save_pretrained(model_dir)
    return model


def _greedy_check(engine: Engine, prompts, references, rel_tol: float, abs_tol: float, max_divergences: int) -> dict:
    tokens, logits = references
    verdicts = {}
    for together in (False, True):
        outputs = batchgen_greedy(engine, prompts, len(tokens[0]), together)
        verdicts["batched" if together else "alone"] = greedy_verdict(tokens, logits, outputs, rel_tol, abs_tol,
                                                                      max_divergences)
    return {"ok": all(v["ok"] for v in verdicts.values()), **verdicts}


def _fp32_check(model_dir: Path, prompts, device: torch.device, args) -> dict:
    """fp32 on both sides: tests/greedy_check.py's rule as it stands (1e-3, at most 1 prompt in 20)."""
    hf = load_hf_model(model_dir, torch.float32, device)
    references = hf_greedy(hf, prompts, args.greedy_tokens)
    del hf
    free_device_memory()
    engine, _ = open_engine(model_dir, "float32", args, kv_cache_memory=args.kv_cache_memory or "4GiB",
                            max_num_seqs=16)
    try:
        return _greedy_check(engine, prompts, references, 0.0, 1e-3, max(1, len(prompts) // 20))
    finally:
        del engine
        free_device_memory()


# ------------------------------------------------------------------------------------------------------ report

def summary_table(record: dict) -> str:
    device = record["device"]
    lines = [f"GPU check, {device.get('name')}, {record['started'][:10]}: copy "
             f"{device.get('copy_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{device.get('bf16_matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s",
             f"{'model':<6} {'greedy bf16/fp32':<17} {'batchgen tok/s':>14} {'HF static tok/s':>15} {'x':>6}  "
             f"decode step ms (x floor) at batch 1 / 32 / 256"]
    for key, m in record["models"].items():
        def verdict(name):
            value = m.get(name)
            if not value:
                return "-"
            return "ERR" if "error" in value else "ok" if value["ok"] else "FAIL"
        ours = m.get("batchgen", {}).get("output_tokens_per_s")
        theirs = m.get("hf_static", {}).get("output_tokens_per_s")
        speedup = f"{ours / theirs:.1f}" if ours and theirs else "-"
        decode = []
        for size in ("1", "32", "256"):
            d = m.get("decode", {}).get(size)
            decode.append(f"{d['median_s'] * 1e3:.2f} ({d['ratio_to_floor']:.2f}x)" if d and "median_s" in d else "-")
        lines.append(f"{key:<6} {verdict('greedy_bf16') + ' / ' + verdict('greedy_fp32'):<17} "
                     f"{f'{ours:,.0f}' if ours else '-':>14} {f'{theirs:,.0f}' if theirs else '-':>15} "
                     f"{speedup:>6}  {' / '.join(decode)}")
    return "\n".join(lines)


def targets(m: dict) -> dict:
    """Issue 5's bars for one model: output tokens/s at least 10x transformers' static batching; decode step time
    within 1.5x of its floor."""
    ours = m.get("batchgen", {}).get("output_tokens_per_s")
    theirs = m.get("hf_static", {}).get("output_tokens_per_s")
    speedup = ours / theirs if ours and theirs else None
    return {"speedup_vs_hf_static": speedup, "speedup_at_least_10x": speedup is not None and speedup >= 10,
            "decode_within_1.5x_of_floor": {size: d["ratio_to_floor"] <= 1.5
                                            for size, d in m.get("decode", {}).items() if "ratio_to_floor" in d}}


def errors(record: dict) -> list[str]:
    """Where a step of the check raised: 'model/step' or 'model/decode/batch size'."""
    found = [f"device/{k}" for k, v in record["device"].items() if isinstance(v, dict) and "error" in v]
    for key, m in record["models"].items():
        found += [f"{key}/{k}" for k, v in m.items() if isinstance(v, dict) and "error" in v]
        found += [f"{key}/decode/{k}" for k, v in m.get("decode", {}).items() if isinstance(v, dict) and "error" in v]
    return found


def passed(record: dict) -> bool:
    """Correctness and completeness (the speed bars are reported, not gated): every greedy check that ran is ok
    and no step raised."""
    greedy_ok = all(m[name].get("ok", False) for m in record["models"].values()
                    for name in ("greedy_bf16", "greedy_fp32") if name in m)
    return greedy_ok and not errors(record)


# ------------------------------------------------------------------------------------------------------ command

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m batchgen.bench.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a ~1 minute smoke run: the 1B shape only, 100 requests, fewer prompts and steps")
    p.add_argument("--out", help="JSON file (default: bench-results/gpu-<UTC timestamp>.json)")
    p.add_argument("--models", nargs="+", choices=sorted(MODEL_CONFIGS), default=["1b", "8b"])
    p.add_argument("--requests", type=int, default=1000, help="synthetic offline workload: number of requests")
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=1000)
    p.add_argument("--output-min", type=int, default=100)
    p.add_argument("--output-max", type=int, default=500)
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds batchgen's workload may run per model")
    p.add_argument("--hf-requests", type=int, default=256, help="requests (a random subset) for transformers")
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--hf-time-limit", type=float, default=90.0,
                   help="transformers starts no new batch after this many seconds")
    p.add_argument("--skip-hf-throughput", action="store_true")
    p.add_argument("--greedy-prompts", type=int, default=6)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--bf16-rel-tol", type=float, default=2.0 ** -6,
                   help="bf16 near-tie tolerance relative to the logit (2**-6: 2 to 4 bf16 ulps)")
    p.add_argument("--no-fp32-check", dest="fp32_check", action="store_false",
                   help="skip the fp32 greedy check of the small model")
    p.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest request rounded up to 256, at least 2048")
    p.add_argument("--kv-cache-memory", help="a fixed KV budget, e.g. 40GiB (default: from free GPU memory)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of the whole check (with --models tiny and a --kv-cache-memory)")
    p.add_argument("--work-dir", help="where the checkpoints are written (default: a temp dir, removed after)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.models = ["1b"]
        args.requests = min(args.requests, 100)
        args.hf_requests = min(args.hf_requests, 64)
        args.hf_batch_size = min(args.hf_batch_size, 64)
        args.greedy_prompts, args.greedy_tokens, args.decode_steps = 4, 16, 16
    if args.max_model_len is None:
        longest = max(args.prompt_max + args.output_max, args.decode_context + args.decode_steps + 128, 512 + 64)
        args.max_model_len = max(2048, -(-longest // 256) * 256)
    return args


def describe_device(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
            "sms": props.multi_processor_count}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("the GPU check needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2
    import transformers

    device = torch.device(args.device)
    started = time.perf_counter()
    stamp = datetime.now(timezone.utc)
    record = {"started": stamp.isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else argv,
              "settings": vars(args),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": _version("triton"),
                           "transformers": transformers.__version__},
              "device": describe_device(device), "models": {}}
    small = device.type != "cuda"  # a dry run: measure the CPU quickly
    Phases(record["device"], "device").run("copy_bandwidth_bytes_per_s", lambda: copy_bandwidth(
        device, nbytes=2**26 if small else 2 * 2**30))
    Phases(record["device"], "device").run("bf16_matmul_flops_per_s", lambda: matmul_rate(
        device, n=512 if small else 8192))
    free_device_memory()

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="batchgen-gpu-check-"))
    try:
        for key in args.models:
            record["models"][key] = check_model(key, work_dir, device, record["device"], args)
            shutil.rmtree(work_dir / key, ignore_errors=True)
            free_device_memory()
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        record["wall_s"] = time.perf_counter() - started
        for m in record["models"].values():
            m["targets"] = targets(m)
        record["errors"] = errors(record)
        record["passed"] = passed(record)
        out = Path(args.out or f"bench-results/gpu-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nfull figures: {out}\n", file=sys.stderr)
    print(summary_table(record))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
