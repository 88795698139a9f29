"""Drops torch and the CUDA libraries that only torch's CUDA build needs from a `uv pip compile` output."""

import re
import sys

LEFT_TO_TORCH = re.compile(r"^(torch|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==")

HEADER = """\
# The exact versions scripts/setup.sh and CI install, each with its files' hashes (pip install --require-hashes).
# Written by dev/lock.sh; torch is pinned apart in scripts/setup.sh. Do not edit by hand.
"""


def main(path: str) -> None:
    blocks, block = [], []
    for line in open(path):
        if line[:1].isalnum() and block:
            blocks.append(block)
            block = []
        block.append(line)
    if block:
        blocks.append(block)
    kept = [b for b in blocks if not LEFT_TO_TORCH.match(b[0])]
    sys.stdout.write(HEADER + "".join(line for b in kept for line in b))


if __name__ == "__main__":
    main(sys.argv[1])
