"""`batchgen bench --roofline`: where one engine step stands against the machine's floor, all measured in one run.

The machine's rates (memory read bandwidth, matmul FLOP/s per dtype: ceiling.py), then per dtype a `ModelRunner`
built by the engine's own `startup.set_up` (so whatever the engine does to its model or its attention shows up
here), its KV cache filled with random data, and synthetic sequences that are already `context - 1` tokens in:
decode steps at each (batch, context) and one prefill step of fresh prompts, each timed through
`ModelRunner.execute` (forward, LM head, sampling) and set against its floor (roofline_floor.py)."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from . import ceiling, report
from .roofline_floor import ModelCounts, decode_floor, prefill_floor
from .system_types import DTYPES

# What an engine step should reach (issue #10): time / floor for decode, share of the matmul rate for prefill.
TARGETS = {"decode_ratio_batch_ge_32": 1.5, "decode_ratio_batch_lt_32": 2.0, "prefill_share_of_matmul": 0.8}
HEADROOM_BYTES = 2 * 2**30  # activations of the largest step and the rest of the process, beside weights and KV


@dataclass
class RooflineConfig:
    model: str = "default"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    quantizations: tuple[str | None, ...] = (None,)  # each dtype with each (None: unquantized); the engine's names
    batches: tuple[int, ...] = (1, 8, 32, 64, 256)
    contexts: tuple[int, ...] = (128, 1024)
    prefill_seqs: int = 4  # the prefill step: prefill_seqs fresh prompts of prefill_len tokens (0: none)
    prefill_len: int = 1024
    warmup: int = 2
    reps: int = 5
    kv_cache_memory: str | int | None = None  # a cap: cases whose KV needs more are skipped (default: free memory)
    bandwidth_bytes: int = 2**30
    matmul_n: int = 2048
    seed: int = 0
    out_dir: str = "bench-results"
    archive: str = "docs/performance-archive.jsonl"

    def validate(self) -> None:
        from batchgen.engine.engine_args import parse_bytes

        from batchgen.engine.engine_args import QUANTIZATIONS

        if not self.dtypes or any(d not in DTYPES for d in self.dtypes):
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {', '.join(self.dtypes) or 'none'}")
        if not self.quantizations or any(q is not None and q not in QUANTIZATIONS for q in self.quantizations):
            raise ValueError(f"--quantization must be a comma-separated list of none, {', '.join(QUANTIZATIONS)}; "
                             f"got {', '.join(str(q) for q in self.quantizations) or 'nothing'}")
        for name in ("batches", "contexts"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"--roofline-{name} must be positive integers, got {values}")
        for name, least in (("prefill_seqs", 0), ("prefill_len", 0), ("reps", 1), ("warmup", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)


@dataclass
class StepTime:
    best_s: float
    median_s: float
    times_s: list[float]


def run_roofline(config: RooflineConfig, log: Callable[[str], None] = print, write: bool = True) -> dict[str, Any]:
    """Measure and return the record; with `write`, also write it to --out and append it to the archive."""
    from .harness import git_commit, machine_info, resolved_dtype

    config.validate()
    started_at = datetime.now(timezone.utc)
    commit = git_commit()
    log("roofline: measuring memory bandwidth and matmul rates")
    bandwidth = ceiling.memory_bandwidth(config.bandwidth_bytes)
    dtypes = list(dict.fromkeys(resolved_dtype(name, "cpu") for name in config.dtypes))
    matmul = {dtype: ceiling.matmul_flops(config.matmul_n, dtype=dtype) for dtype in dtypes}
    decode, prefill, models, skipped = [], [], {}, []
    for dtype in dtypes:
        for quantization in dict.fromkeys(config.quantizations):
            name = variant_name(dtype, quantization)
            problem = quantization_problem(quantization, dtype)
            if problem:
                log(f"roofline: {name}: skipped, {problem}")
                skipped.append({"dtype": dtype, "quantization": quantization, "skipped": problem})
                continue
            measured = measure_dtype(config, dtype, quantization, bandwidth["bytes_per_s"], matmul[dtype]["flops"],
                                     log)
            decode += measured["decode"]
            prefill.append(measured["prefill"])
            models[name] = measured["model"]
    record = {"kind": "roofline", "date": started_at.isoformat(), "git_commit": commit, "machine": machine_info(),
              "config": dataclasses.asdict(config), "model": config.model,
              "rates": {"memory": bandwidth, "matmul": matmul}, "models": models, "decode": decode,
              "prefill": prefill, "skipped_variants": skipped, "targets": TARGETS}
    if write:
        stamp = started_at.strftime("%Y%m%d-%H%M%S")
        record_path = Path(config.out_dir) / f"roofline-{stamp}.json"
        report.write_record(record, record_path)
        report.append_archive(record, Path(config.archive))
        record["paths"] = {"record": str(record_path), "archive": config.archive}
    return record


def variant_name(dtype: str, quantization: str | None) -> str:
    """'float32', 'bfloat16+int8-weight-only': the key of a (dtype, quantization) in the record's models."""
    return dtype if quantization is None else f"{dtype}+{quantization}"


