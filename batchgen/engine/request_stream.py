"""How Engine.generate and EncoderEngine.generate drive an engine over a lazy stream of requests: pull a request only
while fewer than max_num_seqs wait (so that a million-row job holds a bounded number in memory), step, yield each
step's Results in completion order. Only the engines' public API is used."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .request import Request, Result


def stream_results(engine: Any, requests: Iterable[Request], queued: Callable[[], int], max_num_seqs: int,
                   on_step: Callable[[], None] | None = None) -> Iterator[Result]:
    """queued(): how many requests the engine holds that have not started (new ones are pulled while it is below
    max_num_seqs). on_step(): called after each step."""
    source = iter(requests)
    exhausted = False
    while True:
        while not exhausted and queued() < max_num_seqs:
            request = next(source, None)
            if request is None:
                exhausted = True
                break
            engine.add_request(request)
        if not engine.has_unfinished():
            if exhausted:
                return
            continue
        results = engine.step()
        if on_step is not None:
            on_step()
        yield from results
