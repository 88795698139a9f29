"""One-layer microbenchmarks behind docs/performance.md's predictions (random data, this machine's CPU):
  decode:  one gather of the whole batch vs length-sorted groups of ~N gathered tokens (metadata.group_decodes)
  prefill: SDPA's masked path vs two batched matmuls per KV head, for new tokens after a cached prefix
  mlp:     SwiGLU MLP of the default model at a 4,096- vs 2,048-token step
  cpu:     decode through the torch reference (gather, then SDPA) vs the C++ kernel that reads K/V in place, at
           batch 1-256 x contexts 128/1024, fp32 and bf16: time, ratio and GB/s of K/V read (not in the default set)
  cpu-stream: the C++ decode kernel alone at batch 32/64 x context 1,024 over four layers' caches read in turn
           (nothing left in the CPU's caches between calls), blocks consecutive and shuffled, the cache stored
           token-major (the engine's) and head-major, fp32 and bf16, on torch's threads: ms per layer and GB/s of K/V
           (compare dev/kv_read_bandwidth.py); first, batch 8 x context 256 on one layer, whose 1.6-3.1 MB stay
           in the CPU's caches: the kernel's rate when memory is not what limits it (not in the default set)
  cpu-prefill: a step's prefills through the torch reference (per sequence: gather, then SDPA or two bmm) vs the
           C++ kernel (all sequences in one call, K/V read in place), fp32 and bf16: labeling-like prompts after a
           cached prefix, whole prompts, one long prompt; time, ratio and GFLOP/s (not in the default set)
  amx-prefill: cpu-prefill's bf16 cases through the AVX512_BF16 kernel vs the AMX tile kernel, on a CPU with AMX only
           (not in the default set)
Usage: python dev/microbench_attention.py [decode|prefill|mlp|cpu|cpu-stream|cpu-prefill|amx-prefill ...]"""
from __future__ import annotations

import random
import sys
import time

import torch
import torch.nn.functional as F

import batchgen_kernels.reference as ref
from batchgen_kernels.metadata import AttentionMetadata, group_decodes

BLOCK, KV_HEADS, DIM, GROUP = 16, 3, 64, 3  # the default model's attention shape


def timed(fn, reps=10) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def decode() -> None:
    num_blocks = 20000
    k_cache, v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM), torch.randn(num_blocks, BLOCK, KV_HEADS, DIM)
    for batch, lo, hi in [(256, 80, 200), (100, 50, 650), (64, 200, 260), (32, 1000, 2000)]:
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(batch)]
        width = -(-max(lens) // BLOCK)
        table = torch.randperm(num_blocks)[: batch * width].view(batch, width).int()
        q, seq_lens = torch.randn(batch, KV_HEADS * GROUP, DIM), torch.tensor(lens).int()

        def whole():
            return ref.paged_decode(q, k_cache, v_cache, table, seq_lens, max(lens), DIM ** -0.5)

        def grouped(tokens):
            out = torch.empty_like(q)
            for group in group_decodes(lens, tokens):
                rows = torch.tensor(group)
                out[rows] = ref.paged_decode(q[rows], k_cache, v_cache, table[rows], seq_lens[rows],
                                             lens[group[-1]], DIM ** -0.5)
            return out

        assert torch.allclose(whole(), grouped(4096), atol=1e-5)
        print(f"decode batch {batch}, contexts {lo}-{hi}: whole batch {timed(whole):.2f} ms; groups of "
              + ", ".join(f"{n}: {timed(lambda: grouped(n)):.2f} ms" for n in (1024, 2048, 4096, 8192)))


def best_ms(fn, clock=time.perf_counter, seconds=1.0, rounds=5) -> float:
    """Best of `rounds` rounds of as many calls as fill about seconds / rounds (noisy shared machine: the minimum)."""
    fn()
    start = clock()
    fn()
    reps = max(1, int(seconds / rounds / max(clock() - start, 1e-6)))
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - start) / reps)
    return best * 1e3


def one_thread_then_all(reference, kernel, threads: int) -> tuple[float, float, float, float]:
    """Both on one thread by CPU time, then on `threads` threads by wall time (ms, best of 5 each)."""
    torch.set_num_threads(1)
    ref_1, kernel_1 = best_ms(reference, time.thread_time), best_ms(kernel, time.thread_time)
    torch.set_num_threads(threads)
    return ref_1, kernel_1, best_ms(reference), best_ms(kernel)