def quantization_problem(quantization: str | None, dtype: str) -> str | None:
    """Why the engine would refuse this pair on the CPU (startup.check_quantization), or None."""
    import torch

    from batchgen.engine.cpu_features import DtypeChoice
    from batchgen.engine.engine_plan import check_quantization
    from batchgen.engine.errors import SettingError

    try:
        check_quantization(quantization, DtypeChoice(getattr(torch, dtype), "bench --dtype"), torch.device("cpu"))
    except SettingError as exc:
        return str(exc)
    return None


def measure_dtype(config: RooflineConfig, dtype: str, quantization: str | None, bandwidth: float, flop_rate: float,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """One (dtype, quantization): the model set up as the engine sets it up, then its decode cases and prefill.
    The floor's matmul rate is the dtype's (what int8 kernels reach is not measured apart)."""
    import numpy as np

    from batchgen.engine import EngineArgs
    from batchgen.engine.startup import set_up

    block_size = EngineArgs.block_size
    kv_per_token, limit, limit_note = kv_plan(config, dtype, quantization)
    name = variant_name(dtype, quantization)
    blocks_of = lambda tokens: -(-tokens // block_size)  # noqa: E731
    cases = sorted(((b, c) for c in config.contexts for b in config.batches), key=lambda bc: (bc[1], bc[0]))
    need = {case: case[0] * blocks_of(case[1]) * block_size * kv_per_token for case in cases}
    prefill_need = config.prefill_seqs * blocks_of(config.prefill_len) * block_size * kv_per_token
    fitting = [case for case in cases if need[case] <= limit]
    num_blocks = max([2] + [need[c] // (block_size * kv_per_token) for c in fitting]
                     + ([prefill_need // (block_size * kv_per_token)] if prefill_need <= limit else []))
    log(f"roofline: {name}: loading the model, KV cache {num_blocks * block_size * kv_per_token / 2**30:.2f} GiB "
        f"({limit_note})")
    setup = set_up(EngineArgs(model=config.model, dtype=dtype, device="cpu", enable_prefix_caching=False,
                              kv_cache_memory=num_blocks * block_size * kv_per_token, quantization=quantization))
    runner = setup.runner
    assert setup.plan.kv_bytes_per_token == kv_per_token  # the engine's plan, from the same description
    runner.kv_cache.uniform_(-1.0, 1.0)  # random keys and values: no step reads zeros
    counts = ModelCounts.of(setup, kv_per_token)
    rng = np.random.default_rng(config.seed)
    vocab = setup.model.vocab_size

    decode = []
    for batch, context in cases:
        entry: dict[str, Any] = {"dtype": dtype, "quantization": quantization, "batch": batch, "context": context,
                                 "kv_bytes": need[(batch, context)]}
        floor = decode_floor(counts, batch, context, bandwidth, flop_rate)
        entry["floor"] = dataclasses.asdict(floor)
        if context > setup.model.max_model_len:
            entry["skipped"] = f"context {context} is past the model's {setup.model.max_model_len} positions"
        elif (batch, context) not in fitting:
            entry["skipped"] = f"needs {need[(batch, context)] / 2**30:.1f} GiB of KV cache; {limit_note}"
        if "skipped" in entry:
            log(f"roofline: {name} decode B={batch} ctx={context}: skipped, {entry['skipped']}")
            decode.append(entry)
            continue
        seqs = synthetic_sequences(batch, context, context - 1, block_size, vocab, rng)
        timed = time_step(runner, {seq: 1 for seq in seqs}, config.warmup, config.reps)
        entry.update(dataclasses.asdict(timed), ratio=timed.best_s / floor.floor_s)
        entry["target"] = decode_target(batch)
        decode.append(entry)
        log(f"roofline: {name} decode B={batch} ctx={context}: {timed.best_s * 1e3:,.2f} ms, floor "
            f"{floor.floor_s * 1e3:,.2f} ms ({floor.bound}), {entry['ratio']:.2f}x")

    prefill: dict[str, Any] = {"dtype": dtype, "quantization": quantization, "seqs": config.prefill_seqs,
                               "seq_len": config.prefill_len,
                               "tokens": config.prefill_seqs * config.prefill_len, "kv_bytes": prefill_need}
    floor = prefill_floor(counts, config.prefill_seqs, config.prefill_len, bandwidth, flop_rate)
    prefill["floor"] = dataclasses.asdict(floor)
    if not config.prefill_seqs or not config.prefill_len:
        prefill["skipped"] = "not asked for (--roofline-prefill none)"
    elif config.prefill_len > setup.model.max_model_len:
        prefill["skipped"] = f"{config.prefill_len} tokens are past the model's {setup.model.max_model_len} positions"
    elif prefill_need > limit:
        prefill["skipped"] = f"needs {prefill_need / 2**30:.1f} GiB of KV cache; {limit_note}"
    else:
        seqs = synthetic_sequences(config.prefill_seqs, config.prefill_len, 0, block_size, vocab, rng)
        timed = time_step(runner, {seq: config.prefill_len for seq in seqs}, config.warmup, config.reps)
        prefill.update(dataclasses.asdict(timed), ratio=timed.best_s / floor.floor_s,
                       share_of_matmul=floor.flops / timed.best_s / flop_rate,
                       target=TARGETS["prefill_share_of_matmul"])
        log(f"roofline: {name} prefill {config.prefill_seqs}x{config.prefill_len}: {timed.best_s * 1e3:,.1f} ms, "
            f"{prefill['share_of_matmul']:.0%} of the matmul rate")
    model = {"counts": counts.describe(), "num_blocks": num_blocks, "kv_cache_bytes": runner.kv_cache.nbytes,
             "torch_dtype": str(setup.dtype.dtype)}
    del setup, runner
    gc.collect()  # the next dtype's weights and cache go where these were
    return {"decode": decode, "prefill": prefill, "model": model}


def kv_plan(config: RooflineConfig, dtype: str, quantization: str | None = None) -> tuple[int, int, str]:
    """(KV bytes per token, the most KV cache this dtype's cases may take, why that much): the memory free now
    (machine.free_memory: under this cgroup's limit too) less the weights (from the model's description: headers)
    and a headroom, or the --kv-cache-memory cap if lower."""
    import torch

    from batchgen.engine.engine_args import parse_bytes
    from batchgen.engine.engine_plan import kv_bytes_per_token
    from batchgen.job.plan.memory import inspect_model
    from batchgen.machine import free_memory
    from batchgen.models.loader import resolve_model

    torch_dtype = getattr(torch, dtype)
    model, weights = inspect_model(resolve_model(config.model), torch_dtype, on_cpu=True, quantization=quantization)
    kv_per_token = kv_bytes_per_token(model, torch_dtype)
    available, source = free_memory()
    limit = available - weights.loaded - weights.mapped - HEADROOM_BYTES
    note = (f"{available / 2**30:.1f} GiB {source} less weights {(weights.loaded + weights.mapped) / 2**30:.1f} "
            f"GiB and {HEADROOM_BYTES / 2**30:.0f} GiB headroom leave {max(limit, 0) / 2**30:.1f} GiB")
    if config.kv_cache_memory is not None and parse_bytes(config.kv_cache_memory) < limit:
        limit = parse_bytes(config.kv_cache_memory)
        note = f"--kv-cache-memory caps it at {limit / 2**30:.1f} GiB"
    return kv_per_token, limit, note


def synthetic_sequences(count: int, length: int, computed: int, block_size: int, vocab: int, rng) -> list:
    """`count` running sequences of `length` random tokens, `computed` of them already in the KV cache, each on
    its own blocks (sequence i on blocks i x n .. i x n + n - 1)."""
    from batchgen.engine import SamplingParams
    from batchgen.engine.block_pool import KVBlock
    from batchgen.engine.sequence import Sequence, SequenceStatus

    per_seq = -(-length // block_size)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = []
    for i in range(count):
        seq = Sequence(i, rng.integers(0, vocab, length).tolist(), length, params, seed=i,
                       arrival_time=time.monotonic(), status=SequenceStatus.RUNNING, num_computed_tokens=computed)
        seq.block_ids.extend([KVBlock(b) for b in range(i * per_seq, (i + 1) * per_seq)])
        seqs.append(seq)
    return seqs


def time_step(runner, scheduled: dict, warmup: int, reps: int) -> StepTime:
    """`runner.execute(scheduled)` `warmup` times untimed, then `reps` times timed. A step changes no sequence (the
    scheduler appends the sampled token, not the runner), so every repetition is the same step."""
    for _ in range(warmup):
        runner.execute(scheduled)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        runner.execute(scheduled)
        times.append(time.perf_counter() - started)
    return StepTime(min(times), statistics.median(times), times)


def decode_target(batch: int) -> float:
    return TARGETS["decode_ratio_batch_ge_32" if batch >= 32 else "decode_ratio_batch_lt_32"]
