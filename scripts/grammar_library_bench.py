"""Issue 12's measurement: xgrammar against llguidance on the default model's 49,152-token vocabulary
(docs/structured-output.md, "Choosing the grammar library").

For each library and each constraint kind (a labeling JSON schema, a date regex, a 9-way choice as a regex
alternation, a small arithmetic grammar in the library's own dialect) it times the tokenizer-info build, the compile
(cold, then the same text again), the matcher creation, and the per-step bitmask fill while B = 1, 64, 256 matchers
walk the real tokens of a valid output (then its EOS), through the library's batch API and through a plain loop.
JSON is compiled as batchgen compiles it: compact (no free whitespace).
It also times applying the bitmask to fp32 logits [B, 49152] (each library's CPU apply against a plain torch unpack)
and the resident memory each stage adds.

Each library runs in its own child process (this script with --library), so neither one's imports or caches count
against the other. Usage: python scripts/grammar_library_bench.py [--out FILE] [--threads N]
Prints one JSON record and markdown tables. On a machine that other work shares, use --threads 1: a multi-threaded op
waits a whole scheduler slice (~16 ms here) for a thread whose core is taken, which swamps sub-millisecond figures."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

LIBRARIES = ("xgrammar", "llguidance")
BATCH_SIZES = (1, 64, 256)
APPLY_REPS = 30
CREATE_REPS = 20
MEMORY_MATCHERS = 64

LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral", "mixed"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "details": {
            "type": "object",
            "properties": {"language": {"type": "string", "enum": ["en", "de", "fr", "es", "other"]},
                           "sarcasm": {"type": "boolean"}},
            "required": ["language", "sarcasm"],
            "additionalProperties": False,
        },
    },
    "required": ["label", "confidence", "topics", "details"],
    "additionalProperties": False,
}
CHOICES = ("arts", "business", "health", "politics", "science", "sports", "technology", "travel", "weather")
XGRAMMAR_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
LLGUIDANCE_LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
# llguidance's equivalent of xgrammar's any_whitespace=False, which batchgen uses (a small model given free
# whitespace can emit blank lines until max_tokens)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# kind -> (constraint text, a valid output whose real tokens the matchers walk)
CONSTRAINTS = {
    "json_schema": (json.dumps(LABEL_SCHEMA),
                    '{"label": "negative", "confidence": 87, "topics": ["battery life", "customer service"], '
                    '"details": {"language": "en", "sarcasm": false}}'),
    "regex": (r"\d{4}-\d{2}-\d{2}", "2024-03-15"),
    "choice": ("(" + "|".join(CHOICES) + ")", "technology"),
    "grammar": (None, "(12+34)*5-678/9"),  # the text is the library's own dialect, above
}
# ~1,000 tokens, for the matchers' memory as the output grows
LONG_JSON_OUTPUT = CONSTRAINTS["json_schema"][1].replace(
    "battery life", " ".join(["the battery life is great but the customer service was slow"] * 100))


class XgrammarAdapter:
    """xgrammar: a GrammarCompiler (with its cache) per vocabulary, a CompiledGrammar per text, a GrammarMatcher per
    sequence; BatchGrammarMatcher fills many rows on a thread pool."""
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], threads: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    @staticmethod
    def load() -> str:
        """Import the library; its version."""
        import xgrammar  # noqa: F401
        return importlib.metadata.version("xgrammar")

    @staticmethod
    def load_apply() -> None:
        """The CPU apply needs nothing beyond the import."""

    def compile(self, kind: str, text: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text, any_whitespace=False)  # as batchgen compiles it
        if kind == "grammar":
            return self.compiler.compile_grammar(XGRAMMAR_EBNF)
        return self.compiler.compile_regex(text)

    def compiled_bytes(self, compiled) -> int | None:
        return compiled.memory_size_bytes

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill_batch(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def fill_loop(matchers, bitmask) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def finished(matcher) -> bool:
        return matcher.is_terminated()

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LlguidanceAdapter:
    """llguidance: an LLTokenizer per vocabulary; a grammar text becomes an LLMatcher directly (no compiled object and
    no cache: the engine would keep one matcher per text and deep_copy it per sequence); LLExecutor fills many rows
    on a thread pool. Its torch apply lives in llguidance.torch, imported only for the apply (it pulls in
    torch.compile)."""
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], threads: int):
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    @staticmethod
    def load() -> str:
        """Import the library; its version."""
        import llguidance
        import llguidance.hf  # noqa: F401
        return importlib.metadata.version("llguidance")

    @staticmethod
    def load_apply() -> None:
        import llguidance.torch  # noqa: F401

    def compile(self, kind: str, text: str):
        source = {"json_schema": lambda: self.llg.LLMatcher.grammar_from_json_schema(text, defaults=COMPACT_JSON),
                  "grammar": lambda: self.llg.LLMatcher.grammar_from_lark(LLGUIDANCE_LARK),
                  }.get(kind, lambda: self.llg.LLMatcher.grammar_from_regex(text))()
        matcher = self.llg.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance refused the {kind}: {matcher.get_error()}")
        return matcher

    def compiled_bytes(self, compiled) -> int | None:
        return None

    @staticmethod
    def matcher(compiled):
        return compiled.deep_copy()

    def fill_batch(self, matchers, bitmask) -> None:
        # what llguidance.torch.fill_next_token_bitmask_par does, without importing llguidance.torch
        self.executor.unsafe_compute_mask_ptr([(m, row) for row, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    @staticmethod
    def fill_loop(matchers, bitmask) -> None:
        row_bytes = bitmask.shape[1] * 4
        for row, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    @staticmethod
    def finished(matcher) -> bool:
        return matcher.is_stopped()

    @staticmethod
    def apply(logits, bitmask) -> None:
        import llguidance.torch
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)


ADAPTERS = {"xgrammar": XgrammarAdapter, "llguidance": LlguidanceAdapter}


def heap_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2; None elsewhere). Per-matcher costs are read
    here, not from RSS: RSS does not grow while malloc reuses what earlier stages freed."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def matcher_memory_kib(adapter, compiled, tokens: list[int], vocab_size: int) -> dict:
    """Heap per matcher, fresh and after walking `tokens` (filling its mask at every step), over MEMORY_MATCHERS;
    a matcher keeps every step's state (both libraries can roll back), so it grows with the output."""
    import torch
    bitmask = torch.zeros((MEMORY_MATCHERS, (vocab_size + 31) // 32), dtype=torch.int32)
    start = heap_bytes()
    if start is None:
        return {"fresh": None, "walked": None, "tokens": len(tokens), "per_token": None}
    matchers = [adapter.matcher(compiled) for _ in range(MEMORY_MATCHERS)]
    fresh = heap_bytes()
    for token in tokens:
        adapter.fill_loop(matchers, bitmask)
        if not all(adapter.accept(matcher, token) for matcher in matchers):
            raise RuntimeError(f"{adapter.name}: a matcher refused token {token} of the long JSON output")
    walked = heap_bytes()
    return {"fresh": (fresh - start) / 1024 / MEMORY_MATCHERS, "walked": (walked - start) / 1024 / MEMORY_MATCHERS,
            "tokens": len(tokens), "per_token": (walked - fresh) / 1024 / MEMORY_MATCHERS / len(tokens)}


def memory_mib() -> dict:
    import psutil
    heap = heap_bytes()
    return {"rss": psutil.Process().memory_info().rss / 2**20, "heap": None if heap is None else heap / 2**20}


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def torch_unpack_apply(logits, bitmask) -> None:
    """The comparison: bits -> bool mask with shifts, then masked_fill."""
    logits.masked_fill_(~allowed_tokens(bitmask)[:, :logits.shape[1]], float("-inf"))


def allowed_tokens(bitmask):
    """[B, words] int32 bitmask -> [B, words * 32] bool, True where the token is allowed."""
    import torch
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()


def walk(adapter, compiled, tokens: list[int], batch: int, vocab_size: int, fill) -> dict:
    """`batch` matchers walk `tokens`; each step fills all their bitmasks (timed), checks that every row got the
    same mask and that it allows the next token, then every matcher accepts it (timed)."""
    import torch
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    matchers = [adapter.matcher(compiled) for _ in range(batch)]
    fills, accepts, masks = [], [], []
    for step, token in enumerate(tokens):
        bitmask.fill_(0)
        _, seconds = timed(lambda: fill(matchers, bitmask))
        fills.append(seconds)
        if not torch.equal(bitmask, bitmask[:1].expand_as(bitmask)):
            raise RuntimeError(f"{adapter.name}: step {step}: matchers in the same state filled different masks")
        if not allowed_tokens(bitmask[:1])[0, token]:
            raise RuntimeError(f"{adapter.name}: step {step} masks out the walk's own token {token}")
        masks.append(bitmask[0].clone())
        accepted, seconds = timed(lambda: [adapter.accept(m, token) for m in matchers])
        accepts.append(seconds)
        if not all(accepted):
            raise RuntimeError(f"{adapter.name}: a matcher refused token {token} at step {step}")
    if not all(adapter.finished(m) for m in matchers):
        raise RuntimeError(f"{adapter.name}: the matchers did not finish after the walk's EOS")
    return {"fill_mean_ms": statistics.mean(fills) * 1e3, "fill_p95_ms": p95(fills) * 1e3,
            "fill_max_ms": max(fills) * 1e3, "accept_mean_ms": statistics.mean(accepts) * 1e3,
            "masks": masks}


def measure_apply(adapter, mask_row, batch: int, vocab_size: int) -> dict:
    """The library's apply and the torch unpack, `mask_row` on every row of random fp32 logits [batch, vocab]
    (copied in before each call); the two must mask the same tokens."""
    import torch
    bitmask = mask_row.unsqueeze(0).repeat(batch, 1)
    base = torch.randn(batch, vocab_size, dtype=torch.float32)
    results = {}
    for name, apply in (("library", adapter.apply), ("torch_unpack", torch_unpack_apply)):
        logits = base.clone()
        _, first = timed(lambda: apply(logits, bitmask))
        times = []
        for _ in range(APPLY_REPS):
            logits.copy_(base)
            _, seconds = timed(lambda: apply(logits, bitmask))
            times.append(seconds)
        results[name] = {"first_ms": first * 1e3, "median_ms": statistics.median(times) * 1e3,
                         "min_ms": min(times) * 1e3, "masked": torch.isneginf(logits)}
    if not torch.equal(results["library"]["masked"], results["torch_unpack"]["masked"]):
        raise RuntimeError(f"{adapter.name}: its apply and the torch unpack masked different tokens")
    return {name: {k: v for k, v in r.items() if k != "masked"} for name, r in results.items()}


def run_library(library: str, threads: int) -> dict:
    """Everything measured for one library, in this (fresh) process."""
    import torch
    from batchgen.models.loader import eos_token_ids, load_tokenizer, resolve_model

    torch.set_num_threads(threads)
    model_dir = resolve_model("default")
    tokenizer = load_tokenizer(model_dir)
    vocab_size, eos_ids = len(tokenizer), eos_token_ids(model_dir, tokenizer)
    adapter_class = ADAPTERS[library]
    record: dict = {"library": library, "vocab_size": vocab_size, "eos_ids": eos_ids}

    memory = {"baseline": memory_mib()}
    record["version"], record["import_s"] = timed(adapter_class.load)
    memory["import"] = memory_mib()
    adapter, record["tokenizer_info_s"] = timed(lambda: adapter_class(tokenizer, vocab_size, eos_ids, threads))
    memory["tokenizer_info"] = memory_mib()

    kinds, compiled = {}, {}
    for kind, (text, output) in CONSTRAINTS.items():
        compiled[kind], cold = timed(lambda: adapter.compile(kind, text))
        _, second = timed(lambda: adapter.compile(kind, text))
        create = min(timed(lambda: adapter.matcher(compiled[kind]))[1] for _ in range(CREATE_REPS))
        tokens = tokenizer.encode(output, add_special_tokens=False) + [eos_ids[0]]
        kinds[kind] = {"compile_cold_ms": cold * 1e3, "compile_second_ms": second * 1e3,
                       "matcher_create_us": create * 1e6, "compiled_bytes": adapter.compiled_bytes(compiled[kind]),
                       "walk_tokens": len(tokens), "walk_output": output, "batches": {}}
    memory["compile_4_constraints"] = memory_mib()

    json_tokens = tokenizer.encode(LONG_JSON_OUTPUT, add_special_tokens=False) + [eos_ids[0]]
    record["json_matcher_heap_kib"] = matcher_memory_kib(adapter, compiled["json_schema"], json_tokens, vocab_size)

    json_masks = None
    for kind, (_, output) in CONSTRAINTS.items():
        tokens = tokenizer.encode(output, add_special_tokens=False) + [eos_ids[0]]
        for batch in BATCH_SIZES:
            entry = {}
            for api, fill in (("batch_api", adapter.fill_batch), ("loop", adapter.fill_loop)):
                result = walk(adapter, compiled[kind], tokens, batch, vocab_size, fill)
                if kind == "json_schema" and batch == 256 and api == "batch_api":
                    json_masks = result["masks"]
                entry[api] = {k: v for k, v in result.items() if k != "masks"}
            kinds[kind]["batches"][batch] = entry
    record["constraints"] = kinds

    # the JSON walk's step with the fewest allowed tokens (nearly every logit is written) and the most (few are)
    counts = [int(allowed_tokens(mask[None])[0, :vocab_size].sum()) for mask in json_masks]
    record["json_allowed_per_step"] = counts
    special = [i for i, added in tokenizer.added_tokens_decoder.items() if added.special and i not in eos_ids]
    inside_string = allowed_tokens(json_masks[counts.index(max(counts))][None])[0]
    record["special_tokens_allowed_in_json_string"] = f"{int(inside_string[special].sum())} of {len(special)}"
    steps = {"fewest_allowed": counts.index(min(counts)), "most_allowed": counts.index(max(counts))}
    memory["before_apply_import"] = memory_mib()
    _, record["apply_import_s"] = timed(adapter_class.load_apply)
    memory["apply_import"] = memory_mib()
    record["apply"] = {which: {"allowed_tokens": counts[step], **{
        batch: measure_apply(adapter, json_masks[step], batch, vocab_size) for batch in BATCH_SIZES}}
        for which, step in steps.items()}
    # what each stage added: {"rss": MiB, "heap": MiB or None}
    record["memory_mib"] = {stage: {key: None if memory[stage][key] is None else memory[stage][key] - memory[prev][key]
                                    for key in ("rss", "heap")}
                            for prev, stage in (("baseline", "import"), ("import", "tokenizer_info"),
                                                ("tokenizer_info", "compile_4_constraints"),
                                                ("before_apply_import", "apply_import"))}
    record["torch_threads"] = torch.get_num_threads()
    return record


def machine() -> dict:
    flags, model = set(), platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            if key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"cpu_model": model, "avx512f": "avx512f" in flags, "avx2": "avx2" in flags,
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def kib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}" if abs(value) < 1 else f"{value:.1f}"


def mib(stage: dict) -> str:
    return f"{stage['rss']:.1f} ({kib(stage['heap'])})"


def markdown(record: dict) -> str:
    libs = record["libraries"]
    out = [f"CPU {record['machine']['cpu_model']} (avx512f {record['machine']['avx512f']}, avx2 "
           f"{record['machine']['avx2']}), {record['threads']} threads; "
           + ", ".join(f"{name} {lib['version']}" for name, lib in libs.items()), "",
           "| | " + " | ".join(libs) + " |", "|---|" + "---:|" * len(libs)]
    rows = [("import (s)", lambda l: f"{l['import_s']:.2f}"),
            ("tokenizer info, once per vocabulary (s)", lambda l: f"{l['tokenizer_info_s']:.2f}"),
            ("import what the torch apply needs (s)", lambda l: f"{l['apply_import_s']:.2f}"),
            ("memory: import, RSS (heap) MiB", lambda l: mib(l["memory_mib"]["import"])),
            ("memory: tokenizer info, RSS (heap) MiB", lambda l: mib(l["memory_mib"]["tokenizer_info"])),
            ("memory: compile the 4 constraints, RSS (heap) MiB",
             lambda l: mib(l["memory_mib"]["compile_4_constraints"])),
            ("memory: import what the torch apply needs, RSS (heap) MiB",
             lambda l: mib(l["memory_mib"]["apply_import"])),
            ("heap per JSON matcher, fresh (KiB)", lambda l: kib(l["json_matcher_heap_kib"]["fresh"])),
            ("heap per JSON matcher, after a ~1,000-token output (KiB)",
             lambda l: kib(l["json_matcher_heap_kib"]["walked"])),
            ("heap a JSON matcher adds per output token (KiB)", lambda l: kib(l["json_matcher_heap_kib"]["per_token"])),
            ("special tokens (not EOS) allowed inside a JSON string",
             lambda l: l["special_tokens_allowed_in_json_string"])]
    out += [f"| {label} | " + " | ".join(cell(lib) for lib in libs.values()) + " |" for label, cell in rows]
    out += ["", "| constraint | library | compile cold (ms) | compile again (ms) | compiled (KiB) | matcher (us) "
            "| walk tokens |", "|---|---|---:|---:|---:|---:|---:|"]
    for kind in CONSTRAINTS:
        for name, lib in libs.items():
            c = lib["constraints"][kind]
            size = "-" if c["compiled_bytes"] is None else f"{c['compiled_bytes'] / 1024:.1f}"
            out.append(f"| {kind} | {name} | {c['compile_cold_ms']:.1f} | {c['compile_second_ms']:.2f} | {size} | "
                       f"{c['matcher_create_us']:.1f} | {c['walk_tokens']} |")
    names, counts = list(libs), [lib["json_allowed_per_step"] for lib in libs.values()]
    more = {name: sum(1 for step in zip(*counts) if step[i] > min(step)) for i, name in enumerate(names)}
    out += ["", f"JSON walk: the libraries allow the same number of tokens at "
            f"{sum(1 for step in zip(*counts) if len(set(step)) == 1)} of {len(counts[0])} steps; "
            + ", ".join(f"{name} allows more at {n}" for name, n in more.items())]
    out += ["", "Per-step bitmask fill over the walk (ms; batch API = xgrammar BatchGrammarMatcher / llguidance "
            "LLExecutor, loop = one call per row); accept = every row accepts the step's token (ms)", "",
            "| constraint | B | library | fill mean (batch API) | fill p95 | fill max | fill mean (loop) | accept |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    for kind in CONSTRAINTS:
        for batch in BATCH_SIZES:
            for name, lib in libs.items():
                b = lib["constraints"][kind]["batches"][str(batch)]
                out.append(f"| {kind} | {batch} | {name} | {b['batch_api']['fill_mean_ms']:.3f} | "
                           f"{b['batch_api']['fill_p95_ms']:.3f} | {b['batch_api']['fill_max_ms']:.3f} | "
                           f"{b['loop']['fill_mean_ms']:.3f} | {b['batch_api']['accept_mean_ms']:.3f} |")
    first = next(iter(libs.values()))
    for which, label in (("fewest_allowed", "fewest"), ("most_allowed", "most")):
        out += ["", f"Applying the JSON walk's mask with the {label} allowed tokens "
                "(" + " / ".join(f"{name} {lib['apply'][which]['allowed_tokens']:,}" for name, lib in libs.items())
                + f" of {first['vocab_size']:,}) to fp32 logits [B, vocab] "
                f"(ms, median of {APPLY_REPS}; the very first call in brackets)", "",
                "| B | " + " | ".join(f"{name} apply" for name in libs) + " | torch unpack + masked_fill |",
                "|---:|" + "---:|" * (len(libs) + 1)]
        for batch in BATCH_SIZES:
            cells = [f"{lib['apply'][which][str(batch)]['library']['median_ms']:.3f} "
                     f"({lib['apply'][which][str(batch)]['library']['first_ms']:.1f})" for lib in libs.values()]
            unpack = first["apply"][which][str(batch)]["torch_unpack"]["median_ms"]
            out.append(f"| {batch} | " + " | ".join(cells) + f" | {unpack:.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON record here too")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="threads for the libraries' batch APIs and compilers, and for torch (default: all CPUs)")
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args()

    if args.library:
        print(json.dumps(run_library(args.library, args.threads)))
        return
    record = {"command": " ".join(["python", "scripts/grammar_library_bench.py", *sys.argv[1:]]),
              "machine": machine(), "threads": args.threads, "libraries": {}}
    for library in LIBRARIES:
        child = subprocess.run([sys.executable, __file__, "--library", library, "--threads", str(args.threads)],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"{library}: the measurement failed:\n{child.stderr[-3000:]}")
        record["libraries"][library] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(record, indent=1))
    print()
    print(markdown(record))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
