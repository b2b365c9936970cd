"""A small tokenizer wrapper over ``tokenizers.Tokenizer`` plus a jinja2 chat template."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


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
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

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
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
