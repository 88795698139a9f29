"""The process's peak resident memory."""
from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident memory. Linux's VmHWM belongs to the process's own address
    space; getrusage's ru_maxrss survives fork and exec, so a run started from a large parent (a test runner, a
    notebook) would report the parent's peak. ru_maxrss is the fallback where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
