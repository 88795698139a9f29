"""Whether `engine.kv_cache_dtype: int8` pays for a job on this kind of CPU, from dev/bench_kv_int8.py records
(docs/performance-archive.jsonl, `"kind": "kv-int8"`) of the same CPU name, core count and instruction sets.

Why it depends on the job: an int8 cache holds a token in about half the bytes, so the pool holds about twice the
tokens, and a decode step reads half the KV bytes. A decode step reads every weight once and the KV of every row's
context, so int8 KV shortens the step where the contexts' KV outweighs the weights (long contexts, large batches),
and widens the decode batch where the pool is what limits it; on short rows (labeling) neither holds, and the
prefill's dequantization and the store's quantization cost a little. The record says how it came out on this CPU
kind: its decode step at a long context with each cache, and the labeling workload's time and agreement."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .throughput import same_cpu

FASTER = 1.05  # as precision_advice: past the measurements' run-to-run spread


def latest_kv_record(archive: Path, device: dict[str, Any]) -> dict[str, Any] | None:
    if not archive.is_file() or device.get("type") != "cpu":
        return None
    best = None
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "kv-int8" and same_cpu(record.get("machine", {}), device) \
                and (best is None or record["date"] >= best["date"]):
            best = record
    return best


def advise_kv_cache(archive: Path, device: dict[str, Any], kv_cache_dtype: str, context: int, pool_limited: bool
                    ) -> list[str]:
    """Plan lines on the KV cache's dtype for a job whose rows reach `context` tokens (median prompt + max_tokens)
    and whose decode batch the KV pool limits (`pool_limited`). Nothing without a record, unless the job asks for
    int8."""
    record = latest_kv_record(archive, device)
    if record is None:
        if kv_cache_dtype != "int8":
            return []
        return ["kv cache: int8 (half the bytes per token: the pool holds ~1.9x the tokens); no dev/bench_kv_int8.py "
                f"record for this CPU kind in {archive} says what it does to speed here"]
    lines = [f"kv cache: int8 against the model's dtype on this CPU kind: dev/bench_kv_int8.py {record['date'][:10]},"
             f" model {record.get('model')}, {record.get('dtype')}"]
    decode, labeling = record.get("decode"), record.get("labeling")
    speedup = None
    if decode:
        base, int8 = decode["cases"]
        speedup = base["best_ms"] / int8["best_ms"]
        lines.append(f"decode step, {decode['batch']} rows of {decode['context']:,} tokens: {base['best_ms']:,.0f} ms, "
                     f"int8 {int8['best_ms']:,.0f} ms ({speedup:.2f}x)")
    if labeling:
        base, int8 = labeling["cases"]
        agree = labeling["agreement"]
        lines.append(f"labeling ({labeling['rows']} short rows): {base['generation_s']:,.1f} s, int8 "
                     f"{int8['generation_s']:,.1f} s; the same choice label on {agree['label_share']:.0%} of rows, "
                     f"the same free greedy text on {agree['identical_share']:.0%}")
    long_rows = decode is not None and context >= decode["context"] // 2
    pays = pool_limited or (long_rows and speedup is not None and speedup >= FASTER)
    why = ("the KV pool limits this job's decode batch (int8 holds ~1.9x the rows)" if pool_limited else
           f"its rows reach ~{context:,} tokens, where int8's decode step is faster" if pays else
           f"its rows reach ~{context:,} tokens and the pool does not limit its batch")
    if kv_cache_dtype == "int8":
        lines.append(("pays for this job: " if pays else "does not pay for this job: ") + why
                     + ("" if pays else "; kv_cache_dtype: auto is as fast and changes no output"))
    else:
        lines.append(f"engine.kv_cache_dtype: int8 {'would pay' if pays else 'would not pay'} for this job: {why}"
                     + (" (outputs change: docs/job-file.md)" if pays else ""))
    return [lines[0]] + [f"  {line}" for line in lines[1:]]
