"""How many KV blocks the pool gets, and why: the budget (kv_cache_memory, or on CUDA gpu_memory_utilization), but no
more than max_num_seqs sequences of the whole context can ever hold at once. The job layer lowers max_num_seqs to
its rows, so a small job gets a small pool. (`batchgen plan` runs the same arithmetic.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .engine_args import EngineArgs, parse_bytes
from .errors import SettingError


@dataclass(frozen=True)
class KVPoolSize:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    reason: str  # which limit set num_blocks, with its arithmetic

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def blocks_for_budget(budget: int, bytes_per_token: int, block_size: int, source: str) -> int:
    """How many KV blocks `budget` bytes hold; SettingError below 2 (`source` says where the budget came from)."""
    num_blocks = budget // (bytes_per_token * block_size)
    if num_blocks < 2:
        raise SettingError("kv_cache_memory", f"kv_cache_memory {source} holds fewer than 2 blocks of "
                                              f"{block_size} tokens ({bytes_per_token} bytes per token)")
    return num_blocks


def blocks_in_use_at_most(max_num_seqs: int, context: int, block_size: int) -> int:
    """The most blocks the engine can ever hold at once: max_num_seqs sequences of `context` tokens, plus a block
    each of slack."""
    return max_num_seqs * (-(-context // block_size) + 1)


def size_kv_pool(budget: int, budget_source: str, bytes_per_token: int, block_size: int, max_num_seqs: int,
                 context: int) -> KVPoolSize:
    """The pool for a budget of `budget` bytes (described by `budget_source`), capped at what max_num_seqs
    sequences of `context` tokens can use."""
    budget_blocks = blocks_for_budget(budget, bytes_per_token, block_size, budget_source)
    usable = blocks_in_use_at_most(max_num_seqs, context, block_size)
    if usable < budget_blocks:
        return KVPoolSize(usable, block_size, bytes_per_token,
                          f"max_num_seqs {max_num_seqs} x ({context:,}-token context + 1 block), under "
                          f"kv_cache_memory {budget_source}")
    return KVPoolSize(budget_blocks, block_size, bytes_per_token, f"kv_cache_memory {budget_source}")


def kv_cache_budget(args: EngineArgs, device_type: str,
                    measure: Callable[[], tuple[int, int]] | None = None) -> tuple[int, str] | None:
    """The KV cache's budget in bytes and where it comes from, by the one rule that the engine's start-up, `batchgen
    plan` and the job's pre-check share: kv_cache_memory (on the CPU, its default when unset); on CUDA without it,
    gpu_memory_utilization x the memory free with the weights loaded, less the largest step's peak. `measure()`
    gives those two (the engine profiles a step, plan estimates it); without it that budget is not known before the
    model loads: None."""
    if args.kv_cache_memory is None and device_type == "cuda":
        if measure is None:
            return None
        free, step_peak = measure()
        budget = int(free * args.gpu_memory_utilization) - step_peak
        return budget, (f"from gpu_memory_utilization {args.gpu_memory_utilization} ({max(budget, 0):,} bytes: "
                        f"{free / 2**30:.2f} GiB free less a {step_peak / 2**30:.2f} GiB step)")
    return parse_bytes(args.cpu_kv_cache_memory()), repr(args.cpu_kv_cache_memory())
