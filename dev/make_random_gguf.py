"""Random-weight GGUF files of real shapes, for the memory and speed of batchgen's GGUF path (tests, the README's
8B figure): a Llama GGUF that transformers and batchgen read like a real one, its blocks random but valid (every
fp16 scale finite, chosen so that the weights are about 1/sqrt(fan-in) in size). Never put one in git: a path
inside a git checkout is refused.

    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_gguf.py --shape llama-8b --types Q4_K_M --out /tmp/l8b.gguf
    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_gguf.py --shape tiny --types Q6_K --out /tmp/tiny.gguf

The tokenizer is the default model's (SmolLM2's byte-level BPE, its chat template and special tokens), copied from
its GGUF's metadata. A shape whose vocabulary is larger (llama-8b: Llama 3's 128,256) gets the extra ids as
`<|reserved_N|>` tokens that no text encodes to, so the embedding and LM head have the real model's size while the
prompts tokenize as SmolLM2's. `--types` is one GGUF type for every matrix (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K) or Q4_K_M, llama.cpp's mix (Q4_K, and Q6_K for the LM head and for attn_v and ffn_down of
the layers its `use_more_bits` picks); norms are F32. The file is written one tensor at a time (GGUFWriter's
header first): the script holds one tensor's quantized bytes, never the model.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

SHAPES = {  # Llama-3-8B, and a tiny Llama for tests (its widths multiples of 256, the K-quants' block)
    "llama-8b": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256,
                 "context": 8192, "rope_theta": 500000.0, "eps": 1e-5, "tied": False},
    "tiny": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 2048,
             "context": 2048, "rope_theta": 10000.0, "eps": 1e-5, "tied": False},
}
# type -> the fp16 fields of a block: (byte offset, value as a multiple of the block's step `d`); the step is
# STEP[type] * amplitude. A minimum (Q4_1, Q5_1: m; K-quants: dmin) centres the weights near zero.
FP16_FIELDS = {
    "Q8_0": [(0, 1.0)], "Q4_0": [(0, 1.0)], "Q5_0": [(0, 1.0)],
    "Q4_1": [(0, 1.0), (2, -7.5)], "Q5_1": [(0, 1.0), (2, -15.5)],
    "Q2_K": [(80, 1.0), (82, 1.5)], "Q3_K": [(108, 1.0)], "Q4_K": [(0, 1.0), (2, 7.5)],
    "Q5_K": [(0, 1.0), (2, 15.5)], "Q6_K": [(208, 1.0)],
}
STEP = {"Q8_0": 2 / 127, "Q4_0": 2 / 8, "Q5_0": 2 / 16, "Q4_1": 4 / 15, "Q5_1": 4 / 31, "Q2_K": 2 / 45,
        "Q3_K": 2 / 128, "Q4_K": 4 / 945, "Q5_K": 4 / 1953, "Q6_K": 2 / 4096}
TYPES = tuple(FP16_FIELDS)
FILE_TYPES = {"Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
              "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
              "Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_M,
              "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
              "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M}


def default_gguf() -> Path:
    from batchgen.models.named import NAMED_MODELS

    return NAMED_MODELS["default"].gguf("default")


def tokenizer_fields(source: Path, vocab: int | None) -> list[tuple[str, object, object, object]]:
    """The tokenizer's metadata of the GGUF `source` as (key, value, type, element type), its vocabulary padded to
    `vocab` tokens with unreachable `<|reserved_N|>` ones, or cut to its first `vocab` tokens (and the merges
    between those: a smaller BPE of the same bytes, quick to parse, for tests)."""
    reader = GGUFReader(source)
    fields = {key: (field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
              for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    tokens, token_types = fields["tokenizer.ggml.tokens"][0], fields["tokenizer.ggml.token_type"][0]
    if vocab and vocab > len(tokens):
        tokens = tokens + [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
        token_types = token_types + [1] * (vocab - len(token_types))
    elif vocab:
        tokens, token_types = tokens[:vocab], token_types[:vocab]
        kept = set(tokens)
        merges = [m for m in fields["tokenizer.ggml.merges"][0]
                  if m.split(" ")[0] in kept and m.split(" ")[1] in kept and m.replace(" ", "") in kept]
        fields["tokenizer.ggml.merges"] = (merges, *fields["tokenizer.ggml.merges"][1:])
    fields["tokenizer.ggml.tokens"] = (tokens, *fields["tokenizer.ggml.tokens"][1:])
    fields["tokenizer.ggml.token_type"] = (token_types, *fields["tokenizer.ggml.token_type"][1:])
    return [(key, *value) for key, value in fields.items()]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors_of(shape: dict, types: str, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, columns] or [n], type) of every tensor, in the order llama.cpp writes them."""
    h, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv, inter, layers = shape["kv_heads"] * head_dim, shape["intermediate"], shape["layers"]

    def kind(name: str, layer: int | None = None) -> str:
        if types != "Q4_K_M":
            return types
        more = layer is not None and use_more_bits(layer, layers)
        return "Q6_K" if name == "output" or (more and name in ("attn_v", "ffn_down")) else "Q4_K"

    out = [("token_embd.weight", (vocab, h), kind("token_embd"))]
    for i in range(layers):
        if shape.get("arch") == "phi3":  # q/k/v and gate/up fused, as Phi-3's own layers hold them
            out += [(f"blk.{i}.attn_norm.weight", (h,), "F32"),
                    (f"blk.{i}.attn_qkv.weight", (h + 2 * kv, h), kind("attn_qkv", i)),
                    (f"blk.{i}.attn_output.weight", (h, h), kind("attn_output", i)),
                    (f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                    (f"blk.{i}.ffn_up.weight", (2 * inter, h), kind("ffn_up", i)),
                    (f"blk.{i}.ffn_down.weight", (h, inter), kind("ffn_down", i))]
            continue
        out += [(f"blk.{i}.attn_norm.weight", (h,), "F32"),
                (f"blk.{i}.attn_q.weight", (h, h), kind("attn_q", i)),
                (f"blk.{i}.attn_k.weight", (kv, h), kind("attn_k", i)),
                (f"blk.{i}.attn_v.weight", (kv, h), kind("attn_v", i)),
                (f"blk.{i}.attn_output.weight", (h, h), kind("attn_output", i)),
                (f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                (f"blk.{i}.ffn_gate.weight", (inter, h), kind("ffn_gate", i)),
                (f"blk.{i}.ffn_up.weight", (inter, h), kind("ffn_up", i)),
                (f"blk.{i}.ffn_down.weight", (h, inter), kind("ffn_down", i))]
    out.append(("output_norm.weight", (h,), "F32"))
    if not shape["tied"]:
        out.append(("output.weight", (vocab, h), kind("output")))
    return out


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    """Quantized rows [rows, bytes per row] of random bits, each block's fp16 scales set finite (about
    1/sqrt(columns) in weight, times a random factor in [0.5, 1.5] per block)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, columns = shape
    blocks = rng.integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
    step = (STEP[kind] / np.sqrt(columns) * rng.uniform(0.5, 1.5, size=len(blocks))).astype(np.float32)
    for offset, multiple in FP16_FIELDS[kind]:
        blocks[:, offset:offset + 2] = (step * multiple).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, columns // block * size)


def write_random_gguf(path: Path, shape: str = "tiny", types: str = "Q4_K_M", seed: int = 0,
                      overrides: dict | None = None, tokenizer_gguf: Path | None = None) -> Path:
    """Write the GGUF; returns its path. `overrides`: SHAPES keys set otherwise, e.g. "tied" (no output.weight:
    the LM head is the embedding), "vocab" (0: the tokenizer's own), "layers", "hidden", and "arch": "phi3" for
    Phi-3's layout (fused q/k/v and gate/up: an architecture batchgen runs on its generic path)."""
    path = Path(path)
    _refuse_inside_git(path)
    spec = {**SHAPES[shape], **(overrides or {})}
    tokenizer = tokenizer_fields(tokenizer_gguf or default_gguf(), spec["vocab"])
    vocab = spec["vocab"] or len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    tensors = tensors_of(spec, types, vocab)
    writer = GGUFWriter(path, spec.get("arch", "llama"))
    writer.add_name(f"random {shape} {types}")
    writer.add_context_length(spec["context"])
    writer.add_embedding_length(spec["hidden"])
    writer.add_block_count(spec["layers"])
    writer.add_feed_forward_length(spec["intermediate"])
    writer.add_head_count(spec["heads"])
    writer.add_head_count_kv(spec["kv_heads"])
    writer.add_rope_dimension_count(spec["hidden"] // spec["heads"])
    writer.add_rope_freq_base(spec["rope_theta"])
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(FILE_TYPES[types])
    writer.add_quantization_version(2)
    for key, value, vtype, subtype in tokenizer:
        writer.add_key_value(key, value, vtype, subtype)
    for name, tensor_shape, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, tensor_shape, np.dtype(np.float32), 4 * tensor_shape[0])
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            byte_shape = (tensor_shape[0], tensor_shape[1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, tensor_shape, kind) in enumerate(tensors):
        rng = np.random.default_rng([seed, index])
        data = (1.0 + 0.1 * rng.standard_normal(tensor_shape)).astype(np.float32) if kind == "F32" \
            else random_blocks(rng, tensor_shape, kind)
        writer.write_tensor_data(data)
    writer.close()
    return path


def _refuse_inside_git(path: Path) -> None:
    directory = path.resolve().parent
    directory.mkdir(parents=True, exist_ok=True)
    inside = subprocess.run(["git", "-C", str(directory), "rev-parse", "--is-inside-work-tree"],
                            capture_output=True, text=True)
    if inside.returncode == 0 and inside.stdout.strip() == "true":
        raise SystemExit(f"{path} is inside a git checkout: random weights are never put in git; write it elsewhere")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--types", choices=[*TYPES, "Q4_K_M"], default="Q4_K_M")
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                        help="no output.weight: the LM head is the embedding (default: the shape's)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size (default: the shape's; 0: the tokenizer's own, 49,152)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    start = time.monotonic()
    overrides = {key: value for key, value in (("tied", args.tied), ("vocab", args.vocab)) if value is not None}
    path = write_random_gguf(args.out, args.shape, args.types, args.seed, overrides)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
