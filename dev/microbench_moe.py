"""How to hold and multiply a MoE layer's experts on the CPU: one MLP layer's time at a few token counts, for
  dense      one PackedLinear gate/up and down of intermediate k x I (the dense model of the same active size),
  packed     batchgen's way (models/moe.py run_experts): each expert's gate/up and down a PackedLinear (oneDNN-
             packed), one call per active expert on its rows,
  stacked    the experts as one [E, 2I, H] and one [E, H, I] tensor, F.linear on each active expert's slice,
  grouped    the same stacked tensors through torch.nn.functional.grouped_mm over the rows sorted by expert.
Every MoE way includes its routing bookkeeping (sort by expert, gather, weighted sum over the k slots). Tokens are
routed uniformly at random (top-k of E), as random router weights route them. The cases run in turn, repetition by
repetition, so that load from other processes falls on all of them alike.

    PYTHONPATH=$PWD:$PWD/kernels python dev/microbench_moe.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.moe import Expert, run_experts
from batchgen.models.packed_linear import PackedLinear
from batchgen_kernels.elementwise import TorchElementwise


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def stacked(x, weights, expert_ids, gate_up, down) -> torch.Tensor:
    """The stacked tensors, sliced per active expert; the same bookkeeping as run_experts."""
    num_tokens, top_k = expert_ids.shape
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=gate_up.shape[0]).tolist()
    by_slot, start = torch.empty(num_tokens * top_k, x.shape[-1], dtype=x.dtype), 0
    for e, count in enumerate(counts):
        if count:
            slot = order[start:start + count]
            start += count
            out = F.linear(silu_mul(F.linear(x[slot // top_k], gate_up[e])), down[e])
            by_slot[slot] = out * weights.reshape(-1, 1)[slot]
    return by_slot.view(num_tokens, top_k, -1).sum(dim=1)


def grouped(x, weights, expert_ids, gate_up, down) -> torch.Tensor:
    num_tokens, top_k = expert_ids.shape
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    offsets = torch.bincount(expert_ids.reshape(-1), minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    rows = x[order // top_k]
    out = F.grouped_mm(silu_mul(F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets)),
                       down.transpose(-2, -1), offs=offsets)
    by_slot = torch.empty_like(out)
    by_slot[order] = out * weights.reshape(-1, 1)[order]
    return by_slot.view(num_tokens, top_k, -1).sum(dim=1)


def interleaved_medians(cases: dict, reps: int) -> dict:
    """Each case's median time: every repetition runs each case once in turn, so that a burst of load from
    another process on the machine falls on all of them, not on one."""
    times = {name: [] for name in cases}
    for rep in range(reps + 1):  # the first round warms up (oneDNN creates its kernels)
        for name, fn in cases.items():
            started = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-intermediate", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", default="1,2,8,16,32,64,128,512")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    h, i, e, k = args.hidden, args.expert_intermediate, args.experts, args.top_k
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: (0.02 * torch.randn(*shape, generator=generator)).to(dtype)  # noqa: E731
    gate_up, down = randn(e, 2 * i, h), randn(e, h, i)
    experts = nn.ModuleList(Expert(h, i) for _ in range(e))
    for j, expert in enumerate(experts):
        expert.gate_up_proj, expert.down_proj = PackedLinear(gate_up[j], None), PackedLinear(down[j], None)
    dense = (PackedLinear(randn(2 * k * i, h), None), PackedLinear(randn(h, k * i), None))
    ways = {
        "dense": lambda x, w, ids: dense[1](silu_mul(dense[0](x))),
        "packed": lambda x, w, ids: run_experts(experts, x, w, ids, TorchElementwise),
        "stacked": lambda x, w, ids: stacked(x, w, ids, gate_up, down),
        "grouped": lambda x, w, ids: grouped(x, w, ids, gate_up, down),
    }
    counts = [int(t) for t in args.tokens.split(",")]
    inputs = {}
    for count in counts:
        weights, ids = torch.rand(count, e, generator=generator).topk(k, dim=-1)
        inputs[count] = (randn(count, h), (weights / weights.sum(-1, keepdim=True)).to(dtype), ids)
    cases = {(count, name): (lambda fn=fn, args=inputs[count]: fn(*args)) for count in counts
             for name, fn in ways.items()}
    with torch.inference_mode():
        medians = interleaved_medians(cases, args.reps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, hidden {h}, {e} experts of "
          f"{i}, top-{k}; dense intermediate {k * i}; median ms of {args.reps}")
    print("tokens " + " ".join(f"{name:>9}" for name in ways))
    for count in counts:
        print(f"{count:>6} " + " ".join(f"{medians[(count, name)] * 1e3:>9.2f}" for name in ways))


if __name__ == "__main__":
    main()
