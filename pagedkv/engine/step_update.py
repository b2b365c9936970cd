"""The step's post-processing: from one step's logits to request state and a ``StepResult``.

    logits rows (one per chunk; every position of an all_logits chunk)
      -> prompt logprobs of the chunks that predict prompt tokens
      -> rows kept: each chunk's last, and a speculating chunk's proposal rows
      -> per sampling sequence: forks (n > 1, at the prompt's end), grammar masks, SampleRows
      -> Sampler.prepare (one batched pass) -> per row: sample, append, stop checks
         speculating sequences: SpeculativeDecoder.verify (tokens appended until one finishes)
         beam requests: BeamSearch (candidates, then next beams once every beam is computed)
      -> StepResult (forks, finished, failed, progressed, kept speculative KV) for the scheduler

``StepUpdater`` writes the request state (the ``Sequence``s and ``SequenceGroup``s); the
scheduler and the memory core act on the ``StepResult`` afterwards.

Failures are isolated by :meth:`StepUpdater.isolate`: work on one request that raises fails that
request alone (its error set, ended by the update), the rest of the step goes on; work shared by
several requests (the batched sampling pass, beam candidates) fails those requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from pagedkv.engine.beam_search import BeamSearch
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepResult
from pagedkv.engine.sequence import GroupStatus, Sequence, SequenceGroup
from pagedkv.engine.structured_output import GrammarLimitError, StructuredOutputs
from pagedkv.runner.batch import SeqChunk
from pagedkv.sampling.sampler import (
    SampleBatch,
    Sampled,
    Sampler,
    SampleRow,
    SamplingError,
    logit_bias_vector,
    make_generator,
    token_logprobs,
)

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import Scheduler
    from pagedkv.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)


class Isolated:
    """The context of one piece of request work (:meth:`StepUpdater.isolate`): an ``Exception``
    raised inside fails ``groups`` and is swallowed; ``failed`` tells the caller it happened."""

    __slots__ = ("failed", "groups", "stage", "step", "updater")

    def __init__(self, updater: StepUpdater, groups: Iterable[SequenceGroup], stage: str,
                 step: StepResult | None) -> None:
        self.updater = updater
        self.groups = groups  # read only on failure (may be a lazy iterable)
        self.stage = stage
        self.step = step
        self.failed = False

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False  # KeyboardInterrupt and the like are not a request's failure
        self.failed = True
        self.updater.fail_requests(self.groups, self.stage, exc, self.step)
        return True


class StepUpdater:
    """Turns a step's logits into request state (see the module docstring).

    Collaborators, given at construction: the sampler, the output processor (stop checks, outputs),
    structured outputs (grammar masks), the speculative decoder (None: no speculation), beam
    search, and the scheduler (whose ``abort`` ends a request failed outside a step and whose
    ``groups`` a failed plan's requests are found in).
    """

    def __init__(self, sampler: Sampler, outputs: OutputProcessor, structured: StructuredOutputs,
                 speculative: SpeculativeDecoder | None, beams: BeamSearch, scheduler: Scheduler) -> None:
        self.sampler = sampler
        self.outputs = outputs
        self.structured = structured
        self.speculative = speculative
        self.beams = beams
        self.scheduler = scheduler
        self.generation_tokens = 0  # tokens appended to sequences, over the engine's life

    # ------------------------------------------------------------------ failures
    def isolate(self, groups: Iterable[SequenceGroup], stage: str, step: StepResult | None) -> Isolated:
        """``with updater.isolate(groups, stage, step) as work:`` runs request work; an Exception
        inside fails ``groups`` (once each; ``stage`` names the work in the error and the log)
        in this step's update, or at once when ``step`` is None, and the code after the block goes
        on (``work.failed`` says whether it did)."""
        return Isolated(self, groups, stage, step)

    def fail_requests(self, groups: Iterable[SequenceGroup], stage: str, exc: Exception,
                      step: StepResult | None) -> None:
        """Fail ``groups`` (once each) for one exception, logged once unless a user's input caused it."""
        unique = list({id(g): g for g in groups}.values())
        if isinstance(exc, SamplingError):
            message = str(exc)
        else:
            logger.error("%s failed for %d request(s): %s", stage, len(unique),
                         ", ".join(g.request_id for g in unique), exc_info=exc)
            message = f"{stage} failed for this request: {type(exc).__name__}: {exc}"
        for group in unique:
            self.fail(group, message, step)

    def fail(self, group: SequenceGroup, message: str, step: StepResult | None) -> None:
        """End ``group`` with ``message`` as its error: in this step's update, or at once (its
        blocks freed) when no step is under way."""
        if group.error is not None:
            return
        group.error = message
        if step is None:
            self.scheduler.abort(group.request_id, reason="error")
        else:
            step.failed.append(group)
            step.progressed[group.request_id] = group

    def fail_plan(self, out: SchedulerOutput, exc: Exception, step: StepResult) -> None:
        """The runner failed the plan's shared work: fail every request whose KV it touched.

        A request preempted by recompute in this plan holds no blocks and is left waiting. The
        update then frees the failed requests' blocks and forgets every cached-free block (see
        ``Scheduler.update_from_output``).
        """
        step.computed = False
        groups = self.scheduler.groups
        touched = [g for rid in sorted(out.request_ids)
                   if (g := groups.get(rid)) is not None and g.status is not GroupStatus.WAITING]
        logger.error("a step's forward pass failed (%r); failing its %d request(s)", exc, len(touched),
                     exc_info=exc)
        for group in touched:
            self.fail(group, f"the forward pass of this request's batch failed: {exc!r}", step)

    # ------------------------------------------------------------------ the update
    def update(self, out: SchedulerOutput, chunks: list[SeqChunk], logits: torch.Tensor, step: StepResult) -> None:
        """Everything the step's ``logits`` (one row per chunk, every row of an all_logits chunk)
        give: prompt logprobs, sampled tokens, forks, stop checks, into the requests and ``step``."""
        ends = list(itertools.accumulate(c.num_logits for c in chunks))
        self._record_prompt_logprobs(out, chunks, ends, logits, step)
        # keep only the rows sampled from: each chunk's last, and a speculating chunk's rows of
        # its proposal too (first_row[i]: chunk i's first kept row)
        keep: list[int] = []
        first_row: list[int] = []
        for s, end in zip(out.scheduled, ends):
            first_row.append(len(keep))
            keep.extend(range(end - 1 - len(s.proposal), end))
        if len(keep) != ends[-1]:
            logits = logits.index_select(0, logits.new_tensor(keep).long())
        self._sample(out, logits, first_row, step)

    def _record_prompt_logprobs(self, out: SchedulerOutput, chunks: list[SeqChunk], ends: list[int],
                                logits: torch.Tensor, step: StepResult) -> None:
        """Logprobs of the prompt tokens this step's all_logits chunks predict (row p of a chunk
        predicts token p + 1), each recorded once even when a preemption recomputes it."""
        for s, chunk, end in zip(out.scheduled, chunks, ends):
            window = prompt_logprob_window(s) if chunk.all_logits else None
            group = s.group
            recorded, k = group.prompt_logprobs, group.params.prompt_logprobs
            if window is None or group.error is not None or recorded is None or k is None:
                continue
            first, last = window
            with self.isolate((group,), "prompt logprobs", step):
                row0 = end - chunk.num_logits - s.start  # the logits row of position 0, were it here
                recorded += token_logprobs(logits[row0 + first:row0 + last],
                                           group.prompt_token_ids[first + 1:last + 1], k)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, first_row: list[int], step: StepResult) -> None:
        """Row ``first_row[i]`` of ``logits`` is the next-token row of ``out.scheduled[i]`` (and the
        rows after it those of its proposal's positions, when it speculates)."""
        rows: list[SampleRow] = []
        targets: list[tuple[SequenceGroup, Sequence]] = []
        beam_rows: list[tuple[int, SequenceGroup, Sequence]] = []
        speculating: list[tuple[ScheduledSeq, list[SampleRow]]] = []
        for i, s in enumerate(out.scheduled):
            if not s.samples or s.group.error is not None:
                continue
            group, seq = s.group, s.seq
            if s.proposal:
                # row j is the distribution after the proposal's first j tokens: their context
                # counts for the penalties
                penalized = group.params.uses_penalties
                bias = request_bias(group, logits.shape[-1])
                spec_rows = [SampleRow(first_row[i] + j, group.params, seq.rng,
                                       seq.token_ids + list(s.proposal[:j]) if penalized else seq.token_ids,
                                       seq.prompt_len, bias=bias) for j in range(len(s.proposal) + 1)]
                speculating.append((s, spec_rows))
                continue
            if group.beam_width:
                beam_rows.append((first_row[i], group, seq))
                continue
            seqs = [seq]
            if not group.forked:
                with self.isolate((group,), "forking", step) as work:
                    group.forked = True
                    seqs += [self.fork(group, seq, step) for _ in range(group.params.n - 1)]
                if work.failed:
                    continue
            for q in seqs:  # a grammar's allowed tokens, from its state after q's tokens so far
                bitmask = None
                if q.grammar is not None:
                    with self.isolate((group,), "structured output", step) as work:
                        try:
                            bitmask = q.grammar.fill_bitmask(self.structured.new_bitmask())
                        except GrammarLimitError as exc:  # this sequence ends here, its siblings go on
                            self._stop_at_grammar_limit(group, q, exc, step)
                            continue
                    if work.failed:
                        break
                rows.append(SampleRow(first_row[i], group.params, q.rng, q.token_ids, q.prompt_len, bitmask))
                targets.append((group, q))
        for row, (group, _) in zip(rows, targets):  # the request's bias vector, built once
            row.bias = request_bias(group, logits.shape[-1])
        if rows or speculating:
            sampled_groups = itertools.chain((g for g, _ in targets), (s.group for s, _ in speculating))
            with self.isolate(sampled_groups, "sampling", step) as work:  # shared work: all of them
                batch = self.sampler.prepare(logits, rows + [r for _, spec_rows in speculating for r in spec_rows])
            if work.failed:
                targets, speculating = [], []
            for s, spec_rows in speculating:
                self._verify(s, batch, spec_rows, step)
            if targets:
                self._append_sampled(targets, rows, batch, step)
        if beam_rows:
            self._beam_step(out, logits, beam_rows, step)

    def _append_sampled(self, targets: list[tuple[SequenceGroup, Sequence]], rows: list[SampleRow],
                        batch: SampleBatch, step: StepResult) -> None:
        """Each row's token sampled and appended (stop checks, detokenization), a failure failing
        that row's request alone. One isolation context covers a run of rows, not one per row (the
        hot loop): after a failure the loop resumes at the next row in a new context."""
        current = [targets[0][0]]  # the request of the row being appended: what a failure fails
        pending = iter(zip(targets, rows))
        while True:
            with self.isolate(current, "sampling", step) as work:
                for (group, seq), row in pending:
                    if group.error is not None:
                        continue  # a sibling failed it earlier in this step
                    current[0] = group
                    self.append(group, seq, batch.sample(row), step)
                    step.progressed[group.request_id] = group
            if not work.failed:
                return

    def _verify(self, s: ScheduledSeq, batch: SampleBatch, spec_rows: list[SampleRow], step: StepResult) -> None:
        """A speculating sequence: its proposal checked and its tokens appended (stop checks as
        usual); the update is told how many of the chunk's tokens keep their KV."""
        group, seq = s.group, s.seq
        if group.error is not None:
            return
        assert self.speculative is not None  # only a speculative decoder makes proposals
        with self.isolate((group,), "sampling", step) as work:
            kept = self.speculative.verify(seq, batch, spec_rows, s.proposal,
                                           lambda sampled: self.append(group, seq, sampled, step))
        if work.failed:
            return
        step.spec_computed[seq.seq_id] = kept
        step.progressed[group.request_id] = group

    def _beam_step(self, out: SchedulerOutput, logits: torch.Tensor,
                   beam_rows: list[tuple[int, SequenceGroup, Sequence]], step: StepResult) -> None:
        with self.isolate((g for _, g, _ in beam_rows), "beam search", step) as work:  # shared work
            self.beams.take_candidates(logits, beam_rows)
        if work.failed:
            return
        planned = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
        for group in {id(g): g for _, g, _ in beam_rows}.values():
            if group.error is not None:
                continue
            beams = group.live_seqs
            if self.beams.ready(group, beams, planned):
                with self.isolate((group,), "beam search", step):
                    self.generation_tokens += self.beams.advance(group, beams, step, self.fork)
                    step.progressed[group.request_id] = group

    # ------------------------------------------------------------------ request state
    def append(self, group: SequenceGroup, seq: Sequence, sampled: Sampled, step: StepResult) -> None:
        """``sampled`` becomes ``seq``'s next token: grammar advanced, logprobs, stop checks."""
        seq.token_ids.append(sampled.token)
        grammar_limit: GrammarLimitError | None = None
        if seq.grammar is not None:
            try:
                seq.grammar.accept(sampled.token)
            except GrammarLimitError as exc:  # the token stands; the sequence ends after it
                grammar_limit = exc
        self.generation_tokens += 1
        if sampled.top is not None:
            # a row samples logprobs only for a request that asks for them: its sequences hold a list
            seq.logprobs.append(sampled.top)  # type: ignore[union-attr]  # (see above; no check on the hot path)
            seq.cumulative_logprob += sampled.logprob  # type: ignore[operator]  # set with top (Sampled)
        now = time.time()
        if "first_token_time" not in group.metrics:
            group.metrics["first_token_time"] = now
        group.metrics["last_token_time"] = now
        self.outputs.check_stop(group, seq, sampled.token)
        if seq.finish_reason is None and grammar_limit is not None:
            self._stop_at_grammar_limit(group, seq, grammar_limit, step)
        elif seq.finish_reason is not None:
            step.finished.append((group, seq))

    def _stop_at_grammar_limit(self, group: SequenceGroup, seq: Sequence, exc: GrammarLimitError,
                               step: StepResult) -> None:
        """End ``seq`` with finish_reason "length" (its output so far, which may not match, as a
        max_tokens cut): its grammar hit a per-step limit and cannot go on. Not an error of the
        request (its siblings go on) nor of the server; one short log line."""
        logger.warning("request %s: %s; finish_reason length", group.request_id, exc)
        seq.finish_reason = "length"
        step.finished.append((group, seq))
        step.progressed[group.request_id] = group

    def fork(self, group: SequenceGroup, parent: Sequence, step: StepResult) -> Sequence:
        """A new sequence of ``group`` continuing ``parent`` (its blocks are shared in the update)."""
        child = new_sequence(group, len(group.seqs), list(parent.token_ids))
        child.cumulative_logprob = parent.cumulative_logprob
        if parent.grammar is not None:
            child.grammar = parent.grammar.fork()
        if parent.logprobs is not None:
            child.logprobs = list(parent.logprobs)
        group.seqs.append(child)
        step.forks.append((parent, child))
        return child


