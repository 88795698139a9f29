"""Measuring a CUDA device for the KV cache: run the largest step the scheduler can schedule once and measure the
memory it takes beyond the weights (kv_pool.kv_cache_budget turns that into the cache's size)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata

logger = logging.getLogger("batchgen")


@torch.inference_mode()
def run_dummy_step(model: torch.nn.Module, num_tokens: int, max_num_seqs: int, block_size: int,
                   attention_backend: str = "auto") -> torch.Tensor:
    """A step of `num_tokens` prompt tokens split over up to max_num_seqs sequences, each sampling (greedily) one
    token, on a throwaway one-block KV cache that every token writes and every sequence reads: the activations and
    logits of the largest step, whatever the values. Returns the sampled ids. Leaves the model bound to that cache:
    bind the real one afterwards."""
    device = model.device
    num_seqs = min(max_num_seqs, num_tokens)
    base, extra = divmod(num_tokens, num_seqs)
    query_lens = [base] * (num_seqs - extra) + [base + 1] * extra  # ascending: any one-token "decodes" first
    cache = torch.zeros((model.num_layers, 2, 1, block_size, model.num_kv_heads, model.head_dim),
                        dtype=model.dtype, device=device)
    model.bind_kv_cache([cache[i, 0] for i in range(model.num_layers)], [cache[i, 1] for i in range(model.num_layers)],
                        attention_backend)
    positions = torch.cat([torch.arange(n) for n in query_lens]) % model.max_model_len  # values do not matter
    block_tables = np.zeros((num_seqs, -(-(base + 1) // block_size)), dtype=np.int32)
    slot_mapping = np.arange(num_tokens) % block_size
    metadata = AttentionMetadata.build(query_lens, query_lens, block_tables, slot_mapping, device)
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions.to(device), metadata)
    logits = model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
    return logits.argmax(dim=-1)


def profile_step(model: torch.nn.Module, max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                 attention_backend: str = "auto") -> tuple[int, int]:
    """(the device's free bytes with the weights loaded, the peak a dummy step of max_num_batched_tokens tokens
    allocates beyond them): what kv_pool.kv_cache_budget sizes the cache from on CUDA. What
    1 - gpu_memory_utilization leaves covers what the profile does not see: CUDA graphs, the sampler's temporaries
    for random rows."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_dummy_step(model, max_num_batched_tokens, max_num_seqs, block_size, attention_backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    logger.info("CUDA memory: %.2f of %.2f GiB free with the weights loaded; a %d-token step peaks at %.2f GiB",
                free / 2**30, total / 2**30, max_num_batched_tokens, peak / 2**30)
    return free, peak
