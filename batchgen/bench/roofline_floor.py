"""The roofline's arithmetic: the least time one engine step can take on a machine with a given memory bandwidth
and matmul rate. A step's floor is max(bytes it must read / bandwidth, FLOPs it must do / matmul rate); whichever
term is larger is the bound that sets it.

Decode step (batch B, each sequence attending over `context` tokens, one new token each):
  bytes = the matmul weights once (every layer, the LM head; a tied embedding counted once: it is the LM head)
          + B x context x KV bytes per token
  FLOPs = 2 x matmul parameters x B + 4 x layers x query heads x head_dim x context x B   (QK^T and PV)
Prefill step (S fresh sequences of L tokens, no cache hits; the LM head runs on each sequence's last token only):
  FLOPs = 2 x (matmul parameters - LM head) x S x L + 2 x LM head x S
          + 4 x layers x query heads x head_dim x S x L (L + 1) / 2                           (causal attention)
  bytes = the matmul weights once + S x L x KV bytes per token (written)
An untied embedding table is not in the floor: a step reads only its B rows of it.

The floor lets memory traffic and arithmetic overlap perfectly. On a CPU a step runs its phases one after another
on the same cores: the linear layers (weights read, matmul FLOPs) and the attention (KV read, attention FLOPs) each
take at least their own max(bytes / bandwidth, FLOPs / rate), and only within a phase can the two overlap. Their
sum is `serial_s`: the least a step can take when its phases do not overlap, never less than the floor."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelCounts:
    num_layers: int
    num_heads: int  # query heads
    head_dim: int
    matmul_params: int  # every parameter but the embedding table, plus the LM head (the table itself when tied)
    lm_head_params: int
    weight_bytes: int  # the matmul parameters' bytes, as the model holds them
    kv_bytes_per_token: int  # K and V of every layer

    @classmethod
    def of(cls, setup, kv_bytes_per_token: int) -> "ModelCounts":
        """From the engine's set-up model (batchgen.engine.startup.EngineSetup): its shape from the engine plan's
        model description, its weights as they are held in memory: packed or quantized weights are counted at their
        real size (they are no longer plain parameters, so the counts come from the set-up's totals less the
        embedding table)."""
        shape, model = setup.plan.model, setup.model
        embedding = model.model.embed_tokens.weight
        lm_head_params = shape.vocab_size * shape.hidden_size
        matmul_params = setup.num_parameters - embedding.numel() + (lm_head_params if shape.tie_word_embeddings else 0)
        weight_bytes = setup.weights_bytes - embedding.numel() * embedding.element_size()
        if getattr(model.lm_head, "weight", None) is embedding:  # a tied head that is the table itself, not a copy
            weight_bytes += embedding.numel() * embedding.element_size()
        return cls(shape.num_layers, shape.num_heads, shape.head_dim, matmul_params, lm_head_params, weight_bytes,
                   kv_bytes_per_token)

    def describe(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Floor:
    bytes: float
    flops: float
    memory_s: float  # bytes / bandwidth
    compute_s: float  # FLOPs / matmul rate
    floor_s: float
    bound: str  # "memory" or "compute": the larger term
    serial_s: float  # the linear layers' floor plus the attention's floor, each phase on its own

    @classmethod
    def of(cls, linear: tuple[float, float], attention: tuple[float, float], bandwidth: float,
           flop_rate: float) -> "Floor":
        """From each phase's (bytes, FLOPs)."""
        nbytes, flops = linear[0] + attention[0], linear[1] + attention[1]
        memory_s, compute_s = nbytes / bandwidth, flops / flop_rate
        serial_s = sum(max(b / bandwidth, f / flop_rate) for b, f in (linear, attention))
        return cls(nbytes, flops, memory_s, compute_s, max(memory_s, compute_s),
                   "memory" if memory_s >= compute_s else "compute", serial_s)


def attention_flops(counts: ModelCounts, query_tokens_times_context: float) -> float:
    """QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, per query head and dimension, per (query, key) pair."""
    return 4 * counts.num_layers * counts.num_heads * counts.head_dim * query_tokens_times_context


