"""The table `batchgen run` prints at the end (stderr, after `batchgen: done`): _SUCCESS's summary, one line a
figure. A summary written by an earlier batchgen (a resumed output's) may lack the newer keys: they are left out."""
from __future__ import annotations


def summary_table(s: dict, path: str) -> str:
    from .runner import prompt_tokens_line

    resumed = f" (this run: {s['rows_this_run']})" if s.get("resumed") else ""
    samples = f"; {s['output_rows']:,} output rows (samples)" if s.get("output_rows", s["rows"]) != s["rows"] else ""
    lines = [
        ("rows", f"{s['rows']:,}{resumed}: {s['rows_ok']:,} ok, {s['rows_error']:,} error{samples}"),
        ("task", task_line(s)),
        ("prompt tokens", prompt_tokens_line(s)),
        *([("output tokens", output_tokens_line(s))] if s.get("task", "generate") == "generate" else []),
        ("wall time", f"{s['wall_s']:.1f} s"),
        *([("kernel build", kernel_build_line(s))] if s.get("kernel_build_s") else []),
        ("preemptions", f"{s['preemptions']:,}"),
        *([("dtype", s["dtype_reason"])] if s.get("dtype_reason") else []),
        *([("model path", model_path_line(stats))] if (stats := s.get("engine_stats") or {}).get("model_path") else []),
        *([("lora", lora_line(s))] if s.get("lora") else []),
        *([("speculative", speculative_line(stats))] if stats.get("speculative") else []),
        *([("attention", why)] if (why := (s.get("engine_stats") or {}).get("attention_backend_reason")) else []),
        *memory_lines(s),
        ("output", f"{path}  ({reader_hint(s, path)})"),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(["batchgen: done"] + [f"  {name:<{width}}  {value}" for name, value in lines])


def task_line(s: dict) -> str:
    """The task, and what its rows hold: generate's rate is on the output tokens line."""
    task = s.get("task", "generate")
    rate = f"{s['rows_this_run'] / s['generation_s']:,.1f} rows/s" if s.get("generation_s") else None
    if task == "embed":
        what = f"embeddings of {s.get('embedding_dimensions') or '?'} dimensions; " \
               f"{rows(s.get('truncated_rows', 0))} truncated to the model's maximum length"
    elif task == "classify":
        labels = s.get("labels") or []
        shown = ", ".join(labels[:8]) + (f", ... ({len(labels)} in all)" if len(labels) > 8 else "")
        what = f"labels {shown}; {rows(s.get('truncated_rows', 0))} truncated to the model's maximum length"
    elif task == "score":
        what = f"{s.get('scored_tokens', 0):,} tokens scored"
    else:
        return "generate"
    return f"{task}: {what}" + (f" ({rate} over this run's {s['generation_s']:,.1f} s)" if rate else "")


def lora_line(s: dict) -> str:
    """The job's adapters, how many were resident at once and how often one was read into the model."""
    stats = s.get("engine_stats") or {}
    names = ", ".join(s["lora"])
    if not stats.get("lora_slots"):
        return f"{len(s['lora'])} adapters ({names})"
    return f"{len(s['lora'])} adapters ({names}), {stats['lora_slots']} resident at once, read into the model " \
           f"{stats['lora_loads']:,} times ({_mib(stats['lora_bytes'])})"


def speculative_line(stats: dict) -> str:
    """The proposer and how many of its guesses stood."""
    guessed, stood = stats.get("spec_draft_tokens", 0), stats.get("spec_accepted_tokens", 0)
    rate = f" ({stood / guessed:.0%} acceptance rate)" if guessed else ""
    return f"{stats['speculative']}: {guessed:,} tokens guessed, {stood:,} stood{rate}"


def rows(n: int) -> str:
    return f"{n:,} row{'' if n == 1 else 's'}"


def model_path_line(stats: dict) -> str:
    if stats["model_path"] == "generic":
        return f"generic: transformers' {stats['architecture']} code on batchgen's engine"
    return f"native: batchgen's {stats['architecture']}"


def output_tokens_line(s: dict) -> str:
    """The output tokens and the job's own rate: over its generation (from the model ready to the last row), so
    neither the model load nor a first run's kernel build counts against it."""
    if "generation_s" not in s:  # a summary from before generation_s: its rate was over the wall time
        return f"{s['output_tokens']:,} ({s['output_tokens_per_s']:,.1f} tok/s this run)"
    return (f"{s['output_tokens']:,} ({s['output_tokens_per_s']:,.1f} tok/s over this run's "
            f"{s['generation_s']:,.1f} s of generation)")


def kernel_build_line(s: dict) -> str:
    return (f"{s['kernel_build_s']:.1f} s of the wall time compiling the C++ CPU kernels: once per machine, cached "
            f"for later runs (not in the tok/s)")


def memory_lines(s: dict) -> list[tuple[str, str]]:
    """Peak RSS against the bound weights + the KV blocks used + 1 GiB, and the KV pool: its size and why."""
    peak, bound, e = s["peak_memory_bytes"], s.get("memory_bound_bytes"), s.get("engine_stats") or {}
    if not bound:
        return [("peak memory", _mib(peak))]
    if not e.get("kv_pool_bytes"):  # an encoder keeps no KV cache
        return [("peak memory", f"{_mib(peak)} (bound {_mib(bound)}: weights {_mib(e['weights_bytes'])} + 1 GiB)")]
    return [("peak memory", f"{_mib(peak)} (bound {_mib(bound)}: weights {_mib(e['weights_bytes'])} + KV used "
                            f"{_mib(e['kv_bytes_touched'])} + 1 GiB)"),
            ("KV pool", f"{_mib(e['kv_pool_bytes'])} from {e['kv_pool_reason']}; at most "
                        f"{_mib(e['kv_peak_bytes_used'])} in use at once")]


def reader_hint(summary: dict, path: str) -> str:
    fmt = ((summary.get("job") or {}).get("output") or {}).get("format", "parquet")
    return f'polars.read_parquet("{path}/*.parquet")' if fmt == "parquet" else f'JSON lines: {path}/part-*.jsonl'


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
