"""The CUDA path, as far as the CPU can take it: the padded decode runner behind the CUDA graphs (run without graphs,
on the Triton kernels under TRITON_INTERPRET=1), the KV budget's profiling step, the GPU check's arithmetic and a
dry run of it. The tests that need a GPU (graph capture and replay, the engine on CUDA against transformers) skip
cleanly without one."""
import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

from transformers import AutoModelForCausalLM  # noqa: E402

from batchgen.bench.gpu import check as gpu  # noqa: E402
from batchgen.bench.gpu.shapes import MODEL_CONFIGS, ModelShape, decode_floor, decode_step_cost  # noqa: E402
from batchgen.bench.greedy_check import assert_greedy_matches, greedy_verdict, hf_greedy, is_near_tie  # noqa: E402
from batchgen.bench.workloads import random_token_rows  # noqa: E402
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams  # noqa: E402
from batchgen.engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes, padded_batch_size  # noqa: E402
from batchgen.engine.gpu_memory import run_dummy_step  # noqa: E402
from batchgen.engine.kernel_warmup import uses_triton, warm_up_attention  # noqa: E402
from batchgen.engine.sequence import Sequence  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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


def test_the_kernel_warm_up_touches_no_kv_slot(tiny_llama_dir):
    """The startup warm-up (on CUDA it compiles every kernel variant before the first step) runs the model on
    inert rows: the KV cache is bit for bit what it was."""
    engine = make_engine(tiny_llama_dir)
    kv = engine.runner.kv_cache
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    before = kv.clone()
    warm_up_attention(engine.model, engine.max_model_len)
    assert torch.equal(kv, before)
    assert uses_triton(torch.device("cpu"), "triton") and uses_triton(torch.device("cuda"), "auto")
    assert not uses_triton(torch.device("cuda"), "torch") and not uses_triton(torch.device("cpu"), "auto")


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


# ----------------------------------------------------------------------------------- the GPU check's figures

def meta_parameter_count(config_kwargs) -> int:
    from transformers import LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config_kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("key, params", [("1b", 1_235_814_400), ("8b", 8_030_261_248)])
def test_model_shapes_count_the_parameters_of_the_real_models(key, params):
    shape = ModelShape.from_config(MODEL_CONFIGS[key])
    assert shape.num_params == params == meta_parameter_count(MODEL_CONFIGS[key])


def test_decode_step_cost_and_floor():
    shape = ModelShape.from_config(MODEL_CONFIGS["8b"])
    assert shape.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    one = decode_step_cost(shape, batch_size=1, total_context=1000)
    # Every weight once (the untied embedding: one row), 1000 tokens of K and V.
    assert one["weight_bytes"] == 2 * (8_030_261_248 - 128256 * 4096 + 4096)
    assert one["kv_bytes"] == 1000 * 131072
    assert one["matmul_flops"] == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)
    assert one["attention_flops"] == 4 * 32 * 32 * 128 * 1000
    floor = decode_floor(one, copy_bandwidth=4e12, matmul_rate=7e14)
    assert floor["bound"] == "memory" and floor["floor_s"] == pytest.approx(one["bytes"] / 4e12)
    assert floor["floor_s"] == pytest.approx(3.785e-3, rel=1e-3)  # 15.0 GB of weights, 0.13 GB of KV
    big = decode_step_cost(shape, batch_size=8192, total_context=8192)
    assert decode_floor(big, 4e12, 7e14)["bound"] == "compute"
    # The batch's KV scales with its total context; weights are read once whatever the batch.
    wide = decode_step_cost(shape, batch_size=256, total_context=256 * 1000)
    assert wide["kv_bytes"] == 256 * one["kv_bytes"] and wide["weight_bytes"] - one["weight_bytes"] == 255 * 4096 * 2
    tied = ModelShape.from_config(MODEL_CONFIGS["1b"])
    assert decode_step_cost(tied, 256, 1)["weight_bytes"] == decode_step_cost(tied, 1, 1)["weight_bytes"]


def test_synthetic_workload():
    def synthetic_workload(*args, seed):
        return [(row.token_ids, row.max_tokens) for row in random_token_rows(*args, seed=seed)]

    workload = synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=3)
    assert len(workload) == 300
    assert all(100 <= len(p) <= 1000 and 100 <= m <= 500 and all(0 <= t < 128256 for t in p) for p, m in workload)
    assert min(len(p) for p, _ in workload) < 200 and max(len(p) for p, _ in workload) > 900
    assert workload == synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=3)
    assert workload != synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=4)


