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


def latest_kv_records(archive: Path, device: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """This CPU kind's latest record with a decode part, and its latest with a labeling part (the default model's
    where there is one: records of other models, or of float weights, measure the cache on those)."""
    if not archive.is_file() or device.get("type") != "cpu":
        return None, None
    latest: dict[str, dict] = {}
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") != "kv-int8" or not same_cpu(record.get("machine", {}), device):
            continue
        for part in ("decode", "labeling"):
            rank = (part == "decode" or record.get("model") == "default", record["date"])
            held = latest.get(part)
            if part in record and (held is None or rank >= (part == "decode" or held.get("model") == "default",
                                                            held["date"])):
                latest[part] = record
    return latest.get("decode"), latest.get("labeling")


def advise_kv_cache(archive: Path, device: dict[str, Any], kv_cache_dtype: str, context: int, pool_limited: bool
                    ) -> list[str]:
    """Plan lines on the KV cache's dtype for a job whose rows reach `context` tokens (median prompt + max_tokens)
    and whose decode batch the KV pool limits (`pool_limited`). Nothing without a record, unless the job asks for
    int8."""
    decode_record, labeling_record = latest_kv_records(archive, device)
    if decode_record is None and labeling_record is None:
        if kv_cache_dtype != "int8":
            return []
        return ["kv cache: int8 (half the bytes per token: the pool holds ~1.9x the tokens); no dev/bench_kv_int8.py "
                f"record for this CPU kind in {archive} says what it does to speed here"]
    lines = ["kv cache: int8 against the model's dtype on this CPU kind (dev/bench_kv_int8.py):"]
    decode = decode_record and decode_record["decode"]
    speedup = None
    if decode:
        base, int8 = decode["cases"]
        speedup = base["best_ms"] / int8["best_ms"]
        lines.append(f"decode step, {decode['batch']} rows of {decode['context']:,} tokens ({decode_record['date'][:10]},"
                     f" model {decode_record.get('model')}, {decode_record.get('dtype')}): {base['best_ms']:,.0f} ms, "
                     f"int8 {int8['best_ms']:,.0f} ms ({speedup:.2f}x)")
    if labeling_record:
        labeling = labeling_record["labeling"]
        base, int8 = labeling["cases"]
        agree = labeling["agreement"]
        decided = (f" ({agree['decided_same_labels']}/{agree['decided_labels']} of those not near a tie)"
                   if "decided_labels" in agree else "")
        lines.append(f"labeling ({labeling['rows']} short rows, {labeling_record['date'][:10]}, model "
                     f"{labeling_record.get('model')}, {labeling_record.get('dtype')}): {base['generation_s']:,.1f} s, "
                     f"int8 {int8['generation_s']:,.1f} s; the same choice label on {agree['label_share']:.0%} of "
                     f"rows{decided}, the same free greedy text on {agree['identical_share']:.0%}")
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
