"""The GPU check's closing table: one line per step, from the steps' JSON files, with its verdict and main
figures."""
from __future__ import annotations


def _verdict(record: dict) -> str:
    if record.get("ok"):
        return "skip" if record.get("skipped") else "ok"
    return "FAIL" if record.get("finished") else "STOP"


def _greedy(check: dict | None) -> str:
    if not check:
        return "-"
    if "ok" not in check:
        return "skipped" if "skipped" in check else "ERR"
    parts = [f"{check[k]['identical']}/{check[k]['prompts']} {k}" for k in ("alone", "batched") if k in check]
    return f"{'ok' if check['ok'] else 'FAIL'} ({', '.join(parts)} identical)"


def _detail(record: dict) -> str:
    name = record.get("name")
    if name == "environment":
        gpu, versions = record.get("gpu") or {}, record.get("versions") or {}
        missing = record.get("missing") or {}
        text = (f"{gpu.get('name')}, driver {(record.get('driver') or {}).get('nvidia_smi')}, torch "
                f"{versions.get('torch')}, triton {versions.get('triton')}, transformers {versions.get('transformers')}")
        return text + (f"; missing: {', '.join(missing)}" if missing else "")
    if name == "kernel_tests":
        if record.get("skipped"):
            return f"skipped: {record['skipped']}"
        counts = record.get("counts") or {}
        return ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    if name == "greedy":
        return f"bf16 {_greedy(record.get('greedy_bf16'))}; fp32 {_greedy(record.get('greedy_fp32'))}"
    if name == "throughput":
        ours = (record.get("batchgen") or {}).get("output_tokens_per_s")
        theirs = (record.get("hf_static") or {}).get("output_tokens_per_s")
        text = f"batchgen {ours:,.0f} tok/s" if ours else "batchgen -"
        text += f" vs HF static {theirs:,.0f} tok/s" if theirs else " vs HF static -"
        text += f" ({ours / theirs:.1f}x)" if ours and theirs else ""
        decode = [f"{size}: {d['median_s'] * 1e3:.2f} ms ({d['ratio_to_floor']:.2f}x floor)"
                  for size, d in (record.get("decode") or {}).items() if "median_s" in d]
        kv = record.get("kv_int8") or {}
        if "int8_over_bf16" in kv:
            decode.append(f"int8 KV {kv['int8_over_bf16']:.2f}x bf16's time ({'agrees' if kv['ok'] else 'DIFFERS'})")
        return text + ("; decode " + ", ".join(decode) if decode else "")
    return ""


def summary_table(records: list[dict]) -> str:
    lines = []
    for r in records:
        line = f"step {r.get('step')} {r.get('name', ''):<13} {_verdict(r):<5} {r.get('wall_s') or 0:6.0f} s  {_detail(r)}"
        if r.get("error"):
            line += f"\n         error: {r['error'].splitlines()[0][:200]}"
        lines.append(line)
    return "\n".join(lines)
