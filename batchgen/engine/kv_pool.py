"""How many KV blocks the pool gets, and why: the budget (kv_cache_memory, or on CUDA gpu_memory_utilization), but no
more than max_num_seqs sequences of the whole context can ever hold at once. The job layer lowers max_num_seqs to
its rows, so a small job gets a small pool. (`batchgen plan` runs the same arithmetic.)

A model with sliding-window layers beside global ones has a second pool for the local layers (sliding_window.py),
and the budget is split between the two: the local pool gets as many blocks as the global one plus its null
block (its sequences never hold more blocks in it than in the global pool: only those still in their window), but
no more than local_blocks_at_most (what max_num_seqs sequences' windows and a step's tokens can use, and a step's
tokens again for the prefix cache); the global pool gets the rest. So no workload holds fewer sequences than with
one pool (sequences shorter than the window hold as many blocks in each), and where the budget exceeds the local
pool's cap, the global pool, which sets the context the cache holds, gets all the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .engine_args import EngineArgs, parse_bytes
from .errors import SettingError
from .sliding_window import LocalLayers, hit_blocks, local_blocks_at_most


@dataclass(frozen=True)
class LocalPoolSize:
    """The local group's pool: `num_blocks` blocks (block 0 its null block) of its layers' K/V."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    window: int

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class KVPoolSize:
    num_blocks: int  # of the global pool (the only one without a local group): it sets the context the cache holds
    block_size: int
    bytes_per_token: int  # K and V of the global pool's layers
    reason: str  # which limit set num_blocks, with its arithmetic (and the local pool's)
    local: LocalPoolSize | None = None

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def bytes(self) -> int:
        """Both pools."""
        return self.num_blocks * self.block_bytes + (0 if self.local is None else self.local.bytes)


def blocks_for_budget(budget: int, bytes_per_token: int, block_size: int, source: str) -> int:
    """How many KV blocks `budget` bytes hold; SettingError below 2 (`source` says where the budget came from)."""
    num_blocks = budget // (bytes_per_token * block_size)
    if num_blocks < 2:
        raise _too_small(source, block_size, bytes_per_token)
    return num_blocks


def _too_small(source: str, block_size: int, bytes_per_token: int) -> SettingError:
    return SettingError("kv_cache_memory", f"kv_cache_memory {source} holds fewer than 2 blocks of {block_size} "
                                           f"tokens ({bytes_per_token} bytes per token)")


def blocks_in_use_at_most(max_num_seqs: int, context: int, block_size: int) -> int:
    """The most blocks the engine can ever hold at once: max_num_seqs sequences of `context` tokens, plus a block
    each of slack."""
    return max_num_seqs * (-(-context // block_size) + 1)


def size_kv_pool(budget: int, budget_source: str, bytes_per_token: int, block_size: int, max_num_seqs: int,
                 context: int, local: LocalLayers | None = None, max_num_batched_tokens: int = 0) -> KVPoolSize:
    """The pool for a budget of `budget` bytes (described by `budget_source`), capped at what max_num_seqs
    sequences of `context` tokens can use; with `local` layers, the two pools the budget is split into."""
    if local is not None:
        return _split_pools(budget, budget_source, bytes_per_token, block_size, max_num_seqs, context, local,
                            max_num_batched_tokens)
    budget_blocks = blocks_for_budget(budget, bytes_per_token, block_size, budget_source)
    usable = blocks_in_use_at_most(max_num_seqs, context, block_size)
    if usable < budget_blocks:
        return KVPoolSize(usable, block_size, bytes_per_token, _capped(max_num_seqs, context, budget_source))
    return KVPoolSize(budget_blocks, block_size, bytes_per_token, f"kv_cache_memory {budget_source}")


def _capped(max_num_seqs: int, context: int, budget_source: str) -> str:
    return f"max_num_seqs {max_num_seqs} x ({context:,}-token context + 1 block), under kv_cache_memory {budget_source}"


def _split_pools(budget: int, budget_source: str, bytes_per_token: int, block_size: int, max_num_seqs: int,
                 context: int, local: LocalLayers, max_num_batched_tokens: int) -> KVPoolSize:
    """The global pool of g blocks and the local one of min(g + 1, cap) blocks (the module's rule), g the most
    that the budget holds (at most what max_num_seqs sequences of the context can use)."""
    global_bytes, local_bytes = bytes_per_token * block_size, local.bytes_per_token * block_size
    cap = local_blocks_at_most(local.window, block_size, max_num_seqs, max_num_batched_tokens)
    if (cap - 1) * global_bytes + cap * local_bytes <= budget:  # the local pool reaches its cap
        num_blocks = (budget - cap * local_bytes) // global_bytes
    else:
        num_blocks = (budget - local_bytes) // (global_bytes + local_bytes)
    if num_blocks < 2:
        raise _too_small(budget_source, block_size, bytes_per_token + local.bytes_per_token)
    usable = blocks_in_use_at_most(max_num_seqs, context, block_size)
    reason = f"kv_cache_memory {budget_source}"
    if usable < num_blocks:
        num_blocks, reason = usable, _capped(max_num_seqs, context, budget_source)
    local_blocks = min(num_blocks + 1, cap)
    per_seq = hit_blocks(local.window, block_size) + 2
    why = "as many as the global pool, and its null block" if num_blocks + 1 < cap else (
        f"max_num_seqs {max_num_seqs} x {per_seq} + 2 {max_num_batched_tokens:,}-token steps, and its null block")
    reason += (f"; sliding-window layers (window {local.window:,}) in a pool of their own: {local_blocks:,} "
               f"blocks ({why})")
    return KVPoolSize(num_blocks, block_size, bytes_per_token, reason,
                      LocalPoolSize(local_blocks, block_size, local.bytes_per_token, local.window))


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