def test_greedy_verdict_and_the_bf16_near_tie_rule():
    assert is_near_tie(5.0, 4.95, rel_tol=2**-6, abs_tol=1e-3)  # within 0.079
    assert not is_near_tie(5.0, 4.85, rel_tol=2**-6, abs_tol=1e-3)
    assert not is_near_tie(5.0, 4.995, rel_tol=0.0, abs_tol=1e-3)  # fp32: the absolute 1e-3 alone
    references = [[1, 2, 3], [4, 5, 6]]
    logits = [torch.zeros(3, 10) for _ in references]
    logits[1][1, 5], logits[1][1, 9] = 3.0, 2.99  # prompt 1, step 1: tokens 5 and 9 nearly tie
    ok = greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 2**-6, 1e-3, max_divergences=1)
    assert ok["ok"] and ok["identical"] == 1 and ok["divergences"][0]["step"] == 1
    assert not greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 0.0, 1e-3, 1)["ok"]
    logits[1][1, 9] = 1.0  # no longer a tie
    assert not greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 2**-6, 1e-3, 1)["ok"]
    assert not greedy_verdict(references, logits, [[1, 2], [4, 5, 6]], 2**-6, 1e-3, 1)["ok"]  # stopped early


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """The whole check, end to end, with a tiny model on the CPU: every step runs and the JSON has its figures."""
    out = tmp_path / "gpu.json"
    code = gpu.main(["--device", "cpu", "--models", "tiny", "--kv-cache-memory", "16MiB", "--requests", "10",
                     "--prompt-min", "5", "--prompt-max", "40", "--output-min", "2", "--output-max", "12",
                     "--hf-requests", "4", "--hf-batch-size", "2", "--greedy-prompts", "3", "--greedy-tokens", "6",
                     "--decode-batch-sizes", "1", "4", "--decode-context", "20", "--decode-steps", "3",
                     "--max-num-seqs", "8", "--out", str(out)])
    record = json.loads(out.read_text())
    assert code == 0 and record["passed"] and record["errors"] == []
    tiny = record["models"]["tiny"]
    assert tiny["greedy_fp32"]["ok"] and tiny["greedy_bf16"]["ok"]
    assert tiny["batchgen"]["finished"] == 10 and tiny["batchgen"]["wrong_length"] == 0
    assert tiny["hf_static"]["rows"] == 4 and tiny["hf_static"]["output_tokens_per_s"] > 0
    assert set(tiny["decode"]) >= {"1", "4"} and tiny["decode"]["4"]["ratio_to_floor"] > 0
    assert tiny["targets"]["speedup_vs_hf_static"] > 0


def test_gpu_check_imports_nothing_the_gpu_box_lacks():
    """Run as on the GPU box, with the packages it has not got made unimportable: --help still works."""
    blocked = ["psutil", "click", "pyarrow", "polars", "matplotlib", "gguf", "pytest"]
    # A None entry in sys.modules makes `import name` fail and importlib.util.find_spec(name) return None.
    code = (f"import sys, runpy\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
            f"sys.argv = ['batchgen.bench', '--gpu', '--help']\nrunpy.run_module('batchgen.bench', run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--quick" in done.stdout and "--decode-batch-sizes" in done.stdout


# ------------------------------------------------------------------------------------------------ on a GPU

@needs_cuda
def test_captured_decode_steps_match_the_unpadded_ones(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, device="cuda", triton=False, dtype="float32", max_num_seqs=4,
                         enforce_eager=True)
    graphs = DecodeGraphRunner(engine.model, 16, 4, engine.max_model_len, engine.device, capture=True)
    run_decode_steps(engine, graphs)
    assert set(graphs._graphs) == {1, 2, 4}


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_with_graphs_matches_eager_and_transformers(tiny_llama_dir, dtype):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    rng = random.Random(2)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(3, 200))] for _ in range(12)]
    outputs = {}
    for eager in (True, False):
        engine = make_engine(tiny_llama_dir, device="cuda", triton=False, dtype=dtype, kv_cache_memory=None,
                             max_num_seqs=16, enforce_eager=eager)
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
    else:  # bf16: graphs and eager run the same kernels; only the decode split differs
        same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
        assert same >= len(prompts) - 2, (outputs[True], outputs[False])
