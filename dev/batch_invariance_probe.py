"""Which kernels give a row other bits depending on what shares its call: the evidence behind docs/architecture.md,
"Batch invariance". Each probe computes rows in calls of different sizes (and at 1 and 2 threads) and compares them
with torch.equal; it prints where they differ.

    python dev/batch_invariance_probe.py linear      # oneDNN packed (fp32; bf16 where supported), MKL, UpcastLinear, int8
    python dev/batch_invariance_probe.py packed      # oneDNN packed linears at real models' shapes, 1-512 rows
    python dev/batch_invariance_probe.py attention   # torch reference and C++ decode/prefill kernels
"""
from __future__ import annotations

import argparse

import torch
from torch import nn


def differing(fn, x: torch.Tensor, sizes) -> list[int]:
    """Row counts M at which fn(x[:M]) differs from the rows of the largest call."""
    full = fn(x)
    return [m for m in sizes if not torch.equal(fn(x[:m]), full[:m])]


def linears() -> None:
    from batchgen.models.packed_linear import PackedLinear, packing_supported
    from batchgen.models.quantization import Int8Linear
    from batchgen.models.upcast_linear import UpcastLinear

    sizes = list(range(1, 65)) + [100, 255]
    for k, n in ((256, 512), (576, 1536), (2048, 2048)):
        torch.manual_seed(0)
        w, x = torch.randn(n, k) / k**0.5, torch.randn(256, k)
        plain = nn.Linear(k, n, bias=False)
        plain.weight.data = w.clone()
        wb = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        wb.weight.data = w.to(torch.bfloat16)
        cases = {"oneDNN packed fp32": (PackedLinear(w, None), x),
                 "MKL fp32 (F.linear)": (lambda t: torch.nn.functional.linear(t, w), x),
                 "UpcastLinear bf16": (UpcastLinear(nn.Parameter(wb.weight.data, requires_grad=False), None),
                                       x.to(torch.bfloat16)),
                 "torch bf16 (F.linear)": (lambda t: torch.nn.functional.linear(t, wb.weight), x.to(torch.bfloat16)),
                 "int8 W8A8": (Int8Linear.from_linear(plain, "dynamic_int8"), x),
                 "int8 weight-only bf16": (Int8Linear.from_linear(wb, "weight_only"), x.to(torch.bfloat16))}
        if packing_supported(torch.device("cpu"), torch.bfloat16):  # oneDNN takes bf16 only on AVX-512 or newer
            cases["oneDNN packed bf16"] = (PackedLinear(wb.weight.data, None), x.to(torch.bfloat16))
        for name, (fn, inputs) in cases.items():
            for threads in (2, 1):
                torch.set_num_threads(threads)
                print(f"{k}->{n} {name:24s} {threads} thread(s): rows differ at M = {differing(fn, inputs, sizes)}")
            torch.set_num_threads(2)


def attention() -> None:
    from batchgen_kernels import cpu_backend
    from batchgen_kernels.reference import paged_decode, paged_prefill

    block, kv_heads, q_heads, dim, length = 16, 3, 9, 64, 1024
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        k_cache, v_cache = (torch.randn(200, block, kv_heads, dim).to(dtype) for _ in range(2))
        table = torch.randperm(200)[:80].int()
        scale = dim**-0.5
        q = torch.randn(length, q_heads, dim).to(dtype)
        tables = table[None].expand(length, -1).contiguous()
        positions = torch.arange(1, length + 1, dtype=torch.int32)
        at_once = paged_prefill(q, k_cache, v_cache, table, length, scale)
        chunk = paged_prefill(q[100:], k_cache, v_cache, table, length, scale)
        print(f"{dtype} torch reference prefill: rows after a 100-token chunk equal: {torch.equal(chunk, at_once[100:])}")
        alone = paged_decode(q[-1:], k_cache, v_cache, tables[:1], positions[-1:], length, scale)
        mixed = paged_decode(q[[-1, 5]], k_cache, v_cache, tables[:2], positions[[-1, 5]], length, scale)
        print(f"{dtype} torch reference decode: alone equals beside a shorter row: {torch.equal(alone[0], mixed[0])}")
        if not cpu_backend.available():
            print("C++ kernels not built: skipped")
            continue
        out = torch.empty_like(q)

        def prefill(seq_lens, q_lens, rows):
            starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
            result = torch.empty_like(rows)
            torch.ops.batchgen.paged_prefill_(rows, k_cache, v_cache, table[None].expand(len(seq_lens), -1).contiguous(),
                                              torch.tensor(seq_lens, dtype=torch.int32), starts, 0, scale, 0, result)
            return result

        out = prefill([length], [length], q)
        chunks = torch.cat([prefill([517], [517], q[:517]), prefill([length], [length - 517], q[517:])])
        one_rows = prefill(list(range(1, length + 1)), [1] * length, q)
        torch.set_num_threads(1)
        one_thread = prefill([length], [length], q)
        torch.set_num_threads(2)
        decode = torch.ops.batchgen.paged_decode(q, k_cache, v_cache, tables, positions, scale, 0)
        print(f"{dtype} C++ prefill kernel: chunks {torch.equal(chunks, out)}, each row alone {torch.equal(one_rows, out)},"
              f" 1 thread {torch.equal(one_thread, out)}; C++ decode kernel equals it: {torch.equal(decode, out)}")


def packed() -> None:
    """oneDNN's packed linears (fp32, bf16 where supported) at real models' shapes, 1-512 rows: where a lone row
    takes other bits (PackedLinear with batch_invariant computes it as two)."""
    from batchgen.models.packed_linear import PackedLinear, packing_supported

    sizes = list(range(1, 65)) + [100, 255, 512]
    dtypes = [torch.float32] + ([torch.bfloat16] if packing_supported(torch.device("cpu"), torch.bfloat16) else [])
    for k, n in ((576, 1536), (1536, 576), (576, 192), (2048, 512), (2048, 2048), (2048, 8192), (8192, 2048),
                 (3072, 8192), (4096, 4096), (4096, 14336), (14336, 4096)):
        torch.manual_seed(0)
        w, x = torch.randn(n, k) / k**0.5, torch.randn(512, k)
        for dtype in dtypes:
            linear = PackedLinear(w.to(dtype), None)
            for threads in (2, 1):
                torch.set_num_threads(threads)
                print(f"{k}->{n} {str(dtype):15s} {threads} thread(s): rows differ at M = "
                      f"{differing(linear, x.to(dtype), sizes)}", flush=True)
            torch.set_num_threads(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("linear", "packed", "attention"))
    args = parser.parse_args()
    {"linear": linears, "packed": packed, "attention": attention}[args.probe]()


if __name__ == "__main__":
    main()
