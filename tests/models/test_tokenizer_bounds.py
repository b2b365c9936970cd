"""``Tokenizer.max_chars_per_token``: the bound that lets the server refuse a huge prompt before
tokenizing it must never refuse a prompt that fits.

Property, over random Unicode text (combining marks, Hangul jamo, runs of spaces included) and
tokenizers of every pipeline we load (byte-level BPE, byte-level BPE behind NFC as in Qwen2,
SentencePiece-style BPE with byte fallback as in Llama 2): ``len(text) <= tokens * bound``.
Pipelines that may drop text (whitespace splitting, Strip, WordPiece) have no bound (None).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from pagedkv.models.tokenizer import Tokenizer, max_chars_per_token

CORPUS = ["the quick brown fox jumps over the lazy dog", "    indented code\n\tand tabs",
          "déjà vu, naïve café", "한국어 텍스트", "emoji 😀 and more", "aaaaaaaaaaaaaaaaaaaaaaaaaaaa"]


def byte_level(normalizer=None) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>"],
        show_progress=False))
    return tok


def sentencepiece_like() -> HFTokenizer:
    """Llama 2's pipeline: Prepend + Replace(" ", "▁"), no pre-tokenizer, BPE with byte fallback."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                             show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return HFTokenizer.from_str(json.dumps(spec))


PIPELINES = {
    "byte-level": byte_level,
    "byte-level+nfc": lambda: byte_level(normalizers.NFC()),
    "byte-level+nfkc": lambda: byte_level(normalizers.NFKC()),
    "sentencepiece-byte-fallback": sentencepiece_like,
}

texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
    st.lists(st.sampled_from(["e\u0301", "\u1100\u1161\u11a8", " " * 37, "\u1f82", "ᾂ", "\u0345", "ﬁ",
                              "<s>", "😀", "aaaa", "\t\n"]), max_size=80).map("".join),
)


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def tokenizer(request) -> HFTokenizer:
    return PIPELINES[request.param]()


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_a_token_never_stands_for_more_characters_than_the_bound(tokenizer: HFTokenizer, text: str) -> None:
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(text) <= len(ids) * bound, (text, ids, bound)


def test_pipelines_that_drop_text_have_no_bound() -> None:
    tok = byte_level()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert max_chars_per_token(tok) is None
    tok = byte_level(normalizers.Strip())
    assert max_chars_per_token(tok) is None
    tok = byte_level(normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "")]))
    assert max_chars_per_token(tok) is None
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(wordpiece) is None
    no_unk = HFTokenizer(models.BPE({"a": 0}, []))  # unknown characters vanish
    assert max_chars_per_token(no_unk) is None
    # And the wrapper caches whatever it found.
    wrapped = Tokenizer(tok, bos_token_id=None, eos_token_ids=set())
    assert wrapped.max_chars_per_token is None


@pytest.mark.slow
def test_the_default_models_tokenizer_has_a_sound_bound() -> None:
    from pagedkv.models import load_model

    tok = load_model(None).tokenizer
    bound = tok.max_chars_per_token
    assert bound is not None and bound < 1000
    for text in ["hello world", " " * 5000, "=" * 3000, "\n" * 999, "de\u0301ja\u0300 " * 300, "😀" * 100]:
        assert len(text) <= len(tok.encode(text, add_special_tokens=False)) * bound


def test_incremental_detokenization_equals_decoding_everything_at_once() -> None:
    """The output text grown a token at a time (OutputProcessor.decode) is, at every step, a
    prefix of the final text, never ends in half a character, and ends as a decode of all the
    tokens at once: byte-level BPE (the default model) and SentencePiece with byte fallback,
    random token streams including multi-byte characters split across tokens and special tokens."""
    import random

    from pagedkv.engine.output_processor import OutputProcessor
    from pagedkv.engine.sequence import Sequence
    from pagedkv.models import load_model

    tok = load_model(None).tokenizer
    rng = random.Random(3)
    vocab = tok.vocab_size
    texts = ["naïve café — ünïcödé ✓ 日本語 🤖", "def f(x):\n\treturn x**2", "  spaces   and\n\nlines"]
    streams = [tok.encode(t, add_special_tokens=False) for t in texts]
    streams += [[rng.randrange(vocab) for _ in range(60)] for _ in range(20)]
    for skip in (True, False):
        for ids in streams:
            proc = OutputProcessor(tok, 4096)
            seq = Sequence("s", 0, 1, [1])
            seen = []
            for i, t in enumerate(ids):
                seq.token_ids.append(t)
                if i == len(ids) - 1:
                    seq.finish_reason = "length"
                seen.append(proc.decode(seq, skip))
            final = tok.decode(ids, skip_special_tokens=skip)
            assert seen[-1] == final, (ids, seen[-1], final)
            for text in seen[:-1]:
                assert final.startswith(text) and not text.endswith("\ufffd"), (ids, text)
