"""What the CPU's instructions decide: which dtype `dtype: auto` means on this machine (bf16 where the CPU computes
it natively, fp32 elsewhere), and whether W8A8 has a fast kernel."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.machine import cpu_flags

# CPU flags (as /proc/cpuinfo spells them) that make bf16 matmuls native: AVX512_BF16's dot products, AMX's tiles.
# Without them oneDNN emulates bf16 through fp32 and a bf16 model runs slower than an fp32 one.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Flags of an int8 x int8 dot product in one instruction; without them torch._int_mm (W8A8) has no fast kernel.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for people: "bfloat16: CPU has avx512_bf16"

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def auto_cpu_dtype(flags: set[str] | None = None) -> DtypeChoice:
    """bf16 when the CPU has one of BF16_FLAGS, fp32 otherwise, and fp32 when the flags cannot be read (macOS,
    ARM, a container without /proc): a wrong bf16 guess would make an emulating CPU several times slower, a wrong
    fp32 guess only forgoes a speed-up. `flags` defaults to this machine's."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return DtypeChoice(torch.float32, "float32: CPU flags unknown (no /proc/cpuinfo flags line)")
    native = [flag for flag in BF16_FLAGS if flag in flags]
    if native:
        return DtypeChoice(torch.bfloat16, f"bfloat16: CPU has {'/'.join(native)}")
    return DtypeChoice(torch.float32, f"float32: CPU lacks {'/'.join(BF16_FLAGS)}")


def w8a8_slow_reason(flags: set[str] | None = None) -> str | None:
    """Why W8A8 (`quantization: int8`) is slow on this CPU, or None where it has int8 dot products (or the flags
    cannot be read). Measured on an AVX2-only EPYC: torch._int_mm at ~5.6 GFLOP/s, a run at 0.18x vLLM's
    (docs/performance.md, "W8A8, side by side")."""
    flags = cpu_flags() if flags is None else flags
    if not flags or any(flag in flags for flag in INT8_DOT_FLAGS):
        return None
    return (f"this CPU lacks {'/'.join(INT8_DOT_FLAGS)}, so W8A8 (quantization: int8) multiplies int8 in slow code "
            f"(measured 0.18x vLLM on an AVX2-only CPU); int8-weight-only with bfloat16, or no quantization, is "
            f"faster here")
