"""Build a ``tokenizers.Tokenizer`` from GGUF metadata.

A GGUF file carries no tokenizer.json, only llama.cpp's description of the vocabulary. Two kinds are
rebuilt here, each so that its ids equal what ``transformers`` produces for the same file (its
``integrations/gguf`` tokenizer conversion), since that is the reference users compare against:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The pre-tokenizer follows llama.cpp's
  ``tokenizer.ggml.pre`` names so ids match the model's own tokenizer.json (e.g. "smollm": one digit
  per token, then GPT-2 byte-level).
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE with byte fallback (Llama 2, Mistral,
  Phi-3, Gemma 3). The file lists pieces and scores but usually no merges; they are recovered from the
  scores (Gemma 3: from the order of the pieces).

Any other model or pre-tokenizer name is an error: splitting text the wrong way would give ids the
model never saw in training, without any sign that something is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pagedkv.models.errors import UnsupportedModelError

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SENTENCEPIECE_SPACE = "\u2581"  # "▁": how SentencePiece spells a space inside a piece

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
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "dbrx", "smaug-bpe"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_PRE = frozenset({"gpt2", "default", ""})
_BYTE_LEVEL_PRE = _DIGITS_THEN_GPT2 | _LLAMA3_PRE | _QWEN2_PRE | _GPT2_PRE
# llama.cpp ignores ``tokenizer.ggml.pre`` for SentencePiece vocabularies; its converter writes "default".
_SENTENCEPIECE_PRE = frozenset({"default", ""})
# Architectures whose SentencePiece GGUFs transformers rebuilds differently (respelled pieces, merges in
# file order); they are not implemented here, so they must not pass as the plain Llama kind.
_SENTENCEPIECE_UNSUPPORTED_ARCHS = frozenset({"gemma", "gemma2", "gemma4"})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level_plain]
        )
    if pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level_plain]
        )
    if pre in _GPT2_PRE:
        return byte_level_regex
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported for a 'gpt2' vocabulary "
        f"(supported: {', '.join(repr(p) for p in sorted(_BYTE_LEVEL_PRE))})"
    )


def build_gguf_tokenizer(
    *,
    model: str,
    pre: str,
    tokens: Sequence[str],
    token_types: Sequence[int] | None,
    merges: Sequence[str] | None,
    bos_token_id: int | None,
    add_bos_token: bool,
    architecture: str = "llama",
    scores: Sequence[float] | None = None,
    eos_token_id: int | None = None,
    unk_token_id: int | None = None,
    pad_token_id: int | None = None,
    add_eos_token: bool = False,
) -> HFTokenizer:
    """The tokenizer the GGUF metadata describes; raises UnsupportedModelError for unknown kinds.

    ``merges`` is None when the file has no ``tokenizer.ggml.merges`` (the usual SentencePiece case,
    where ``scores`` then rank the merges). ``architecture`` is ``general.architecture``: for a
    SentencePiece vocabulary it decides where the leading "▁" comes from (see :func:`_sentencepiece`).
    ``eos_token_id``, ``unk_token_id``, ``pad_token_id`` and ``add_eos_token`` only matter for
    SentencePiece, which treats the named tokens as special, as transformers does.
    """
    if model == "gpt2":
        return _byte_level_bpe(pre=pre, tokens=tokens, token_types=token_types, merges=merges or [],
                               bos_token_id=bos_token_id, add_bos_token=add_bos_token)
    if model == "llama":
        return _sentencepiece(
            pre=pre, architecture=architecture, tokens=tokens, token_types=token_types, merges=merges,
            scores=scores, special_ids=(unk_token_id, bos_token_id, eos_token_id, pad_token_id),
            bos_token_id=bos_token_id if add_bos_token else None,
            eos_token_id=eos_token_id if add_eos_token else None,
        )
    raise UnsupportedModelError(
        f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported "
        "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
    )


def _byte_level_bpe(*, pre: str, tokens: Sequence[str], token_types: Sequence[int] | None,
                    merges: Sequence[str], bos_token_id: int | None, add_bos_token: bool) -> HFTokenizer:
    """A byte-level BPE tokenizer equal to the GGUF vocabulary; control tokens become special."""
    pre_tokenizer = _pre_tokenizer(pre)  # first, so an unknown name fails before any work
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = cast(list[tuple[str, str]], [tuple(m.split(" ", 1)) for m in merges])  # each merge is "a b"
    ignore_merges = pre in ("llama-bpe", "llama3")
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, token_types)
    if add_bos_token and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _add_marked_tokens(tok: HFTokenizer, tokens: Sequence[str], token_types: Sequence[int] | None,
                       extra_special: Sequence[int] = ()) -> None:
    """Make control tokens (and ``extra_special`` ids) special and user-defined ones plain added tokens.

    llama.cpp matches both kinds whole in the text; as ordinary vocabulary entries they would be cut
    into pieces instead. Special ones are also dropped by ``decode(skip_special_tokens=True)``.
    """
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL} | set(extra_special)
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    if specials:
        tok.add_special_tokens(specials)
    plain = [AddedToken(tokens[i], special=False, normalized=False)
             for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED and i not in special_ids]
    if plain:
        tok.add_tokens(plain)


def _sentencepiece(*, pre: str, architecture: str, tokens: Sequence[str], token_types: Sequence[int] | None,
                   merges: Sequence[str] | None, scores: Sequence[float] | None,
                   special_ids: Sequence[int | None], bos_token_id: int | None,
                   eos_token_id: int | None) -> HFTokenizer:
    """SentencePiece BPE as transformers rebuilds it from a GGUF: spaces spelled "▁", a "▁" before the
    text, characters missing from the vocabulary spelled as ``<0xXX>`` byte pieces.

    ``bos_token_id`` / ``eos_token_id`` are the tokens to add around every encoded text (None: none).

    Where the leading "▁" comes from follows transformers, which picks it by architecture: phi3 adds
    it with a normalizer (so each stretch of text between special tokens gets one, and a text starting
    with a space gets one more), every other architecture with a Metaspace pre-tokenizer that adds it
    only at the very start of the text, and only when the text does not already start with a space.
    ``tokenizer.ggml.add_space_prefix`` is not consulted because transformers does not consult it
    either: honoring it would part from transformers' ids. (It is true for Llama 2, Mistral and Phi-3;
    a file that sets it false gets a "▁" here that llama.cpp would not add.)

    Gemma 3 (add_space_prefix false in its files) follows transformers' ``GemmaTokenizer`` instead: no
    "▁" in front, spaces spelled "▁" by a normalizer, pieces respelled and merges ranked by the order
    of the pieces (:func:`_gemma_pieces`).
    """
    if architecture in _SENTENCEPIECE_UNSUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"GGUF SentencePiece tokenizer of architecture {architecture!r} is not supported"
        )
    if pre not in _SENTENCEPIECE_PRE:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported for a 'llama' "
            "SentencePiece vocabulary (supported: 'default')"
        )
    gemma = architecture == "gemma3"
    if gemma:
        tokens, token_types = _gemma_pieces(tokens, token_types)
        scores = [-float(i) for i in range(len(tokens))]  # Gemma's scores do not follow its merge order
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if merges is not None:
        pairs = cast(list[tuple[str, str]], [tuple(m.split(" ")) for m in merges])  # each merge is "a b"
    elif scores is not None:
        pairs = _merges_from_scores(tokens, scores)
    else:
        raise UnsupportedModelError(
            "GGUF 'llama' tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"
        )
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    elif architecture == "phi3":
        tok.normalizer = normalizers.Sequence([
            normalizers.Prepend(SENTENCEPIECE_SPACE), normalizers.Replace(" ", SENTENCEPIECE_SPACE),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SENTENCEPIECE_SPACE, prepend_scheme="first", split=False
        )
    strip = [] if gemma else [decoders.Strip(content=" ", left=1, right=0)]  # the "▁" added in front of the text
    tok.decoder = decoders.Sequence([
        decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip,
    ])
    _add_marked_tokens(tok, tokens, token_types, [i for i in special_ids if i is not None])
    single, pair, used = "$A:0", "$B:1", []
    if bos_token_id is not None:
        bos = tokens[bos_token_id]
        single, pair = f"{bos}:0 {single}", f"{bos}:1 {pair}"
        used.append((bos, bos_token_id))
    if eos_token_id is not None:
        eos = tokens[eos_token_id]
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        used.append((eos, eos_token_id))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} {pair}",
                                                       special_tokens=used)
    return tok


def _gemma_pieces(tokens: Sequence[str], token_types: Sequence[int] | None) -> tuple[list[str], list[int] | None]:
    """Gemma's pieces as transformers reads them: llama.cpp's converter writes the whitespace runs of
    Gemma's vocabulary (added tokens there) with real spaces, which transformers spells back as one "▁"
    per character of every piece made only of whitespace holding a space, so that merges reach them;
    those respelled pieces are not matched whole in the text (not added tokens), so they become normal."""
    spelled = [SENTENCEPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    if token_types is None:
        return spelled, None
    types = [TOKEN_TYPE_NORMAL if t == TOKEN_TYPE_USER_DEFINED and new != old else t
             for t, new, old in zip(token_types, spelled, tokens)]
    return spelled, types


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges, best first, implied by a SentencePiece vocabulary and its scores.

    SentencePiece BPE repeatedly joins the adjacent pair whose joined piece is in the vocabulary with
    the highest score. ``tokenizers``' BPE wants ranked merges instead, so every way of cutting a piece
    into two vocabulary pieces becomes a merge ranked by the whole piece's score. Ties are broken the
    way transformers breaks them (longer left part, then longer right part, then vocabulary order),
    since a different order can give different ids.
    """
    index = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))  # a repeated piece keeps its last score, as ``index`` its last id
    ranked: list[tuple[float, str, str]] = []
    for piece, score in score_of.items():
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        cuts.sort(key=lambda c: (index[c[0]], index[c[1]]))
        ranked.extend((score, left, right) for left, right in cuts)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep their order
    return [(left, right) for _, left, right in ranked]
