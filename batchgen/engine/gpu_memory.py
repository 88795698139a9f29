"""Sizing the KV cache on a CUDA device: run the largest step the scheduler can schedule once, measure the memory it
takes beyond the weights, and give the KV cache gpu_memory_utilization of what is free minus that peak."""
from __future__ import annotations

import logging

import torch

from batchgen_kernels import AttentionMetadata

logger = logging.getLogger("batchgen")


@torch.inference_mode()
def run_dummy_step(model: torch.nn.Module, num_tokens: int, max_num_seqs: int, block_size: int) -> torch.Tensor:
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
    model.bind_kv_cache([cache[i, 0] for i in range(model.num_layers)], [cache[i, 1] for i in range(model.num_layers)])
    lens = torch.tensor(query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in query_lens]) % model.max_model_len  # values do not matter
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device), seq_lens=lens.to(device),
        block_tables=torch.zeros((num_seqs, -(-(base + 1) // block_size)), dtype=torch.int32, device=device),
        slot_mapping=(torch.arange(num_tokens) % block_size).to(device), max_query_len=max(query_lens),
        max_seq_len=max(query_lens), num_decodes=sum(1 for n in query_lens if n == 1),
        query_lens_cpu=query_lens, seq_lens_cpu=query_lens)
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions.to(device), metadata)
    logits = model.compute_logits(hidden[(query_start_loc[1:] - 1).to(device, torch.long)])
    return logits.argmax(dim=-1)


def kv_cache_budget(model: torch.nn.Module, max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                    gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: gpu_memory_utilization x the device's free memory (the weights already loaded),
    less the peak a dummy step of max_num_batched_tokens tokens allocates. What 1 - gpu_memory_utilization leaves
    covers what the profile does not see: CUDA graphs, the sampler's temporaries for random rows."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_dummy_step(model, max_num_batched_tokens, max_num_seqs, block_size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(free * gpu_memory_utilization) - peak
    logger.info("KV cache budget %.2f GiB: %.2f of %.2f GiB free x gpu_memory_utilization %.2f, less a %.2f GiB "
                "activation peak (a %d-token step)", budget / 2**30, free / 2**30, total / 2**30,
                gpu_memory_utilization, peak / 2**30, max_num_batched_tokens)
    return budget
