"""Build a ``tokenizers.Tokenizer`` from GGUF metadata (``tokenizer.ggml.model == "gpt2"`` BPE).

The pre-tokenizer follows llama.cpp's ``tokenizer.ggml.pre`` names so ids match what Hugging Face's
tokenizer.json of the same model produces (e.g. "smollm": one digit per token, then GPT-2 byte-level).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pagedkv.models.errors import UnsupportedModelError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names that split digits one by one before GPT-2's byte-level regex.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level_plain]
        )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level_plain]
        )
    if pre not in ("gpt2", "default", ""):
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown; using GPT-2 byte-level splitting", stacklevel=3)
    return byte_level_regex


def build_gguf_tokenizer(
    *,
    model: str,
    pre: str,
    tokens: Sequence[str],
    token_types: Sequence[int] | None,
    merges: Sequence[str],
    bos_token_id: int | None,
    add_bos_token: bool,
) -> HFTokenizer:
    """A byte-level BPE tokenizer equal to the GGUF vocabulary; control tokens become special."""
    if model != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    ignore_merges = pre in ("llama-bpe", "llama3")
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))  # type: ignore[arg-type]
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    added = [
        AddedToken(tokens[i], special=(t == TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    specials = [a for a in added if a.special]
    if specials:
        tok.add_special_tokens(specials)
    plain = [a for a in added if not a.special]
    if plain:
        tok.add_tokens(plain)
    if add_bos_token and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok
