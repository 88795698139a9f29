"""Our Llama-family model against transformers' own, on the same weights: prefill, chunked prefill and decode over
a paged KV cache, with several sequences of different lengths in one flat batch."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from batchgen.models.loader import load_model, load_tokenizer
from batchgen.models import LlamaForCausalLM, UnsupportedModelError, build_model
from batchgen_kernels import AttentionMetadata

ATOL = 1e-4


class PagedSequences:
    """A hand-rolled stand-in for the engine's cache manager: hands each sequence cache blocks from a shuffled pool
    (so block tables are not contiguous) and builds one step's flat batch and AttentionMetadata."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 96, block_size: int = 4, seed: int = 0) -> None:
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.k_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        self.v_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        model.bind_kv_cache(self.k_caches, self.v_caches)
        self.model = model
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> torch.Tensor:
        """Run one step (decodes, i.e. single tokens, must come first) and return the logits of every new token."""
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, tokens in new_tokens.items():
            start = len(self.tokens.setdefault(seq, []))
            self.tokens[seq] += tokens
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < len(self.tokens[seq]):
                blocks.append(self.free_blocks.pop())
            for pos in range(start, len(self.tokens[seq])):
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, len(self.tokens[seq]))
            query_lens.append(len(tokens))
            seq_lens.append(len(self.tokens[seq]))
            tables.append(blocks)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        assert all(n != 1 for n in query_lens[num_decodes:]), "decodes must come first"
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        md = AttentionMetadata.build(query_lens, seq_lens, block_tables, torch.tensor(slots, dtype=torch.int64), "cpu")
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), md)
            return self.model.compute_logits(hidden)


def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item()
    assert err <= atol, f"max |ours - transformers| = {err:.3g} > {atol}"


TINY_MODELS = ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_qwen2_dir", "tiny_mistral_dir"]


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny_pair(request):
    """(our model, transformers' model) for the same tiny checkpoint, both fp32 on the CPU."""
    model_dir = request.getfixturevalue(request.param)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_model(model_dir, torch.float32, torch.device("cpu")), hf_model


def random_tokens(n: int, seed: int, vocab: int = 384) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=generator).tolist()


def test_prefill_of_several_sequences_in_one_batch(tiny_pair):
    model, hf_model = tiny_pair
    prompts = {"a": random_tokens(5, 1), "b": random_tokens(11, 2), "c": random_tokens(17, 3)}
    logits = PagedSequences(model).step(prompts)
    expected = torch.cat([reference_logits(hf_model, p) for p in prompts.values()])
    assert_close(logits, expected)


def test_chunked_prefill_over_a_cached_prefix(tiny_pair):
    model, hf_model = tiny_pair
    long, short = random_tokens(23, 4), random_tokens(6, 5)
    cache = PagedSequences(model)
    first = cache.step({"long": long[:9]})
    second = cache.step({"long": long[9:], "short": short})  # continues `long` beside a fresh prefill
    full = reference_logits(hf_model, long)
    assert_close(first, full[:9])
    assert_close(second, torch.cat([full[9:], reference_logits(hf_model, short)]))


def test_decode_steps_mixed_with_a_prefill(tiny_pair):
    model, hf_model = tiny_pair
    prompts = {"a": random_tokens(7, 6), "b": random_tokens(10, 7)}
    cache = PagedSequences(model)
    last = cache.step(prompts)
    next_tokens = {"a": [int(last[6].argmax())], "b": [int(last[16].argmax())]}
    late_prompt = random_tokens(8, 8)
    for step in range(4):
        batch = dict(next_tokens)
        if step == 1:
            batch["late"] = late_prompt  # a prefill joining a step of decodes
        logits = cache.step(batch)
        for row, seq in enumerate(next_tokens):
            assert_close(logits[row], reference_logits(hf_model, cache.tokens[seq])[-1])
            next_tokens[seq] = [int(logits[row].argmax())]
        if step == 1:
            assert_close(logits[2:], reference_logits(hf_model, late_prompt))
    assert len(cache.tokens["a"]) == 7 + 4


def test_config_derived_attributes(tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir):
    llama = load_model(tiny_llama_dir, torch.float32, "cpu")
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (2, 2, 16, 384)
    assert llama.max_model_len == 512
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    qwen2 = load_model(tiny_qwen2_dir, torch.float32, "cpu")
    assert qwen2.head_dim == 64 // 4
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight  # tied, not a copy
    assert load_model(tiny_mistral_dir, torch.float32, "cpu").max_model_len == 256  # capped at the sliding window


def test_default_model_matches_transformers_on_a_real_prompt(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    prompt = tokenizer("The capital of France is")["input_ids"]
    model = load_model(default_model_dir, torch.float32, "cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    cache = PagedSequences(model, num_blocks=16, block_size=16)
    logits = cache.step({"p": prompt})
    assert_close(logits, reference_logits(hf_model, prompt), atol=5e-4)
    for _ in range(3):
        token = int(logits[-1].argmax())
        logits = cache.step({"p": [token]})
        assert_close(logits[0], reference_logits(hf_model, cache.tokens["p"])[-1], atol=5e-4)
    with torch.no_grad():
        hf_greedy = hf_model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0].tolist()
    assert cache.tokens["p"] == hf_greedy


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as error:
        build_model(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert "LlamaForCausalLM" in str(error.value)  # lists what is supported
    assert isinstance(error.value, ValueError)


def test_unsupported_rope_type_is_refused():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=32, rope_scaling={"rope_type": "yarn", "factor": 2.0},
                         architectures=["LlamaForCausalLM"])
    with torch.device("meta"), pytest.raises(ValueError, match="yarn"):
        build_model(config)
