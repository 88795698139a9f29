"""The versions of what shapes a job's results: `batchgen --version` prints them and `_SUCCESS` records them, so a
pipeline can tell which libraries a job ran with (scripts/setup.sh installs those in requirements-lock.txt)."""
from __future__ import annotations

import platform
from importlib import metadata

import batchgen

# Read from the installed distributions' metadata: nothing is imported, so `--version` answers at once.
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "pyarrow", "xgrammar", "triton", "obstore")


def library_versions() -> dict[str, str | None]:
    """batchgen's, Python's and each of LIBRARIES' version; None for a library not installed."""
    found: dict[str, str | None] = {"batchgen": batchgen.__version__, "python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def version_text() -> str:
    """`batchgen --version`: batchgen's version on the first line, then one line a library."""
    versions = library_versions()
    lines = [f"batchgen {versions.pop('batchgen')}"]
    lines += [f"  {name} {version or 'not installed'}" for name, version in versions.items()]
    return "\n".join(lines)


def print_version(ctx, _param, value: bool) -> None:
    """The click callback of `batchgen --version`."""
    import click

    if value and not ctx.resilient_parsing:
        click.echo(version_text())
        ctx.exit()
