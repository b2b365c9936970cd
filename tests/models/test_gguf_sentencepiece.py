"""SentencePiece GGUF tokenizers (``tokenizer.ggml.model == "llama"``): a tiny GGUF written with
gguf.GGUFWriter must tokenize and decode exactly like transformers' own GGUF tokenizer for the same
file, byte fallback included; unknown tokenizer kinds must fail loudly, naming what they met."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.models import load_model
from pagedkv.models.errors import UnsupportedModelError
from pagedkv.models.gguf_tokenizer import build_gguf_tokenizer
from pagedkv.models.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SP = "\u2581"  # SentencePiece's "▁"
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_BYTE = 1, 2, 3, 4, 6
CONTROL = ["<|end|>", "<|user|>"]
USER_DEFINED = ["<tool>"]
CORPUS = """
The quick brown fox jumps over the lazy dog. A language model reads text as tokens, and the tokenizer
decides where one token ends and the next begins. Paged attention stores the key and value cache in
fixed size blocks, so that many requests can share the memory of the device without waste. When the
scheduler runs out of blocks it preempts a request and recomputes it later. Numbers like 1024, 2048
and 3.14159 appear in configuration files; code such as def forward(self, x): return x + 1 appears
in the repository. The engine should never change the meaning of the prompt: what goes in must come
out again when the tokens are decoded. Tokenization of the English language is the main thing here,
with the the the repeated words and their their there they're often confused by people who write
quickly. Import numpy as np; print("hello world"); for i in range(10): total += i * 2.
"""
UNICODE_PIECES = ["é", "ï", "ñ", "ü", "ß", "中", "文", "日", "本", "語", f"{SP}na", f"{SP}naï", "ve",
                  f"{SP}naïve", "caf", f"{SP}caf", f"{SP}café", "中文", "日本", f"{SP}中", f"{SP}日本", "über"]
WHITESPACE_PIECES = [f"{SP}{SP}", f"{SP}{SP}{SP}{SP}", f"{SP}{SP}{SP}{SP}{SP}{SP}{SP}{SP}"]
# Equal scores, so only the tie-break orders these merges. After "αβ": "αβγ" (longer left part) must win
# over "γδ", which comes first in the vocabulary; after "μν": "λμν" (longer right part) over "κλ".
TIE_FIRST = [("αβ", -0.5), ("μν", -0.5)]
TIED = ["γδ", "αβγ", "κλ", "λμν"]
GEMMA_CONTROL = ["<start_of_turn>", "<end_of_turn>"]
# whitespace runs are added tokens in Gemma's tokenizer_config.json: llama.cpp writes them with real spaces
GEMMA_USER_DEFINED = ["<start_of_image>", "\n\n", "\n\n\n", "\t\t", "  ", "   ", "    "]


def _trained_pieces(corpus: str, n_merges: int) -> list[str]:
    """Pieces of a tiny BPE training run on ``corpus`` (spaces spelled "▁" in front of each word),
    best first: real SentencePiece vocabularies are built this way, so their merges chain."""
    words = Counter(SP + w for w in corpus.split())
    split = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            for pair in zip(split[w], split[w][1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
        if a + b not in pieces:
            pieces.append(a + b)
    return pieces


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """``<unk> <s> </s>``, 256 byte pieces, then scored pieces; some scores tie on purpose, since
    tie-breaking is where rebuilt merges most easily disagree."""
    entries = [("<unk>", 0.0, TYPE_UNKNOWN), ("<s>", 0.0, TYPE_CONTROL), ("</s>", 0.0, TYPE_CONTROL)]
    entries += [(f"<0x{b:02X}>", 0.0, TYPE_BYTE) for b in range(256)]
    entries += [(t, 0.0, TYPE_CONTROL) for t in CONTROL] + [(t, 0.0, TYPE_USER_DEFINED) for t in USER_DEFINED]
    chars = sorted(set(CORPUS.replace(" ", SP).replace("\n", "")) | set("abcdefghijklmnopqrstuvwxyz0123456789")
                   | set("éïñüß中文日本語αβγδκλμν") | {SP})
    scored = [(p, -float(i)) for i, p in enumerate(_trained_pieces(CORPUS, 300))]
    scored += [(p, -40.0) for p in UNICODE_PIECES + WHITESPACE_PIECES]  # all tied
    scored += TIE_FIRST + [(p, -60.5) for p in TIED]
    scored += [(c, -1000.0 - i) for i, c in enumerate(chars)]
    seen = {t for t, _, _ in entries}
    for piece, score in scored:
        if piece not in seen:
            seen.add(piece)
            entries.append((piece, score, TYPE_NORMAL))
    tokens, scores, types = (list(column) for column in zip(*entries))
    return tokens, scores, types


def _gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma 3's layout: ``<pad> <eos> <bos> <unk>``, control and user-defined tokens, 256 byte pieces,
    then pieces whose scores are shuffled: transformers ranks Gemma's merges by the file order alone."""
    entries = [("<pad>", 0.0, TYPE_CONTROL), ("<eos>", 0.0, TYPE_CONTROL), ("<bos>", 0.0, TYPE_CONTROL),
               ("<unk>", 0.0, TYPE_UNKNOWN)]
    entries += [(t, 0.0, TYPE_CONTROL) for t in GEMMA_CONTROL]
    entries += [(t, 0.0, TYPE_USER_DEFINED) for t in GEMMA_USER_DEFINED]
    entries += [(f"<0x{b:02X}>", 0.0, TYPE_BYTE) for b in range(256)]
    chars = sorted(set(CORPUS.replace(" ", SP)) | set("abcdefghijklmnopqrstuvwxyz0123456789")
                   | set("éïñüß中文日本語αβγδκλμν") | {SP})
    pieces = _trained_pieces(CORPUS, 300) + UNICODE_PIECES + [p for p, _ in TIE_FIRST] + TIED + chars
    rng = random.Random(5)
    scores = [-float(i) for i in range(len(pieces))]
    rng.shuffle(scores)
    seen = {t for t, _, _ in entries}
    for piece, score in zip(pieces, scores):
        if piece not in seen:
            seen.add(piece)
            entries.append((piece, score, TYPE_NORMAL))
    tokens, scores, types = (list(column) for column in zip(*entries))
    return tokens, scores, types


