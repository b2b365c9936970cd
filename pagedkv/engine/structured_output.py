"""Structured output: a grammar (JSON schema, regex, choice) enforced as a token mask.

The grammar library is llguidance (bench/structured_output.py compares it with xgrammar and
outlines-core). The pieces:

- :func:`grammar_of` turns a :class:`StructuredOutput` into llguidance's grammar text (cheap,
  unchecked: a grammar is checked when it is compiled).
- :class:`StructuredOutputs` (one per engine) owns the tokenizer info and the
  :class:`~pagedkv.engine.grammar_compiler.GrammarCompiler`: grammars compile in a worker process
  under limits (time, memory, lexer states, size), off the event loop and the engine thread, and
  are cached by their text. The server compiles a request's grammar before adding the request, so
  the engine only copies it (``start``); each sequence gets a copy (:class:`GrammarState`).
- Each step, before sampling, a sequence's state writes its allowed tokens as a bitmask (bit
  ``t % 32`` of word ``t // 32``); the sampler sets the logits of the other tokens to -inf
  (:func:`apply_bitmask`, vectorized over the rows that have one). The sampled token then
  advances the state (``LLMEngine._append``). The state follows the sequence's generated tokens,
  not the steps: a recompute after preemption samples nothing again, so nothing is consumed twice.
- When the grammar is complete, the mask allows EOS (and, once nothing can follow, only EOS), so
  the sequence finishes with "stop". When computing a mask hits one of llguidance's per-step
  limits (lexer states, fuel, Earley items), :meth:`GrammarState.fill_bitmask` raises
  :class:`GrammarLimitError` and the engine ends that sequence with finish_reason "length" (its
  output so far, like a max_tokens cut: it may not match); the others go on.
"""

from __future__ import annotations

import llguidance
import torch

from pagedkv.engine.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarLimitError,
    GrammarLimits,
    TokenizerSetup,
)
from pagedkv.engine.grammar_worker import escape_literal, excerpt, grammar_text, limit_named
from pagedkv.sampling.bitmask import apply_bitmask, unpack_bitmask
from pagedkv.sampling_params import StructuredOutput

__all__ = ["GrammarError", "GrammarLimitError", "GrammarState", "StructuredOutputs", "apply_bitmask",
           "grammar_of", "unpack_bitmask"]


def grammar_of(so: StructuredOutput) -> str:
    """llguidance's grammar text for ``so`` (cheap and unchecked: whether it compiles, and within
    which limits, is the GrammarCompiler's to find out, in its worker). GrammarError for a schema
    that is not a JSON object."""
    try:
        return grammar_text(*so.key)
    except ValueError as exc:
        raise GrammarError(excerpt(exc)) from exc


_escape = escape_literal


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, out: torch.Tensor) -> torch.Tensor:
        """Write the allowed next tokens into ``out`` (int32 ``[words]``, contiguous); returns it.
        GrammarLimitError when computing it hit one of llguidance's per-step limits (the state
        cannot go on: the sequence ends there)."""
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if self._matcher.is_error():
            message = self._reason()
            raise GrammarLimitError(f"structured output stopped at a grammar limit: {message}",
                                    limit_named(message) or "grammar")
        return out

    def accept(self, token: int) -> None:
        """Advance by ``token``. GrammarLimitError when following it hit one of llguidance's
        limits (the token is fine; the state cannot go on); RuntimeError if the grammar does not
        allow it (a masked sampler never picks such a token)."""
        if not self._matcher.consume_token(token):
            message = self._reason()
            limit = limit_named(message)
            if limit is not None:
                raise GrammarLimitError(f"structured output stopped at a grammar limit: {message}", limit)
            raise RuntimeError(f"structured output: token {token} breaks the grammar ({message})")

    def _reason(self) -> str:
        """The matcher's error, short (llguidance's marker of a withheld detail dropped)."""
        return excerpt(self._matcher.get_error().replace("<non-verbose/>", "").strip())

    @property
    def is_complete(self) -> bool:
        """Nothing but EOS can follow."""
        return self._matcher.is_stopped()

    def fork(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy())


class StructuredOutputs:
    """Per engine: the tokenizer info (built on first use) and the grammar compiler."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_token_ids, *, limits: GrammarLimits) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        backend = getattr(tokenizer, "backend", None)
        self.vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True) if backend else 0)
        self.compiler = GrammarCompiler(self._tokenizer_setup, limits)

    @property
    def num_words(self) -> int:
        """int32 words of a bitmask over the vocabulary."""
        return (self.vocab_size + 31) // 32

    def _tokenizer_setup(self) -> TokenizerSetup:
        backend = getattr(self._tokenizer, "backend", None)
        if backend is None or not self._eos:
            raise GrammarError("structured output needs the model's tokenizer (tokenizers-based) with an EOS token")
        text = backend.to_str()
        return TokenizerSetup(llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos),
                              text, self.vocab_size, self._eos)

    def prepare(self) -> None:
        """Build the tokenizer info now rather than at the first grammar (see GrammarCompiler.prepare)."""
        self.compiler.prepare()

    def submit(self, so: StructuredOutput):
        """A future of ``so``'s compiled grammar (any thread; see GrammarCompiler.submit)."""
        return self.compiler.submit(so)

    def start(self, so: StructuredOutput) -> GrammarState:
        """A new state at the start of ``so``'s grammar; GrammarError if it does not compile
        within the limits. The grammar is copied when a handler compiled it (``submit``) and
        still holds it, or it is cached; else it compiles here, waiting (the offline path)."""
        compiled: CompiledGrammar | None = self.compiler.lookup(self.compiler.digest_of(so))
        if compiled is None:
            compiled = self.compiler.compile(so)
        return GrammarState(compiled.matcher.deep_copy())

    def close(self) -> None:
        self.compiler.close()

    def new_bitmask(self) -> torch.Tensor:
        return torch.empty(self.num_words, dtype=torch.int32)
