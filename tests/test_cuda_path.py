"""The CUDA path, as far as the CPU can take it: the padded decode runner behind the CUDA graphs (run without graphs,
on the Triton kernels under TRITON_INTERPRET=1) and the KV budget's profiling step. The tests that need a GPU (graph
capture and replay, the engine on CUDA against transformers) skip cleanly without one; the GPU check runs them on
a GPU (batchgen/bench/gpu/step_kernel_tests.py)."""
import gc
import random

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

from transformers import AutoModelForCausalLM  # noqa: E402

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy  # noqa: E402
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams  # noqa: E402
from batchgen.engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes, padded_batch_size  # noqa: E402
from batchgen.engine.gpu_memory import run_dummy_step  # noqa: E402
from batchgen.engine.kernel_warmup import uses_triton, warm_up_attention  # noqa: E402
from batchgen.engine.sequence import Sequence  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_engine(model_dir, device="cpu", triton=True, **kwargs):
    # On the CPU the engine would pick the torch reference; padding rows need the Triton kernels.
    args = dict(model=str(model_dir), device=device, dtype="float32", kv_cache_memory="2MiB", max_num_seqs=8,
                max_num_batched_tokens=256, attention_backend="triton" if triton else "auto")
    args.update(kwargs)
    return Engine(EngineArgs(**args))


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------------------------- buckets

def test_graph_batch_sizes_and_the_bucket_of_a_batch():
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 250, 256)] == [1, 4, 8, 8, 16, 256, 256]
    for bad in (0, 257):
        with pytest.raises(ValueError):
            padded_batch_size(bad, sizes)


# --------------------------------------------------------------------- the padded decode path, step by step