def _write_gguf(path: Path, arch: str = "llama", *, model: str = "llama", pre: str | None = "default",
                add_bos: bool | None = None, add_eos: bool | None = None,
                add_space_prefix: bool | None = None) -> list[str]:
    """A one-layer ``arch`` model (random weights) with the SentencePiece vocabulary (Gemma's for
    gemma3); returns the tokens."""
    gemma = arch == "gemma3"
    tokens, scores, types = _gemma_vocab() if gemma else _vocab()
    hidden, ff, heads = 16, 32, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if gemma:
        w.add_pad_token_id(0)
    w.add_unk_token_id(3 if gemma else 0)
    w.add_bos_token_id(2 if gemma else 1)
    w.add_eos_token_id(1 if gemma else 2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    rng = np.random.default_rng(0)
    layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                                         "attn_output.weight": (hidden, hidden), "ffn_down.weight": (hidden, ff)}
    if arch == "phi3":
        layer |= {"attn_qkv.weight": (3 * hidden, hidden), "ffn_up.weight": (2 * ff, hidden)}
    else:
        layer |= {f"attn_{p}.weight": (hidden, hidden) for p in "qkv"}
        layer |= {"ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden)}
    if gemma:
        layer |= {"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,),
                  "attn_q_norm.weight": (hidden // heads,), "attn_k_norm.weight": (hidden // heads,)}
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              **{f"blk.0.{k}": v for k, v in layer.items()}}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _texts() -> list[str]:
    """Hand-picked edge cases plus seeded random mixes of words, unicode, whitespace, code and specials."""
    fixed = [
        "", " ", "  ", "   ", "\n", "\n\n", "\t", " \t \n ", "a", "A", "the", " the", "the ", "  the  ",
        "The quick brown fox", "the the the", "Hello World", "HELLO WORLD", "hello\nworld", "hello\tworld",
        "hello  world", "hello   world   ", "   leading", "trailing   ", "\nnewline first", "last newline\n",
        "1024", "3.14159", "0", "1234567890", "2048 blocks of 16 tokens", "x = 1 + 2 * 3",
        "def forward(self, x):\n    return x + 1\n", "import numpy as np; print(\"hello world\")",
        "for i in range(10):\n\ttotal += i * 2", "{\"key\": [1, 2, 3]}", "a\\b/c|d", "~!@#$%^&*()_+`-=[]{};':,.<>?",
        "naïve café", " naïve", "naïve", "Café über straße", "中文", "日本語", " 中文", "中文 and 日本語 text",
        "emoji 😀", "😀", "🎉👍🏽", "mixed 😀 中文 naïve 42\n", "Ωμέγα", "résumé", "ñandú", "ẞ",
        "<s>", "</s>", "<unk>", "<|end|>", "<tool>", "<s>hello", "hello</s>", "hi<|end|>there",
        " <|user|> hi", "<|user|>\nhi<|end|>\n", "a<tool>b", "<tool> b", "<s> </s>", "<<s>>", "<|end", "<0x0A>",
        "\u2581", "\u2581\u2581hello", "hello\u2581world", "\r\n", "line one\r\nline two", "\u00a0nbsp",
        "zero\u200bwidth", "tab\t\tend", "    four spaces", "        eight spaces", "αβγδ", "κλμν", "αβγ δ",
    ]
    fragments = [
        "the", "quick", "tokens", "memory", "scheduler", "language", "model", "Paged", "attention", "English",
        "naïve", "café", "über", "中文", "日本", "語", "😀", "🎉", "Ω", "ß", "é", "αβγδ", "κλμν",
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n",
        "0", "42", "3.14159", "2024", "1,000", "-7",
        "def f(x):", "return x", "{", "}", "[1, 2]", "()", "==", "->", "#", "//", ";", ".", ",", "!", "?", "'", "\"",
        "<s>", "</s>", "<unk>", "<|end|>", "<|user|>", "<tool>",
    ]
    rng = random.Random(1234)
    mixed = []
    for _ in range(260):
        parts = rng.choices(fragments, k=rng.randint(1, 12))
        mixed.append("".join(p + rng.choice(["", "", " ", "  "]) for p in parts))
    return fixed + mixed


def _hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer for the GGUF: the reference."""
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _load(path: Path) -> Tokenizer:
    tok = load_model(str(path)).tokenizer
    assert tok is not None
    return tok


def _mismatches(ours: Tokenizer, hf: Any, texts: list[str]) -> list[str]:
    """Every way ``ours`` disagrees with transformers on ``texts`` (ids with and without special tokens,
    and decoding with and without special tokens), one line each."""
    bad = []
    for text in texts:
        for add in (True, False):
            want = hf(text, add_special_tokens=add)["input_ids"]
            got = ours.encode(text, add_special_tokens=add)
            if got != want:
                bad.append(f"encode({text!r}, add_special_tokens={add}): {got} != {want}")
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            want_text = hf.decode(ids, skip_special_tokens=skip)
            got_text = ours.decode(ids, skip_special_tokens=skip)
            if got_text != want_text:
                bad.append(f"decode({ids}, skip_special_tokens={skip}): {got_text!r} != {want_text!r}")
    return bad


# add_space_prefix=False: transformers ignores the flag and still puts "▁" in front; so do we, to match it.
@pytest.mark.parametrize("arch,flags", [("llama", {}), ("llama", {"add_bos": False, "add_eos": True}),
                                        ("llama", {"add_bos": True, "add_eos": False}),
                                        ("llama", {"add_space_prefix": False}), ("phi3", {})])
def test_ids_and_decode_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                           flags: dict[str, bool]) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"sp-{arch}.gguf"
    _write_gguf(path, arch, **flags)
    ours, hf = _load(path), _hf_tokenizer(path)
    texts = _texts()
    assert len(texts) > 300
    bad = _mismatches(ours, hf, texts)
    assert not bad, f"{len(bad)} mismatches, first ones:\n" + "\n".join(bad[:20])
    # the flags did what they say, on both sides (an absent add_bos_token means BOS for SentencePiece)
    ids = ours.encode("the model")
    assert (ids[0] == 1) == (flags.get("add_bos") is not False)
    assert (ids[-1] == 2) == flags.get("add_eos", False)


def _gemma_texts() -> list[str]:
    """The shared texts plus chat turns, Gemma's specials and whitespace runs, alone and mixed."""
    fixed = ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>hello", "hello<eos>", "<pad><unk>",
             "a  b   c    d     e", "x\n\n\ny\t\tz", " <start_of_image> ", "<start_of_turn", "  the", "the  "]
    fragments = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "user\n", "model\n",
                 "the", "naïve", "中文", "  ", "    ", "\n\n", "\t\t", "\t", "42", "def f(x):", "😀"]
    rng = random.Random(99)
    mixed = ["".join(rng.choices(fragments, k=rng.randint(1, 10))) for _ in range(60)]
    return _texts() + fixed + mixed


