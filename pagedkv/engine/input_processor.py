"""From a user's prompt and parameters to a request the engine can take, or a clear refusal.

Tokenization and every check that needs no engine state live here, so that the server can run
them in a worker thread (a long prompt never holds up the engine thread), and so that the engine's
``add_request`` only queues what can be served.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.engine.errors import RequestRejectedError, RequestTooLongError
from pagedkv.memory import KVCacheManager
from pagedkv.sampling_params import SamplingParams


class TokenizedPrompt(NamedTuple):
    """A prompt already through :meth:`InputProcessor.tokenize`: its text (None for token ids) and ids."""

    text: str | None
    token_ids: list[int]


PromptInput = str | list[int] | TokenizedPrompt


class InputProcessor:
    """Checks prompts against ``max_model_len``, the vocabulary and the KV pool's size."""

    def __init__(self, tokenizer, max_model_len: int, kv: KVCacheManager, vocab_size: int | None,
                 chunk: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kv = kv  # read only: block size and pool size
        self.vocab_size = vocab_size
        self.chunk = chunk  # the most tokens one step computes (a sliding window's blocks hold that much more)

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Tokenize and check a prompt without touching the engine's state, so any thread may call
        it (the server does, off the engine thread). Raises RequestRejectedError (bad token ids,
        an empty prompt, text the tokenizer cannot take) or RequestTooLongError (at least
        ``max_model_len`` tokens).

        A text prompt so long that it must have ``max_model_len`` tokens or more (each token
        stands for at most ``tokenizer.max_chars_per_token`` characters) is refused before any of
        it is tokenized, so a huge prompt costs no memory; the rule never refuses a prompt that
        fits. Token-id prompts are measured before their ids are checked.
        """
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        L = self.max_model_len
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejectedError("this engine has no tokenizer: give token ids")
            per_token = getattr(self.tokenizer, "max_chars_per_token", None)
            if per_token and len(prompt) > L * per_token:
                raise RequestTooLongError(
                    f"the prompt has {len(prompt)} characters, so more than {L} tokens (one token stands "
                    f"for at most {per_token} characters), but max_model_len is {L}: shorten it")
            try:
                ids = self.tokenizer.encode(prompt)
            except Exception as exc:  # e.g. a lone surrogate the tokenizer refuses
                raise RequestRejectedError(f"the prompt cannot be tokenized: {exc}") from exc
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
            if len(ids) < L:
                vocab = self.vocab_size
                for t in ids:
                    if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab):
                        raise RequestRejectedError(f"prompt token id {t!r} is not in the vocabulary "
                                                   f"(0..{(vocab or 0) - 1})")
        if not ids:
            raise RequestRejectedError("the prompt is empty")
        if len(ids) >= L:
            raise RequestTooLongError(
                f"the prompt has {len(ids)} tokens but max_model_len is {L}: use at most "
                f"{L - 1} prompt tokens so that at least one token can be generated")
        return TokenizedPrompt(text, ids)

    def check_logit_bias(self, params: SamplingParams) -> None:
        """RequestRejectedError (``param`` "logit_bias") if ``params.logit_bias`` names a token id
        outside the vocabulary (when the vocabulary size is known)."""
        vocab = self.vocab_size
        if vocab and params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise RequestRejectedError(f"logit_bias names token id {bad[0]}, which is not in the vocabulary "
                                           f"(0..{vocab - 1})", param="logit_bias")

    def max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """New tokens a request may generate: ``max_tokens``, or the rest of the context."""
        room = max(self.max_model_len - num_prompt_tokens, 0)
        return min(params.max_tokens or room, room)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams, width: int) -> int:
        """The request's resolved limit on new tokens; RequestTooLongError if it cannot fit the
        context or the KV pool (``width`` sequences: ``n`` samples or beams)."""
        L, n = self.max_model_len, num_prompt_tokens
        if params.max_tokens is not None and n + params.max_tokens > L:
            raise RequestTooLongError(
                f"this model's maximum context length is {L} tokens; the request asks for "
                f"{n + params.max_tokens} ({n} in the prompt, {params.max_tokens} "
                f"max_tokens): lower max_tokens to at most {L - n}")
        max_tokens = self.max_new_tokens(n, params)
        kv = self.kv
        # Forks share the prompt's blocks; each needs its own blocks for its output (plus one
        # copy-on-write of the prompt's partial last block).
        # (a sliding window's group holds its window plus one step's chunk: at most the whole
        # sequence, recomputed at once after a preemption)
        chunk = min(self.chunk or n + max_tokens, n + max_tokens)
        needed = (kv.blocks_for(n + max_tokens, chunk) if width == 1 else
                  kv.blocks_for(n, chunk) + width * (kv.blocks_for(max_tokens, chunk) + kv.num_groups))
        if needed > kv.num_blocks:
            raise RequestTooLongError(
                f"the request needs about {needed} KV blocks ({n} prompt tokens, "
                f"{max_tokens} new tokens x {width} sequences, block_size {kv.block_size}) but "
                f"the pool has {kv.num_blocks}: shorten it or give the engine more kv_cache_memory")
        return max_tokens
