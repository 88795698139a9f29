"""The processes of one Ray cluster on this machine, found by their command lines, so that a test kills a replica
(or stops a cluster) of its own and never another test's."""
from __future__ import annotations

from typing import Callable

import psutil


def processes_under(is_head: Callable[[str], bool]) -> list[psutil.Process]:
    """The processes whose command line `is_head` accepts (a cluster's gcs_server, raylet, ...: their command lines
    name its session or temp directory) and all their descendants (the workers, the replicas)."""
    heads = [p for p in psutil.process_iter(["cmdline"]) if is_head(" ".join(p.info["cmdline"] or []))]
    found = {p.pid: p for p in heads}
    for head in heads:
        try:
            found.update({child.pid: child for child in head.children(recursive=True)})
        except psutil.Error:
            pass
    return list(found.values())
