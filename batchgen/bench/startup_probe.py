"""batchgen's start-up as a user meets it: a fresh Python process, timed from the moment it is spawned to an Engine
ready for its first request, then the first request itself (one token), in that process; the bench's own process
has long imported everything, so its in-process load time leaves out the imports.

Ready includes: the interpreter's start, `import batchgen.engine` (torch, transformers), the tokenizer, reading the
weights, the int8 quantization or oneDNN packing of each Linear, the KV cache's sizing and allocation (on the CPU
allocated unwritten: its pages are touched as blocks are first used, inside generation), and loading the C++ kernel
library from its cache (a first build of that library, or a first GGUF conversion, would be in it too: `one_time`
lists what the process logged of such work, so a figure that includes it is known as such). The first request
adds what runs only on first use (e.g. oneDNN's kernel selection for the step's shapes).

    python -m batchgen.bench.startup_probe SPEC.json   # prints one JSON line: the process's own timestamps
"""
from __future__ import annotations

import time

_STARTED = time.monotonic()  # as early as this module runs: after the interpreter and the `batchgen` package

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


def measure(engine_args: Any) -> dict[str, float | bool]:
    """Spawn the probe for these EngineArgs; its phases in seconds since the spawn (CLOCK_MONOTONIC is shared by
    the processes of one machine). Raises RuntimeError with the probe's last line if it fails."""
    import dataclasses

    spec = json.dumps(dataclasses.asdict(engine_args))
    spawned = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchgen.bench.startup_probe", spec], capture_output=True,
                          text=True, env=os.environ.copy())
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"start-up probe exited with {done.returncode}: {tail}")
    stamps = json.loads(lines[-1])
    return {"process_to_module_s": stamps["module"] - spawned, "imports_s": stamps["imported"] - stamps["module"],
            "engine_s": stamps["ready"] - stamps["imported"], "startup_s": stamps["ready"] - spawned,
            "first_request_s": stamps["first_token"] - stamps["ready"], "one_time": stamps["one_time"]}


# What a start-up logs when it does work a later start-up finds done (cpu_build.py, gguf_cache.py).
ONE_TIME_WORK = ("CPU kernels: built", "converting")


class OneTimeWork(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(marker in message for marker in ONE_TIME_WORK):
            self.seen.append(message[:200])


def main(spec: str) -> None:
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

    imported = time.monotonic()
    one_time = OneTimeWork()
    for name in ("batchgen", "batchgen_kernels"):
        logging.getLogger(name).addHandler(one_time)
        logging.getLogger(name).setLevel(logging.INFO)
    engine = Engine(EngineArgs(**json.loads(spec)))
    ready = time.monotonic()
    list(engine.generate([Request(0, [engine.eos_token_ids[0]] * 4, SamplingParams(max_tokens=1, temperature=0.0))]))
    print(json.dumps({"module": _STARTED, "imported": imported, "ready": ready, "first_token": time.monotonic(),
                      "one_time": one_time.seen}))


if __name__ == "__main__":
    main(sys.argv[1])
