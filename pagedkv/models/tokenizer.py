"""A small tokenizer wrapper over ``tokenizers.Tokenizer`` plus a jinja2 chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.errors import PagedKVError


class ChatTemplateError(PagedKVError, ValueError):
    """The model has no chat template, or rendering it failed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for chat templates: plain JSON, keys in their order, no HTML
    escaping (jinja2's own turns ``'`` into ``\\u0027`` and sorts keys), so a tool's schema
    reads as the model saw it in training (and as vLLM renders it)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """encode/decode, special token ids and the chat template of one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = chat_template
        # Only when the tokenizer's own post-processor does not already add BOS.
        self._prepend_bos = add_bos_token and bos_token_id is not None and not self._post_adds_bos()
        self._template: jinja2.Template | None = None
        self._max_chars_per_token: object = _UNSET

    @property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the prompt characters one token can stand for, or None when this
        tokenizer's pipeline may drop text (then no such bound exists). A prompt longer than
        ``n * max_chars_per_token`` characters has more than ``n`` tokens, so it can be refused
        before it is tokenized. Computed once."""
        if self._max_chars_per_token is _UNSET:
            self._max_chars_per_token = max_chars_per_token(self._tok)
        return self._max_chars_per_token  # type: ignore[return-value]  # _UNSET was replaced just above

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        ids = sorted(self.eos_token_ids)
        return self._tok.id_to_token(ids[0]) if ids else None

    def _post_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS rule applies."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]  # _prepend_bos: there is a BOS id
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` (jinja2) instead of the model's chat template."""
        self.chat_template = template
        self._template = None

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt tokens of a conversation: the chat template's text, tokenized WITHOUT the
        tokenizer's own special tokens (the template writes its BOS itself; a Llama 3 style
        post-processor would add a second one), as transformers' ``apply_chat_template`` does.
        The one path for ``LLM.chat`` and the server. ``continue_final_message``: the text ends
        with the last message's content, open for the model to continue (no end-of-turn after
        it, no generation prompt). ``chat_template_kwargs``: extra template variables."""
        return self.encode(self.render_chat(messages, add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template_kwargs=chat_template_kwargs), add_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template's text for ``encode_chat``."""
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
            if not messages:
                raise ChatTemplateError("continue_final_message needs a final message to continue")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(chat_template_kwargs or {})
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        text = self.apply_chat_template(messages, add_generation_prompt, **(chat_template_kwargs or {}))
        if continue_final_message:  # cut after the final message's content, as transformers does
            final = str(messages[-1].get("content") or "").strip()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise ChatTemplateError("continue_final_message: the final message's content is not "
                                        "in the rendered template")
            text = text[:end + len(final)]
        return text

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content"}]) with the model's jinja2 chat template."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


_UNSET = object()

# How many input characters a normalizer may fold into one: the canonical compositions of NFC/NFKC
# join at most 4 code points (a base and up to three marks) into one; the others never shrink text.
# A normalizer that is not listed (Strip, StripAccents, BertNormalizer, Precompiled, ...) may drop
# characters, and then no bound exists.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that split without dropping anything (Whitespace-style ones drop the spaces).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def max_chars_per_token(tokenizer: HFTokenizer) -> int | None:
    """Characters of text one token of ``tokenizer`` stands for, at most; None if unbounded.

    Every character of the text survives into some token when no normalizer or pre-tokenizer
    drops text and the model covers every character (byte-level, byte fallback, or one unknown
    token per unknown character). Then a token covers at most as many characters as its own
    vocabulary string has (byte-level and byte-fallback strings are at least as long as the
    text they encode), times what the normalizer may fold into one character.
    """
    spec = json.loads(tokenizer.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if shrink is None or not _keeps_text(pre):
        return None
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(pre) if pre else False
    if model.get("type") == "BPE":
        covers = byte_level or model.get("byte_fallback") or (model.get("unk_token") and not model.get("fuse_unk"))
    elif model.get("type") == "Unigram":
        covers = bool(model.get("byte_fallback"))
    else:
        covers = False  # WordPiece and WordLevel map a whole unknown word to one token
    if not covers:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * shrink


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type", "")  # typed str: "" (no type) names no normalizer, as None did
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers", []):
            factor = _normalizer_shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regular expression or an empty replacement may drop text
        return max(1, -(-len(pattern["String"]) // len(content)))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation") and str(spec.get("behavior", "")).lower() == "removed":
        return False
    return kind in _KEEPING_PRE_TOKENIZERS