@pytest.mark.parametrize("flags", [{}, {"add_bos": False, "add_eos": True}])
def test_gemma3_ids_and_decode_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  flags: dict[str, bool]) -> None:
    """A Gemma 3 SentencePiece GGUF (add_space_prefix false, as llama.cpp writes it) tokenizes like
    transformers' GemmaTokenizer for it: no "▁" put in front, whitespace runs stored with real spaces
    respelled, merges ranked by the file order (ranked by the shuffled scores, dozens of these texts
    get other ids), control and user-defined tokens matched whole."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "sp-gemma3.gguf"
    tokens = _write_gguf(path, "gemma3", add_space_prefix=False, **flags)
    ours, hf = _load(path), _hf_tokenizer(path)
    texts = _gemma_texts()
    assert len(texts) > 350
    bad = _mismatches(ours, hf, texts)
    assert not bad, f"{len(bad)} mismatches, first ones:\n" + "\n".join(bad[:20])
    assert (ours.bos_token_id, ours.eos_token_ids) == (2, {1})
    ids = ours.encode("a  b<start_of_turn>x\n\n\n", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["a", "  ", "b", "<start_of_turn>", "x", "\n\n\n"]
    ids = ours.encode("the model")
    assert (ids[0] == 2) == (flags.get("add_bos") is not False) and (ids[-1] == 1) == flags.get("add_eos", False)
    assert ours.decode(ours.encode(" naïve  café\n")) == " naïve  café\n"  # nothing added in front, nothing lost


def test_byte_fallback_and_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "sp.gguf"
    tokens = _write_gguf(path)
    tok = _load(path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    pieces = [tokens[i] for i in tok.encode("😀\n\tthe", add_special_tokens=False)]
    # not in the vocabulary, so spelled as bytes: the emoji's UTF-8, newline and tab; "▁" only in front
    assert pieces[:7] == [SP, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x0A>", "<0x09>"]
    assert "".join(pieces[7:]) == "the"
    assert [tokens[i] for i in tok.encode("naïve café", add_special_tokens=False)] == [f"{SP}naïve", f"{SP}café"]
    # Decoding gives the text back, except (as in transformers) where the text itself starts with a space or
    # holds a "▁": the "▁" put in front of the text is only added when it does not start with one already,
    # and decoding always strips one leading space, so there one space is lost / "▁" reads as a space.
    specials = ["<s>", "</s>", "<unk>", "<|end|>", "<|user|>", "<tool>"]
    plain = [t for t in _texts() if not t.startswith(" ") and SP not in t and not any(s in t for s in specials)]
    assert len(plain) > 100
    for text in plain:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(" the")) == "the"


def test_unknown_tokenizer_model_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bert.gguf"
    _write_gguf(path, model="bert")
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        load_model(str(path))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_unknown_pre_tokenizer_is_an_error(model: str) -> None:
    tokens, scores, types = _vocab()
    with pytest.raises(UnsupportedModelError, match="'no-such-pre'"):
        build_gguf_tokenizer(model=model, pre="no-such-pre", tokens=tokens, token_types=types, merges=[],
                             bos_token_id=1, add_bos_token=True, scores=scores)


def test_llama_pre_other_than_default_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte-level pre name on a SentencePiece vocabulary is a mislabelled file, not a variant."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "sp-llama3pre.gguf"
    _write_gguf(path, pre="llama-bpe")
    with pytest.raises(UnsupportedModelError, match="'llama-bpe'"):
        load_model(str(path))


@pytest.mark.parametrize("pre", ["gpt2", "default", "", "smollm", "starcoder", "refact", "codeshell", "command-r",
                                 "exaone", "minerva", "llama-bpe", "llama3", "dbrx", "smaug-bpe", "qwen2",
                                 "deepseek-r1-qwen"])
def test_known_byte_level_pre_names_still_build(pre: str) -> None:
    tokens = ["<|endoftext|>", "h", "i", "hi"]
    tok = build_gguf_tokenizer(model="gpt2", pre=pre, tokens=tokens, token_types=[3, 1, 1, 1], merges=["h i"],
                               bos_token_id=None, add_bos_token=False)
    assert tok.encode("hi<|endoftext|>").ids == [3, 0]


def test_missing_pre_reads_as_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "sp-nopre.gguf"
    tokens = _write_gguf(path, pre=None)
    assert [tokens[i] for i in _load(path).encode("the")] == ["<s>", f"{SP}the"]


def test_tied_scores_prefer_longer_parts() -> None:
    tokens, scores, types = _vocab()
    tok = build_gguf_tokenizer(model="llama", pre="default", tokens=tokens, token_types=types, merges=None,
                               bos_token_id=1, add_bos_token=False, scores=scores)
    assert tok.encode("αβγδ").tokens == [SP, "αβγ", "δ"]
    assert tok.encode("κλμν").tokens == [SP, "κ", "λμν"]


def test_gemma_sentencepiece_is_refused() -> None:
    """Only Gemma 3's SentencePiece GGUFs are rebuilt the way transformers rebuilds Gemma's."""
    tokens, scores, types = _vocab()
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        build_gguf_tokenizer(model="llama", pre="default", tokens=tokens, token_types=types, merges=None,
                             bos_token_id=1, add_bos_token=True, architecture="gemma2", scores=scores)