def cpu() -> None:
    """Each case twice: on one thread timed by its CPU time (time.thread_time: robust on a shared, overloaded
    machine, where wall time mostly measures the other processes), and on torch's threads by wall time."""
    from batchgen_kernels import cpu_backend

    if not cpu_backend.available():
        sys.exit("the C++ CPU kernels could not be built (see the warning above)")
    threads = torch.get_num_threads()
    print(f"decode, one layer ({KV_HEADS} kv heads x {GROUP} query heads each, head_dim {DIM}, block {BLOCK}); "
          "reference = reference.paged_attention (length-sorted gather groups), kernel = cpu_backend.paged_attention")
    print("contexts drawn from [3/4 context, context]; GB/s = bytes of K/V the batch's contexts hold / time")
    print(f"{'':>22} | {'1 thread, CPU time (best of 5)':^44} | {f'{threads} threads, wall time (best of 5)':^32}")
    print(f"{'dtype':>8} {'batch':>5} {'context':>7} | {'ref ms':>8} {'kernel ms':>9} {'speedup':>7} {'ref GB/s':>8} "
          f"{'kern GB/s':>9} | {'ref ms':>8} {'kernel ms':>9} {'speedup':>7} {'kern GB/s':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for context in (128, 1024):
            for batch in (1, 8, 32, 64, 256):
                rng = random.Random(0)
                lens = [rng.randint(context * 3 // 4, context) for _ in range(batch)]
                width = -(-context // BLOCK)
                num_blocks = batch * width + 16
                k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
                v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
                table = torch.randperm(num_blocks)[: batch * width].view(batch, width).int()
                q = torch.randn(batch, KV_HEADS * GROUP, DIM).to(dtype)
                md = AttentionMetadata.build([1] * batch, lens, table, torch.zeros(batch, dtype=torch.int64), "cpu")
                scale = DIM ** -0.5

                def reference():
                    return ref.paged_attention(q, k_cache, v_cache, md, scale)

                def kernel():
                    return cpu_backend.paged_attention(q, k_cache, v_cache, md, scale)

                torch.testing.assert_close(kernel().float(), reference().float(), atol=3e-2, rtol=3e-2)
                gigabytes = sum(lens) * KV_HEADS * DIM * 2 * k_cache.element_size() / 1e9
                ref_1, kernel_1, ref_n, kernel_n = one_thread_then_all(reference, kernel, threads)
                print(f"{str(dtype)[6:]:>8} {batch:>5} {context:>7} | {ref_1:>8.3f} {kernel_1:>9.3f} "
                      f"{ref_1 / kernel_1:>6.2f}x {gigabytes / ref_1 * 1e3:>8.1f} {gigabytes / kernel_1 * 1e3:>9.1f} | "
                      f"{ref_n:>8.3f} {kernel_n:>9.3f} {ref_n / kernel_n:>6.2f}x {gigabytes / kernel_n * 1e3:>9.1f}")


def paged_cache(num_blocks: int, dtype: torch.dtype, head_major: bool) -> torch.Tensor:
    """A random [num_blocks, BLOCK, KV_HEADS, DIM] cache, stored token-major or head-major ([N, Hkv, bs, D] in memory,
    the engine's CPU layout)."""
    if head_major:
        return torch.randn(num_blocks, KV_HEADS, BLOCK, DIM).to(dtype).transpose(1, 2)
    return torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)


def cpu_stream(layers: int = 4) -> None:
    from batchgen_kernels import cpu_backend

    if not cpu_backend.available():
        sys.exit("the C++ CPU kernels could not be built (see the warning above)")
    print(f"decode kernel over {layers} layers' caches in turn (the first row: one layer), {torch.get_num_threads()} "
          "threads, wall time, best of 5 rounds; GB/s = K/V bytes of the contexts / time")
    for dtype in (torch.float32, torch.bfloat16):
        cases = [(8, 256, False, False, 1)] + [(batch, 1024, shuffled, head_major, layers) for batch in (32, 64)
                                                for head_major in (False, True) for shuffled in (False, True)]
        for batch, context, shuffled, head_major, num_layers in cases:
            width = context // BLOCK
            num_blocks = batch * width
            caches = [(paged_cache(num_blocks, dtype, head_major), paged_cache(num_blocks, dtype, head_major))
                      for _ in range(num_layers)]
            order = torch.randperm(num_blocks) if shuffled else torch.arange(num_blocks)
            table = order.view(batch, width).int()
            q = torch.randn(batch, KV_HEADS * GROUP, DIM).to(dtype)
            md = AttentionMetadata.build([1] * batch, [context] * batch, table,
                                         torch.zeros(batch, dtype=torch.int64), "cpu")
            k, v = caches[0]
            torch.testing.assert_close(cpu_backend.paged_attention(q, k, v, md, DIM ** -0.5).float(),
                                       ref.paged_attention(q, k, v, md, DIM ** -0.5).float(), atol=3e-2, rtol=3e-2)

            def every_layer():
                for k_cache, v_cache in caches:
                    cpu_backend.paged_attention(q, k_cache, v_cache, md, DIM ** -0.5)

            per_layer = best_ms(every_layer) / num_layers
            gigabytes = batch * context * KV_HEADS * DIM * 2 * k.element_size() / 1e9
            blocks, layout = "shuffled" if shuffled else "consecutive", "head" if head_major else "token"
            print(f"{str(dtype)[6:]:>8} batch {batch:>3} context {context:>4} {blocks:>11} blocks, {layout}-major: "
                  f"{per_layer:6.3f} ms per layer, {gigabytes / per_layer * 1e3:5.1f} GB/s")


def prefill_flops(query_lens: list[int], seq_lens: list[int]) -> int:
    """QK^T and PV multiply-adds of causal attention over the visible keys: 4 x head_dim per (query head, key)."""
    visible = sum(q_len * (s_len - q_len) + q_len * (q_len + 1) // 2 for q_len, s_len in zip(query_lens, seq_lens))
    return 4 * DIM * KV_HEADS * GROUP * visible


PREFILL_CASES = {"8 x 104 new after 280 cached": ([104] * 8, [384] * 8), "4 x 400 whole prompts": ([400] * 4, [400] * 4),
                 "1 x 1,024 whole prompt": ([1024], [1024]), "1 x 256 chunk after 1,792": ([256], [2048])}


def prefill_case(dtype: torch.dtype, query_lens: list[int], seq_lens: list[int]):
    """q, random K/V caches behind a shuffled block table, the step's metadata and an output buffer."""
    widths = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(widths) + 16
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    ids = torch.randperm(num_blocks).int()
    table = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    for row, width in enumerate(widths):
        table[row, :width] = ids[sum(widths[:row]):sum(widths[:row]) + width]
    q = torch.randn(sum(query_lens), KV_HEADS * GROUP, DIM).to(dtype)
    md = AttentionMetadata.build(query_lens, seq_lens, table, torch.zeros(q.shape[0], dtype=torch.int64), "cpu")
    return q, k_cache, v_cache, md, torch.empty_like(q)


def print_prefill_header(first: str, second: str) -> None:
    threads = torch.get_num_threads()
    print(f"{'':>38} | {'1 thread, CPU time (best of 5)':^38} | {f'{threads} threads, wall time (best of 5)':^38}")
    print(f"{'dtype':>8} {'case':>29} | {first:>8} {second:>9} {'speedup':>7} {'GFLOP/s':>8} | "
          f"{first:>8} {second:>9} {'speedup':>7} {'GFLOP/s':>8}")


def compare_prefills(dtype, name, query_lens, seq_lens, first, second) -> None:
    """second against first (which it must match), on one thread and on torch's threads; GFLOP/s are second's."""
    expected = first().clone()
    torch.testing.assert_close(second().float(), expected.float(), atol=3e-2, rtol=3e-2)
    gflop = prefill_flops(query_lens, seq_lens) / 1e9
    first_1, second_1, first_n, second_n = one_thread_then_all(first, second, torch.get_num_threads())
    print(f"{str(dtype)[6:]:>8} {name:>29} | {first_1:>8.2f} {second_1:>9.2f} {first_1 / second_1:>6.2f}x "
          f"{gflop / second_1 * 1e3:>8.0f} | {first_n:>8.2f} {second_n:>9.2f} {first_n / second_n:>6.2f}x "
          f"{gflop / second_n * 1e3:>8.0f}")


def cpu_prefill() -> None:
    """Like cpu(): one thread by CPU time, then torch's threads by wall time."""
    from batchgen_kernels import cpu_backend

    if not cpu_backend.available():
        sys.exit("the C++ CPU kernels could not be built (see the warning above)")
    print(f"prefill, one layer ({KV_HEADS} kv heads x {GROUP} query heads each, head_dim {DIM}, block {BLOCK}); "
          "reference = reference.paged_prefills, kernel = cpu_backend.paged_prefills")
    print_prefill_header("ref ms", "kernel ms")
    for dtype in (torch.float32, torch.bfloat16):
        for name, (query_lens, seq_lens) in PREFILL_CASES.items():
            q, k_cache, v_cache, md, out = prefill_case(dtype, query_lens, seq_lens)

            def reference():
                ref.paged_prefills(q, k_cache, v_cache, md, DIM ** -0.5, out)
                return out

            def kernel():
                cpu_backend.paged_prefills(q, k_cache, v_cache, md, DIM ** -0.5, out)
                return out

            compare_prefills(dtype, name, query_lens, seq_lens, reference, kernel)


def amx_prefill() -> None:
    """bf16 prefills: the AMX tile kernel against the AVX512_BF16 one (both C++, both reading K/V in place), only
    where amx.status() says the tiles run. Like cpu(): one thread by CPU time, then torch's threads by wall time."""
    from batchgen_kernels import amx, cpu_backend

    if not (cpu_backend.available() and amx.available()):
        sys.exit(f"no AMX prefill here: {amx.status().reason}")
    print(f"bf16 prefill, one layer ({KV_HEADS} kv heads x {GROUP} query heads each, head_dim {DIM}, block {BLOCK}); "
          "avx512 = torch.ops.batchgen.paged_prefill_, amx = torch.ops.batchgen.paged_prefill_amx_")
    print_prefill_header("avx512 ms", "amx ms")
    for name, (query_lens, seq_lens) in PREFILL_CASES.items():
        q, k_cache, v_cache, md, out = prefill_case(torch.bfloat16, query_lens, seq_lens)
        args = (md.block_tables, md.seq_lens, md.query_start_loc, md.num_decodes, DIM ** -0.5, -1, out)

        def avx512():
            torch.ops.batchgen.paged_prefill_(q, k_cache, v_cache, *args)
            return out

        def tiles():
            torch.ops.batchgen.paged_prefill_amx_(q, k_cache, v_cache, *args)
            return out

        compare_prefills(torch.bfloat16, name, query_lens, seq_lens, avx512, tiles)


def prefill() -> None:
    torch.set_num_threads(1)
    context, new = 360, 110
    q = torch.randn(new, KV_HEADS * GROUP, DIM)
    k, v = torch.randn(context, KV_HEADS, DIM), torch.randn(context, KV_HEADS, DIM)
    allowed = torch.arange(context)[None, :] <= torch.arange(new)[:, None] + (context - new)

    def sdpa_masked():
        kr, vr = k.repeat_interleave(GROUP, 1).transpose(0, 1), v.repeat_interleave(GROUP, 1).transpose(0, 1)
        return F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, attn_mask=allowed).transpose(0, 1)

    def batched_matmuls():  # what reference.paged_prefill does after a cached prefix
        qg = q.view(new, KV_HEADS, GROUP, DIM).permute(1, 2, 0, 3).reshape(KV_HEADS, GROUP * new, DIM)
        scores = torch.bmm(qg, k.permute(1, 2, 0)).mul_(DIM ** -0.5).view(KV_HEADS, GROUP, new, context)
        probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), -1).view(KV_HEADS, GROUP * new, context)
        out = torch.bmm(probs, v.transpose(0, 1)).view(KV_HEADS, GROUP, new, DIM)
        return out.permute(2, 0, 1, 3).reshape(new, KV_HEADS * GROUP, DIM)

    assert torch.allclose(sdpa_masked(), batched_matmuls(), atol=1e-5)
    print(f"prefill {new} new tokens over {context} (1 thread): SDPA masked {timed(sdpa_masked, 50):.2f} ms, "
          f"batched matmuls {timed(batched_matmuls, 50):.2f} ms")
    torch.set_num_threads(2)


def mlp() -> None:
    gate_up, down = torch.randn(3072, 576), torch.randn(576, 1536)
    for tokens in (4096, 2048):
        x = torch.randn(tokens, 576)

        def run():
            gate, up = (x @ gate_up.t()).split(1536, -1)
            return (F.silu(gate) * up) @ down.t()
        ms = timed(run)
        print(f"mlp {tokens} tokens: {ms:.1f} ms, {tokens * 2 * 576 * 3072 * 1.5 / ms / 1e6:.0f} GFLOP/s")


if __name__ == "__main__":
    BENCHMARKS = {"decode": decode, "prefill": prefill, "mlp": mlp, "cpu": cpu, "cpu-stream": cpu_stream,
                  "cpu-prefill": cpu_prefill, "amx-prefill": amx_prefill}
    names = sys.argv[1:] or ["decode", "prefill", "mlp"]
    if any(name in ("-h", "--help") for name in names):
        print(__doc__)
        sys.exit(0)
    if any(name not in BENCHMARKS for name in names):
        sys.exit(__doc__)
    for name in names:
        BENCHMARKS[name]()
