"""peak_memory_bytes in _SUCCESS must be the run's own peak, not that of the process that started it."""
import subprocess
import sys

CHILD = "from batchgen.engine.process_memory import peak_rss_bytes; print(peak_rss_bytes())"


def test_peak_rss_is_not_inherited_from_a_large_parent():
    ballast = bytearray(1 << 30)  # a parent 1 GiB larger than its child ever gets (getrusage would report it)
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    child = int(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout)
    assert 0 < child < 512 * 2**20, child / 2**20
