"""batchgen's own split of a generation run into prefill and decode, from its engine's public step statistics: the
time between one step's end and the next's is the next step's, and a step is prefill when it computed any prompt
token (`Engine.last_step.num_prefill_tokens`; a step that also decoded some rows counts as prefill), decode
otherwise. Passed to `Engine.generate(on_step=...)`; the sum of both is the run's wall time less what happens
after the last step."""
from __future__ import annotations

import time
from typing import Any


class StepPhases:
    def __init__(self, engine: Any):
        self.engine = engine
        self.last = time.perf_counter()
        self.figures = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0,
                        "prefill_tokens": 0, "decode_tokens": 0}

    def __call__(self) -> None:
        now, step = time.perf_counter(), self.engine.last_step
        phase = "prefill" if step.num_prefill_tokens else "decode"
        self.figures[f"{phase}_s"] += now - self.last
        self.figures[f"{phase}_steps"] += 1
        self.figures["prefill_tokens"] += step.num_prefill_tokens
        self.figures["decode_tokens"] += step.num_decodes
        self.last = now