class DecodeSteps:
    """Sequences in the engine's KV pool, decoded one token at a time by hand, each step both ways: the unpadded
    varlen batch (the eager path) and the padded runner, from the same cache contents."""

    def __init__(self, engine: Engine, graphs: DecodeGraphRunner, lengths: list[int], seed: int = 0) -> None:
        self.engine, self.graphs = engine, graphs
        gen = torch.Generator().manual_seed(seed)
        kv = engine.runner.kv_cache
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))  # every slot random: a wrong read shows
        rng = random.Random(seed)
        self.seqs = []
        for i, n in reversed(list(enumerate(lengths))):  # block ids then do not follow the batch order
            seq = Sequence.from_request(Request(i, [rng.randrange(300) for _ in range(n)], greedy(8)), seed=0)
            self.allocate(seq, n)
            seq.num_computed_tokens = n - 1  # the last prompt token is next
            self.seqs.insert(0, seq)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        assert self.engine.kv_cache_manager.allocate_slots(seq, num_tokens)

    def advance(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.num_computed_tokens += 1
            seq.token_ids.append(7)
            self.allocate(seq, 1)

    def preempt_and_readmit(self, seq: Sequence) -> None:
        """What the scheduler does on preemption, then a readmission into different blocks."""
        self.engine.kv_cache_manager.free(seq)
        seq.num_preemptions += 1
        computed = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        self.allocate(seq, computed + 1)
        seq.num_computed_tokens = computed

    def check(self, seqs: list[Sequence], atol: float = 1e-4) -> None:
        batch = [(seq, 1) for seq in seqs]
        runner, kv = self.engine.runner, self.engine.runner.kv_cache
        before = kv.clone()
        with torch.inference_mode():
            input_ids, positions, metadata = runner._prepare(batch)
            expected = self.engine.model(input_ids, positions, metadata)
        expected_kv = kv.clone()
        kv.copy_(before)
        got = self.graphs.run(batch)
        assert got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
        # The real rows wrote their slots as the eager step did; padding rows wrote nothing anywhere.
        flat = lambda t: t.flatten(2, 3)  # noqa: E731  [layers, 2, slots, heads, dim]
        written = torch.zeros(flat(kv).shape[2], dtype=torch.bool, device=kv.device)
        written[metadata.slot_mapping] = True
        assert torch.equal(flat(kv)[:, :, ~written], flat(before)[:, :, ~written])
        torch.testing.assert_close(flat(kv)[:, :, written].float(), flat(expected_kv)[:, :, written].float(),
                                   atol=atol, rtol=atol)


def run_decode_steps(engine: Engine, graphs: DecodeGraphRunner, atol: float = 1e-4) -> None:
    # Contexts of 5, 16, 17 and 130 tokens (block size 16): one block, a full block, one past, several (and more
    # than one 64-token tile of the decode kernel, which a too small max_seq_len would cut short).
    steps = DecodeSteps(engine, graphs, [5, 16, 17, 130])
    s = steps.seqs
    steps.check(s, atol)  # 4 rows in the 4-bucket: no padding
    steps.advance(s)  # the 16-token sequence now needs a new block: the cached block ids must grow
    steps.check([s[2], s[0], s[3]], atol)  # 3 rows, 1 padding row over last step's (stale) 4th row
    steps.advance([s[2], s[0], s[3]])
    steps.preempt_and_readmit(s[3])  # same number of blocks, other ids: the cached ids must be rebuilt
    steps.check([s[3], s[1]], atol)
    steps.check([s[1]], atol)  # the 1-bucket
    assert set(graphs.steps_by_size) == {1, 2, 4}


def test_padded_decode_steps_match_the_unpadded_ones(tiny_llama_dir):
    """The padded runner (without graphs) gives the eager path's hidden states and KV writes, and its padding rows
    touch nothing, across bucket changes, block growth and a preemption."""
    engine = make_engine(tiny_llama_dir, max_num_seqs=4)
    assert engine.runner.decode_graphs is None  # on the CPU the engine never takes this path by itself
    graphs = DecodeGraphRunner(engine.model, 16, 4, engine.max_model_len, engine.device, capture=False)
    run_decode_steps(engine, graphs)


def test_engine_on_the_padded_decode_path_matches_transformers(tiny_llama_dir):
    """The whole engine with decode-only steps on the padded runner: as batches shrink they go through the 8, 4, 2
    and 1 buckets, and the tokens are transformers' greedy ones."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    rng = random.Random(1)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(3, 60))] for _ in range(5)]
    lengths = [12, 10, 7, 5, 3]
    references = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]

    engine = make_engine(tiny_llama_dir)
    graphs = DecodeGraphRunner(engine.model, 16, 8, engine.max_model_len, engine.device, capture=False)
    engine.runner.decode_graphs = graphs
    results = {r.request_id: r for r in engine.generate(
        Request(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, lengths)))}
    assert_greedy_matches(hf, prompts, references, [results[i].token_ids for i in range(5)])
    assert set(graphs.steps_by_size) == {1, 2, 4, 8}


def test_the_kernel_warm_up_touches_no_kv_slot(tiny_llama_dir, monkeypatch):
    """The startup warm-up (on CUDA it compiles every kernel variant before the first step) runs the model on
    inert rows: the KV cache is bit for bit what it was."""
    engine = make_engine(tiny_llama_dir)
    kv = engine.runner.kv_cache
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    before = kv.clone()
    warm_up_attention(engine.model, engine.max_model_len)
    assert torch.equal(kv, before)
    from batchgen_kernels import triton_probe
    monkeypatch.setattr(triton_probe, "_results", {})
    monkeypatch.setattr(triton_probe, "launch", lambda device: None)  # as on a GPU whose probe kernel runs
    assert uses_triton(torch.device("cpu"), "triton") and uses_triton(torch.device("cuda"), "auto")
    assert not uses_triton(torch.device("cuda"), "torch") and not uses_triton(torch.device("cpu"), "auto")


def test_an_int8_kv_cache_on_the_padded_decode_path_matches_the_cpu_kernels(tiny_llama_dir):
    """engine.kv_cache_dtype int8 on the Triton kernels, decode-only steps on the padded runner (its padding rows: slot
    -1, context 0): the tokens of the CPU's own attention (`auto`) over its own int8 cache (fp32: the same int8 bits,
    the arithmetic's rounding apart), and the warm-up leaves the cache and its scales as they were."""
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    requests = [Request(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, [6, 4, 2]))]
    outputs = []
    for triton in (True, False):
        engine = make_engine(tiny_llama_dir, triton=triton, kv_cache_dtype="int8", max_num_seqs=4)
        if triton:
            engine.runner.decode_graphs = graphs = DecodeGraphRunner(engine.model, 16, 4, engine.max_model_len,
                                                                     engine.device, capture=False)
            kv, scales = engine.runner.kv_cache, engine.runner.kv.scales
            kv.copy_(torch.randint(-127, 128, kv.shape, dtype=torch.int8))
            scales.copy_(torch.rand(scales.shape))
            before = kv.clone(), scales.clone()
            warm_up_attention(engine.model, engine.max_model_len)
            assert torch.equal(kv, before[0]) and torch.equal(scales, before[1])
        results = {r.request_id: r.token_ids for r in engine.generate(requests)}
        outputs.append([results[i] for i in range(3)])
    assert set(graphs.steps_by_size) == {1, 2, 4}
    assert outputs[0] == outputs[1]


