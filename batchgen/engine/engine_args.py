"""Engine settings, validated before anything heavy is loaded."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import SettingError
from .request import TASKS
from .speculative.config import SpeculativeConfig

MODEL_IMPLS = ("auto", "native", "transformers")  # models/registry.py's model_path reads them
QUANTIZATIONS = ("int8", "int8-weight-only")  # models/quantization.py implements them (QUANTIZED_ACTIVATIONS)
CALIBRATION_KEYS = ("rows", "threshold", "activations", "alpha")  # quantization_calibration's (job/calibration.py,
# engine/calibration.py). activations: how W8A8 quantizes each layer's input (models/int8_activations.py): one scale
# per token (dynamic), one per layer from the calibration's ranges (static), or SmoothQuant's per-channel smoothing
# with alpha, then one scale per token (smooth)
CALIBRATION_ACTIVATIONS = ("dynamic", "static", "smooth")
# smooth kept 39/40 of the labeling job's `choice` labels against dynamic's 37 and static's 33, as fast as dynamic
# (docs/performance.md, "Issue 43: static and smoothed activation scales")
DEFAULT_CALIBRATION_ACTIVATIONS = "smooth"
# Without quantization_calibration.alpha, smooth takes the alpha of this grid whose W8A8 model (every calibrated layer
# smoothed at it) moves the calibration rows' next-token distributions least (engine/calibration.py, choose_alpha).
# SmoothQuant's best alpha is the model's; on the 135M labeling job the search took 0.5 (docs/performance.md)
SMOOTH_ALPHAS = (0.35, 0.5, 0.65, 0.8)
# The settings that trade quality for speed, each with its "off" value: `batchgen plan --quality N` compares the job's
# settings with these off (job/plan/quality.py). Only those EngineArgs has are reset.
QUALITY_LEVERS = {"quantization": None, "quantization_calibration": None, "quantization_keep": None,
                  "quantization_scales": None, "kv_cache_dtype": "auto", "speculative": None}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', or a plain number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size such as '2GiB' or '512MiB', got {value!r}")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


# The KV cache budget when kv_cache_memory is None on the CPU (on CUDA it comes from gpu_memory_utilization).
DEFAULT_CPU_KV_CACHE_MEMORY = "2GiB"


@dataclass
class EngineArgs:
    model: str = "default"
    task: str = "generate"  # generate | embed | classify | score (request.TASKS): what every request returns;
    # the last three run prefill only (PoolingParams), an encoder model (BERT family) on encoder_engine.py
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 (K and V as int8 with an fp32 scale per token and
    # kv head: half a bf16 cache's bytes per token; read in place by the CPU kernels; engine_plan.kv_bytes_per_token)
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # None: DEFAULT_CPU_KV_CACHE_MEMORY on CPU; on CUDA, sized from
    # gpu_memory_utilization of the free memory after a profiling step
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's context window
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs (CUDA), no fused C++ elementwise kernels (CPU): plain torch ops
    attention_backend: str = "auto"  # auto (Triton on CUDA, cpu on the CPU, torch where neither works) | torch |
    # triton | cpu (the C++ kernels: built on first use)
    seed: int = 0  # seeds the seeds drawn for requests that bring none
    quantization: str | None = None  # None | int8 | int8-weight-only: int8 weights for every decoder Linear and the
    # LM head; int8 quantizes the activations too on the CPU (W8A8), int8-weight-only keeps them (needs bf16/fp16)
    quantization_calibration: dict[str, int | float | str] | None = None  # with int8: {rows: N, threshold: t,
    # activations: smooth (default) | dynamic | static, alpha: SmoothQuant's a (default 0.5)}: N of the
    # job's rows (evenly spaced) measure each layer's sensitivity, and the job keeps in the model's dtype o_proj, the
    # LM head and every layer above t (job/calibration.py); it sets quantization_keep from the measurement
    quantization_scales: dict[str, float | tuple[float, ...]] | None = None  # with int8, set from the calibration's record
    # (activations static or smooth): layer -> its static input scale, or its smoothing factors s (one per input)
    quantization_keep: tuple[str, ...] | None = None  # with int8: the Linears left in the model's dtype: a suffix
    # (self_attn.o_proj: every layer's), a full name (model.layers.3.mlp.down_proj) or lm_head; None: none
    model_impl: str = "auto"  # auto (batchgen's own implementation where it has one, else transformers' modeling
    # code on this engine) | native | transformers
    batch_invariant: bool = False  # a row's logits the same whatever its batch, chunking, prefix-cache hit,
    # preemption or thread count (CPU only; the C++ kernels): every query row through one attention kernel
    lora: dict[str, str] | None = None  # LoRA adapters: name -> PEFT adapter directory (lora/adapter.py); a request
    # names one (Request.lora) or none (the base model)
    max_loras: int = 4  # adapters resident at once, and so in one step: beyond, read on demand (least recently used)
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculative/config.py): a proposer guesses
    # tokens that the model verifies in the step; greedy and seeded outputs are the same as without

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.of(self.speculative)  # the Python API may pass a plain dict

    def cpu_kv_cache_memory(self) -> str | int:
        """The KV budget this engine takes on the CPU (what CPU-side baselines should be given)."""
        return DEFAULT_CPU_KV_CACHE_MEMORY if self.kv_cache_memory is None else self.kv_cache_memory

    def validate(self) -> None:
        """Raise SettingError for the first invalid field."""
        if not isinstance(self.model, str) or not self.model:
            raise SettingError("model", f"model must be a non-empty string, got {self.model!r}")
        choices = {"dtype": ("auto", "float32", "bfloat16", "float16"), "device": ("auto", "cpu", "cuda"),
                   "attention_backend": ("auto", "torch", "triton", "cpu"),
                   "model_impl": MODEL_IMPLS, "task": TASKS, "kv_cache_dtype": ("auto", "int8")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise SettingError(name, f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "seed" else 1):
                kind = "a non-negative" if name == "seed" else "a positive"
                raise SettingError(name, f"{name} must be {kind} integer, got {value!r}")
        if self.block_size & (self.block_size - 1) or self.block_size > 1024:
            raise SettingError("block_size", f"block_size must be a power of two up to 1024, got {self.block_size}")
        if self.kv_cache_memory is not None:
            try:
                parse_bytes(self.kv_cache_memory)
            except ValueError as e:
                raise SettingError("kv_cache_memory", f"kv_cache_memory: {e}") from None
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise SettingError("max_model_len", f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise SettingError("gpu_memory_utilization",
                               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise SettingError("quantization", f"quantization must be null or one of {', '.join(QUANTIZATIONS)}; "
                                               f"got {self.quantization!r}")
        self._validate_calibration()
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 1:
            raise SettingError("max_loras", f"max_loras must be a positive integer, got {self.max_loras!r}")
        if self.lora is not None:
            if not isinstance(self.lora, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                          for k, v in self.lora.items()):
                raise SettingError("lora", f"lora must map adapter names to adapter directories, got {self.lora!r}")
        if self.speculative is not None:
            self.speculative.validate()
            if self.task != "generate":
                raise SettingError("speculative", f"speculative decoding applies to task generate, not {self.task}")
        for name in ("enforce_eager", "enable_prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"{name} must be true or false, got {getattr(self, name)!r}")

    def _validate_calibration(self) -> None:
        cal, keep, scales = self.quantization_calibration, self.quantization_keep, self.quantization_scales
        for name, value in (("quantization_calibration", cal), ("quantization_keep", keep),
                            ("quantization_scales", scales)):
            if value is not None and self.quantization != "int8":
                raise SettingError(name, f"{name} applies to quantization int8, not {self.quantization!r}")
        if cal is not None:
            if not isinstance(cal, dict) or set(cal) - set(CALIBRATION_KEYS) or "rows" not in cal:
                raise SettingError("quantization_calibration", f"quantization_calibration must be a mapping with rows "
                                   f"(and optionally {', '.join(CALIBRATION_KEYS[1:])}), got {cal!r}")
            if not isinstance(cal["rows"], int) or isinstance(cal["rows"], bool) or cal["rows"] < 1:
                raise SettingError("quantization_calibration",
                                   f"quantization_calibration.rows must be a positive integer, got {cal['rows']!r}")
            if not isinstance(cal.get("threshold", 0.0), (int, float)) or cal.get("threshold", 0.0) < 0:
                raise SettingError("quantization_calibration", f"quantization_calibration.threshold must be a "
                                                               f"non-negative number, got {cal['threshold']!r}")
            if cal.get("activations", DEFAULT_CALIBRATION_ACTIVATIONS) not in CALIBRATION_ACTIVATIONS:
                raise SettingError("quantization_calibration.activations", f"quantization_calibration.activations "
                                   f"must be one of {', '.join(CALIBRATION_ACTIVATIONS)}, got {cal['activations']!r}")
            alpha = cal.get("alpha", SMOOTH_ALPHAS[0])
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1:
                raise SettingError("quantization_calibration.alpha",
                                   f"quantization_calibration.alpha must be a number in (0, 1), got {alpha!r}")
        if scales is not None and not (isinstance(scales, dict) and all(
                isinstance(v, (int, float, list, tuple)) and not isinstance(v, bool) for v in scales.values())):
            raise SettingError("quantization_scales", "quantization_scales must map layer names to a static scale or "
                                                      f"a list of smoothing factors, got {type(scales).__name__}")
        if keep is not None and not all(isinstance(name, str) and name for name in keep):
            raise SettingError("quantization_keep", f"quantization_keep must be a list of layer names, got {keep!r}")
