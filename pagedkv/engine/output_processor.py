"""After sampling: stop conditions, detokenization and the RequestOutputs users see."""

from __future__ import annotations

from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids: frozenset[int] = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())

    def check_stop(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Set ``seq.finish_reason`` if ``token`` (just appended) ends the sequence.

        Order: EOS (unless ignore_eos), a stop token id, a stop string (the text is cut before
        it unless include_stop_str_in_output), then the length limits. ``min_tokens`` delays
        every stop but the length limits.
        """
        p = group.params
        n_out = seq.num_output_tokens
        if n_out > p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if p.stop and self.tokenizer is not None:
                self._check_stop_strings(seq, p.stop, p.include_stop_str_in_output, p.skip_special_tokens)
                if seq.finish_reason:
                    return
        if n_out >= group.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _check_stop_strings(self, seq: Sequence, stops: tuple[str, ...], keep: bool, skip_special: bool) -> None:
        old_len = len(seq.output_text)
        text = self.decode(seq, skip_special)
        start = max(0, old_len - max(len(s) for s in stops))
        best = None
        for s in stops:
            idx = text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            seq.output_text = text[:idx + len(s)] if keep else text[:idx]
            seq.finish_reason, seq.stop_reason = "stop", s
            seq.prefix_offset = seq.read_offset = seq.num_output_tokens  # the cut text is final

    def decode(self, seq: Sequence, skip_special_tokens: bool = True) -> str:
        """The sequence's output text, extended by the tokens added since the last call
        (incrementally, as vLLM does: each step decodes a few tokens, not the whole output).

        The tokens from ``prefix_offset`` are decoded twice, up to ``read_offset`` and to the
        end; what the second has beyond the first is the new text. While it ends in an incomplete
        UTF-8 character (U+FFFD) it waits for the next token, unless the sequence has finished.
        The text equals a decode of all the output tokens at once (a test checks it)."""
        n = seq.num_output_tokens
        pending = seq.finish_reason is not None and seq.read_offset < n  # held back: flush it now
        if (seq.text_tokens == n and not pending) or self.tokenizer is None:
            return seq.output_text
        ids = seq.output_token_ids
        decode = self.tokenizer.decode
        prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
        full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
        if len(full) > len(prefix) and (not full.endswith("\ufffd") or seq.finish_reason is not None):
            seq.output_text += full[len(prefix):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, n
        seq.text_tokens = n
        return seq.output_text

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        if group.beam_width:
            seqs = sorted(group.finished_seqs, key=lambda s: -beam_score(s, group))
            seqs = seqs[:group.beam_width] if group.is_finished else group.live_seqs
        else:
            seqs = sorted(group.seqs, key=lambda s: s.index)
        outs = []
        for k, seq in enumerate(seqs):
            # A stop string already cut the text (not redone); a failed request is not decoded
            # again, as decoding may be what failed.
            text = seq.output_text if group.error else self.decode(seq, group.params.skip_special_tokens)
            if seq.finish_reason is None and text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for the rest
            outs.append(CompletionOutput(
                index=k if group.beam_width else seq.index, text=text,
                token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if seq.logprobs else None,
                cumulative_logprob=seq.cumulative_logprob if (seq.logprobs is not None or
                                                              group.beam_width) else None))
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids), outputs=outs,
            finished=group.is_finished, num_cached_tokens=max(group.num_cached_tokens, 0),
            cache_details=group.cache_details,
            metrics=dict(group.metrics), error=group.error,
            # Shared, not copied each step: an output is only made once the prompt is computed
            # (or the request failed), and the list never changes after that.
            prompt_logprobs=group.prompt_logprobs)


def beam_score(seq: Sequence, group: SequenceGroup) -> float:
    """Length-penalised score: cumulative log-probability / (generated tokens ** penalty)."""
    return seq.cumulative_logprob / max(seq.num_output_tokens, 1) ** group.length_penalty