def decode_floor(counts: ModelCounts, batch: int, context: int, bandwidth: float, flop_rate: float) -> Floor:
    linear = (counts.weight_bytes, 2 * counts.matmul_params * batch)
    attention = (batch * context * counts.kv_bytes_per_token, attention_flops(counts, batch * context))
    return Floor.of(linear, attention, bandwidth, flop_rate)


def prefill_floor(counts: ModelCounts, num_seqs: int, seq_len: int, bandwidth: float, flop_rate: float) -> Floor:
    tokens = num_seqs * seq_len
    linear = (counts.weight_bytes,
              2 * (counts.matmul_params - counts.lm_head_params) * tokens + 2 * counts.lm_head_params * num_seqs)
    attention = (tokens * counts.kv_bytes_per_token, attention_flops(counts, num_seqs * seq_len * (seq_len + 1) / 2))
    return Floor.of(linear, attention, bandwidth, flop_rate)


# -- a whole run's phases (bench --workload ...: phase_report.py) ------------------------------------------------
# Prefill: every prompt token that must be computed, each prefix that rows share computed once (what a prefix cache
# reaches at best), then each row's first token from the LM head; one pass over the weights. Decode: one step per
# further output token, batch = the rows still generating, each attending over its prompt and its output so far;
# every step reads the weights again. Each step's floor is max(bytes / bandwidth, FLOPs / rate); the phase's is
# their sum.

def counts_of_description(model, dtype) -> ModelCounts:
    """From a ModelDescription (batchgen.models.inspector) alone, the unquantized model in `dtype`: the roofline
    of the model, whatever form a system keeps its weights in."""
    from batchgen.engine.engine_plan import kv_bytes_per_token

    table = model.vocab_size * model.hidden_size
    matmul_params = model.parameters - table + (table if model.tie_word_embeddings else 0)
    return ModelCounts(model.num_layers, model.num_heads, model.head_dim, matmul_params, table,
                       matmul_params * dtype.itemsize, kv_bytes_per_token(model, dtype))


def distinct_prefixes(prompts: list[list[int]]) -> tuple[int, int]:
    """(tokens, attention pairs) of the prompts with every prefix that rows share computed once (a token trie): the
    least prefill work, which a prefix cache reaches at token rather than block granularity."""
    root: dict = {}
    tokens = pairs = 0
    for prompt in prompts:
        node = root
        for depth, token in enumerate(prompt, 1):
            if token not in node:
                node[token] = {}
                tokens += 1
                pairs += depth  # this token attends to itself and every one before it
            node = node[token]
    return tokens, pairs


def prefill_phase_floor(counts: ModelCounts, prompts: list[list[int]], bandwidth: float, flop_rate: float) -> Floor:
    """The prompts' distinct tokens computed once each, then each row's first token from the LM head."""
    tokens, pairs = distinct_prefixes(prompts)
    linear = (counts.weight_bytes, 2 * (counts.matmul_params - counts.lm_head_params) * tokens
              + 2 * counts.lm_head_params * len(prompts))
    attention = (tokens * counts.kv_bytes_per_token, attention_flops(counts, pairs))
    return Floor.of(linear, attention, bandwidth, flop_rate)


def decode_phase_floor(counts: ModelCounts, prompt_lens: list[int], output_lens: list[int], bandwidth: float,
                       flop_rate: float) -> dict:
    """Every decode step of rows with these prompt and output lengths (the first output token is prefill's):
    {floor_s, serial_s, memory_s, compute_s, steps}, each summed over the steps."""
    totals = {"floor_s": 0.0, "serial_s": 0.0, "memory_s": 0.0, "compute_s": 0.0, "steps": 0}
    for step in range(1, max(output_lens, default=0)):
        contexts = [p + step for p, o in zip(prompt_lens, output_lens) if o > step]
        floor = decode_floor(counts, len(contexts), sum(contexts) / len(contexts), bandwidth, flop_rate)
        for key in ("floor_s", "serial_s", "memory_s", "compute_s"):
            totals[key] += getattr(floor, key)
        totals["steps"] += 1
    return totals