def new_sequence(group: SequenceGroup, index: int, token_ids: list[int]) -> Sequence:
    """Sequence ``index`` of ``group``: its id, its own generator when the request is seeded (so a
    seeded completion draws the same tokens whatever else is in the batch), its logprobs list."""
    seed = group.params.seed
    rng = make_generator(seed * 1_000_003 + index) if seed is not None else None
    return Sequence(f"{group.request_id}#{index}", index, len(group.prompt_token_ids), token_ids,
                    logprobs=[] if group.params.logprobs is not None else None, rng=rng)


def request_bias(group: SequenceGroup, vocab: int) -> torch.Tensor | None:
    """The request's logit_bias as a dense vector, built at its first sampling (None: none)."""
    if not group.params.logit_bias:
        return None
    vec = group.logit_bias_vector
    if vec is None or vec.shape[0] != vocab:
        vec = group.logit_bias_vector = logit_bias_vector(group.params.logit_bias, vocab)
    return vec


def prompt_logprob_window(s: ScheduledSeq) -> tuple[int, int] | None:
    """Positions ``first .. last - 1`` of this chunk whose logits give prompt logprobs not yet
    recorded (position p predicts prompt token p + 1), or None when the chunk gives none."""
    recorded = s.group.prompt_logprobs
    if recorded is None:
        return None
    first = len(recorded) - 1  # the position whose logits predict the next unrecorded token
    last = min(s.start + s.num_tokens, len(s.group.prompt_token_ids) - 1)
    return (first, last) if last > first >= s.start else None