def test_the_profiling_step_runs_on_both_backends(tiny_llama_dir):
    """The dummy step that sizes the KV cache on CUDA: many prompt tokens over the sequences, or one each."""
    for triton in (False, True):
        model = make_engine(tiny_llama_dir, triton=triton).model
        for num_tokens, max_num_seqs, expected_rows in ((300, 7, 7), (5, 8, 5)):
            ids = run_dummy_step(model, num_tokens, max_num_seqs, block_size=16)
            assert ids.shape == (expected_rows,) and bool(((ids >= 0) & (ids < 384)).all())


def test_engine_args_kv_cache_memory_default():
    args = EngineArgs()
    assert args.kv_cache_memory is None and args.cpu_kv_cache_memory() == "2GiB"
    assert EngineArgs(kv_cache_memory="1GiB").cpu_kv_cache_memory() == "1GiB"
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineArgs(enforce_eager="yes").validate()


# ------------------------------------------------------------------------------------------------ on a GPU

@needs_cuda
def test_captured_decode_steps_match_the_unpadded_ones(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, device="cuda", triton=False, dtype="float32", max_num_seqs=4,
                         enforce_eager=True)
    graphs = DecodeGraphRunner(engine.model, 16, 4, engine.max_model_len, engine.device, capture=True)
    run_decode_steps(engine, graphs)
    assert set(graphs._graphs) == {1, 2, 4}


@needs_cuda
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_engine_on_cuda_with_graphs_matches_eager_and_transformers(tiny_llama_dir, dtype, kv_cache_dtype):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    rng = random.Random(2)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(3, 200))] for _ in range(12)]
    outputs = {}
    for eager in (True, False):
        engine = make_engine(tiny_llama_dir, device="cuda", triton=False, dtype=dtype, kv_cache_memory=None,
                             max_num_seqs=16, enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)
        assert (engine.runner.decode_graphs is None) == eager
        # sized from free device memory, then capped at what 16 sequences of the 512-token context can use
        assert engine.kv_pool.num_blocks == 16 * (512 // 16 + 1) and "gpu_memory_utilization" in engine.kv_pool.reason
        results = {r.request_id: r for r in engine.generate(Request(i, p, greedy(24)) for i, p in enumerate(prompts))}
        outputs[eager] = [results[i].token_ids for i in range(len(prompts))]
        if not eager:
            assert sum(engine.runner.decode_graphs.steps_by_size.values()) >= 20
        del engine, results
        gc.collect()
        torch.cuda.empty_cache()  # the next engine sizes its KV cache from the free memory
    if dtype == "float32":
        references = [hf_greedy(hf, p, 24) for p in prompts]
        assert_greedy_matches(hf, prompts, references, outputs[False])
        assert_greedy_matches(hf, prompts, references, outputs[True])
    else:  # bf16 (over an int8 cache too): graphs and eager run the same kernels; only the decode split differs
        same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
        assert same >= len(prompts) - 2, (outputs[True], outputs[False])
