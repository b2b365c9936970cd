"""LLMEngine: the one place that wires the scheduler, the memory core and the model runner.

    add_request ─> Scheduler.waiting
    step():  Scheduler.schedule() ─> SchedulerOutput (frozen plan)
             runner: swap out, swap in, copy-on-write copies, execute(chunks) ─> logits
             per request: prompt logprobs, Sampler ─> next tokens, forks for n > 1 and beams,
                 stop checks (request state written here) ─> StepResult
             Scheduler.update_from_output(plan, result): KV marked computed, forks, frees
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from typing import Any

from pagedkv.engine.beam_search import select_beams
from pagedkv.engine.build import build_runner, build_speculative_decoder
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import RequestRejectedError
from pagedkv.engine.faults import FaultInjectingScheduler, FaultInjector, install_disk_faults
from pagedkv.engine.input_processor import InputProcessor, PromptInput, TokenizedPrompt
from pagedkv.engine.kv_quality import KVQuantGuard, max_quant_error
from pagedkv.engine.kv_tiers import TierMover, open_disk_tier
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.sampler import (
    NO_CANDIDATE,
    Sampled,
    Sampler,
    SampleRow,
    SamplingError,
    logit_bias_vector,
    make_generator,
    token_logprobs,
    top_logprobs,
)
from pagedkv.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput, StepResult
from pagedkv.engine.sequence import GroupStatus, Sequence, SequenceGroup
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.step_cost import StepCostModel
from pagedkv.engine.grammar_compiler import CompiledGrammar, GrammarLimits
from pagedkv.engine.structured_output import GrammarError, GrammarLimitError, StructuredOutputs
from pagedkv.lora.manager import LoRAManager
from pagedkv.lora.request import LoRARequest
from pagedkv.memory import KVCacheManager
from pagedkv.outputs import RequestOutput
from pagedkv.runner.batch import SeqChunk
from pagedkv.sampling_params import SamplingParams, StructuredOutput
from pagedkv.speculative.verify import verify

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Not thread-safe: one thread calls add_request / abort_request / step.
    """

    def __init__(self, config: EngineConfig, *, runner=None, tokenizer=None, model_name: str | None = None,
                 max_position_embeddings: int | None = None, model_identity: dict[str, str] | None = None,
                 generation_defaults: dict[str, Any] | None = None) -> None:
        if runner is None:
            (runner, tokenizer, model_name, max_position_embeddings, model_identity,
             generation_defaults) = build_runner(config)
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name or "pagedkv-model"
        # Sampling defaults for fields a request leaves out (EngineConfig.generation_config), by
        # SamplingParams' names; the server and LLM apply them, the engine never does. Read only.
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})
        B = runner.block_size
        model_len = config.max_model_len or max_position_embeddings or runner.num_blocks * B
        self.config = config.with_max_model_len(model_len)
        set_context_length = getattr(getattr(runner, "model", None), "set_context_length", None)
        if set_context_length is not None:  # longrope picks its factors by the context served
            set_context_length(model_len)
        if config.kv_offload_dir is not None and runner.num_host_blocks == 0:
            raise ValueError("the disk tier (kv_offload_dir) reads blocks back through the host tier, "
                             "which has no blocks: give a larger kv_offloading_size")
        disk = open_disk_tier(config, runner, self.model_name, model_identity)
        self.kv = KVCacheManager(runner.num_blocks, B, num_host_blocks=runner.num_host_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 eviction_policy=config.eviction_policy, watermark=config.watermark,
                                 prefix_index=config.prefix_index, offload_to_host=True, disk=disk,
                                 kv_group_windows=kv_group_windows(runner),
                                 tenant_quotas=config.tenant_quotas,
                                 default_tenant_quota=config.default_tenant_kv_quota,
                                 kv_events=config.kv_events,
                                 max_tenant_pin_fraction=config.max_tenant_pin_fraction)
        self.tiers = TierMover(runner, self.kv)
        self._closed = False
        spec = config.faults
        self.faults = FaultInjector(spec) if spec else None
        if self.faults is not None and disk is not None:
            install_disk_faults(disk.disk, self.faults)
        self.lora = build_lora_manager(config, runner)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode,
                                max_loras=config.max_loras if self.lora is not None else 0)
        # the step-time estimate the scheduler budgets by, fitted to every step's measured time
        self.step_costs = StepCostModel.for_model(getattr(runner, "config", None), config.max_step_time_s)
        self.scheduler = (FaultInjectingScheduler(sched, self.kv, self.faults, self.step_costs) if self.faults
                          else Scheduler(sched, self.kv, self.step_costs))
        self.sampler = Sampler(config.seed)
        # 8-bit KV blocks: watch the error of what is stored (engine/kv_quality.py)
        self.kv_guard = KVQuantGuard(runner) if getattr(runner, "write_error", None) is not None else None
        self.outputs = OutputProcessor(tokenizer, model_len)
        vocab_size = getattr(getattr(runner, "config", None), "vocab_size", None)
        self.inputs = InputProcessor(tokenizer, self.config.max_model_len, self.kv, vocab_size,
                                     chunk=config.max_num_batched_tokens)
        # Structured output: grammars compile in a worker process, under limits (grammar_compiler.py)
        self.structured = StructuredOutputs(tokenizer, vocab_size, self.outputs.eos_token_ids,
                                            limits=GrammarLimits.of(config))
        self.speculative = build_speculative_decoder(config, runner, tokenizer, self.config.max_model_len)
        self._arrivals = 0
        self._steps = 0
        self.last_step_tokens = 0  # tokens computed by the last step (the iteration-tokens histogram)
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> LLMEngine:
        return cls(EngineConfig.from_options(model, **options))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    *, cache_salt: str | None = None, priority: int = 0, beam_width: int = 0,
                    length_penalty: float = 1.0, tenant: str | None = None,
                    conversation_id: str | None = None, pin_ttl_s: float | None = None,
                    lora_request: LoRARequest | str | None = None) -> None:
        """Queue a request. Raises RequestRejectedError (RequestTooLongError when it can never
        fit) with a message saying what to change; the engine's other requests are untouched.

        ``tenant`` (e.g. an API key's) owns the request's KV blocks for quotas and keeps its
        prefix cache apart from every other tenant's; ``cache_salt`` then subdivides the tenant's
        cache. Without a tenant the ``cache_salt`` is the tenant (no salt: the default tenant).
        ``conversation_id``: when the request finishes, its prompt + output prefix stays cached
        (pinned) for ``pin_ttl_s`` seconds (default and bound: ``max_pin_ttl_s``) or until the
        conversation's next turn finishes (``memory/pins.py``). ``lora_request`` runs the request
        under a LoRA adapter (a ``LoRARequest``, or a registered adapter's name; engines built with
        ``enable_lora``): LoRAError (status 404 for an unknown name) when it cannot be used."""
        params = params or SamplingParams()
        if request_id in self.scheduler.groups:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        self.inputs.check_logit_bias(params)
        text, ids = self.inputs.tokenize(prompt)
        max_tokens = self.inputs.check_fits(len(ids), params, beam_width or params.n)
        grammar = self._start_grammar(params, beam_width)
        salt = cache_salt if tenant is None else f"\x00tenant\x00{tenant}\x00{cache_salt or ''}"
        if params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position: a salt of its own means no
            # prefix-cache hit lets the request skip computing part of its prompt.
            salt = f"{salt or ''}\x00prompt-logprobs\x00{self._arrivals}"
        ttl = self._pin_ttl(conversation_id, pin_ttl_s)
        lora = self._resolve_lora(lora_request)
        group = SequenceGroup(request_id, text, ids, params, self._arrivals, priority, salt,
                              tenant if tenant is not None else cache_salt, conversation_id, ttl, max_tokens,
                              beam_width, length_penalty)
        if lora is not None:
            group.lora, group.lora_key = lora, lora.key
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # nothing predicts the first prompt token
        group.seqs.append(self._new_seq(group, 0, list(ids)))
        group.seqs[0].grammar = grammar
        group.metrics["arrival_time"] = time.time()
        self._arrivals += 1
        self._prompt_tokens += len(ids)
        self.scheduler.add(group)

    def _resolve_lora(self, lora_request: LoRARequest | str | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise RequestRejectedError("this request names a LoRA adapter, but the engine serves none: "
                                       "start it with enable_lora=True (--enable-lora)", param="lora_request")
        return self.lora.resolve(lora_request)

    def _pin_ttl(self, conversation_id: str | None, pin_ttl_s: float | None) -> float:
        limit = self.config.max_pin_ttl_s
        if pin_ttl_s is None:
            return limit
        if not isinstance(pin_ttl_s, (int, float)) or isinstance(pin_ttl_s, bool) or not 0 < pin_ttl_s <= limit:
            raise RequestRejectedError(f"pin_ttl_s must be a number of seconds in (0, {limit:g}] (the engine's "
                                       f"max_pin_ttl_s), got {pin_ttl_s!r}", param="pin_ttl_s")
        if conversation_id is None:
            raise RequestRejectedError("pin_ttl_s needs a conversation_id", param="pin_ttl_s")
        return float(pin_ttl_s)

    def _start_grammar(self, params: SamplingParams, beam_width: int):
        """The structured-output state of a new request, or None; RequestRejectedError (``param``
        "structured_output") when its grammar does not compile or cannot be served."""
        so = params.structured_output
        if so is None:
            return None
        if beam_width:
            raise RequestRejectedError("structured output is not supported with beam search",
                                       param="structured_output")
        try:
            return self.structured.start(so)
        except GrammarError as exc:
            raise RequestRejectedError(f"structured output: {exc}", param="structured_output") from exc

    def compile_grammar(self, so: StructuredOutput) -> Future[CompiledGrammar]:
        """Compile ``so``'s grammar ahead of ``add_request`` (which then only copies it, while the
        caller holds the result): a future of it, or of its GrammarError (a GrammarLimitError
        names the limit). Any thread may call it; the size checks raise at once, and cost in
        proportion to the input (call it off the event loop)."""
        return self.structured.submit(so)

    def add_requests(self, requests: list[tuple[str, PromptInput, SamplingParams]], *,
                     cache_salt: str | None = None, priorities: list[int] | None = None,
                     tenant: str | None = None, conversation_id: str | None = None,
                     pin_ttl_s: float | None = None,
                     lora_requests: list[LoRARequest | None] | None = None) -> None:
        """Add ``(request_id, prompt, params)`` requests atomically: all of them, or (when one is
        rejected) none, and the error is raised. ``lora_requests``: one adapter (or None) per request."""
        added: list[str] = []
        try:
            for i, (rid, prompt, params) in enumerate(requests):
                self.add_request(rid, prompt, params, cache_salt=cache_salt,
                                 priority=priorities[i] if priorities else 0, tenant=tenant,
                                 conversation_id=conversation_id, pin_ttl_s=pin_ttl_s,
                                 lora_request=lora_requests[i] if lora_requests else None)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.abort_request(rid)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        group = self.scheduler.abort(request_id)
        return self.outputs.make_output(group) if group else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Run one scheduling step; return the state of every request that progressed (or, with
        ``only_finished``, of those that finished, sparing the per-step detokenization).

        Failures are contained. Work on one request (forking, sampling, stop checks,
        detokenization, beam bookkeeping) that raises fails that request alone: it finishes with
        ``error`` set and its blocks freed, and the rest of the step goes on. A failure of the
        shared work (block swaps and copies, the forward pass) fails the requests of this plan
        only; waiting requests are untouched and the engine keeps serving.

        A call with nothing to run is not a step (``num_steps`` stays): with no request at all it
        returns at once; with requests that only wait (for disk reads) it waits for a read.
        """
        if not self.scheduler.has_unfinished():
            return []
        started = time.perf_counter()
        out = self.scheduler.schedule()
        step = StepResult()
        slots = (self.lora.assign_slots(s.group.lora for s in out.scheduled if s.group.lora is not None)
                 if self.lora is not None else {})
        chunks = [self._chunk(s, slots) for s in out.scheduled]
        now = time.time()
        for s in out.scheduled:  # (queue time ends when a request is first computed)
            if "first_scheduled_time" not in s.group.metrics:
                s.group.metrics["first_scheduled_time"] = now
        try:
            logits = self._execute(out, chunks)
        except Exception as exc:  # noqa: BLE001 - fail this plan's requests, keep the engine
            self._fail_plan(out, exc, step)
        else:
            if logits is not None:
                # Logits rows: one per chunk (its last token), or every token of an all_logits chunk.
                ends = list(itertools.accumulate(c.num_logits for c in chunks))
                self._record_prompt_logprobs(out, chunks, ends, logits, step)
                # keep only the rows sampled from: each chunk's last, and a speculating chunk's
                # rows of its proposal too (first_row[i]: chunk i's first kept row)
                keep: list[int] = []
                first_row: list[int] = []
                for s, end in zip(out.scheduled, ends):
                    first_row.append(len(keep))
                    keep.extend(range(end - 1 - len(s.proposal), end))
                if len(keep) != ends[-1]:
                    logits = logits.index_select(0, logits.new_tensor(keep).long())
                self._sample(out, logits, first_row, step)
        self.scheduler.update_from_output(out, step)
        if self.speculative is not None:  # proposals for the next step's decodes
            self.speculative.propose(self.scheduler.running, self.kv.num_computed)
        self.last_step_tokens = sum(c.num_tokens for c in chunks)
        if not out.scheduled and self.kv.disk is not None:
            self.kv.disk.wait_for_reads(0.05)  # nothing to compute but requests waiting for the disk
        if not (out.scheduled or out.preempted or out.resumed or out.swap_out or out.swap_in or out.to_disk
                or out.from_disk):  # nothing ran: not a step
            return [self._output(g) for g in step.progressed.values() if not only_finished or g.is_finished]
        if out.scheduled:
            self.step_costs.observe(out.work, time.perf_counter() - started)
        self._steps += 1
        if self.kv_guard is not None:
            self.kv_guard.after_step(self._steps)
        if self.config.debug_integrity:
            self.kv.check_integrity()
            if self.speculative is not None and self.speculative.draft is not None:
                self.speculative.draft.kv.check_integrity()
        return [self._output(g) for g in step.progressed.values() if not only_finished or g.is_finished]

    def _chunk(self, s: ScheduledSeq, lora_slots: dict[str, int]) -> SeqChunk:
        seq = s.seq
        slot = lora_slots[s.group.lora_key] if s.group.lora_key is not None else -1
        if s.proposal:  # the last token, then the proposal: every position's logits verify
            return SeqChunk(seq.token_ids[s.start:s.start + 1] + list(s.proposal), s.start,
                            self.kv.block_table(seq.seq_id), all_logits=True,
                            group_tables=self.kv.group_tables(seq.seq_id), lora_slot=slot)
        return SeqChunk(seq.token_ids[s.start:s.start + s.num_tokens], s.start,
                        self.kv.block_table(seq.seq_id), all_logits=_prompt_logprob_window(s) is not None,
                        group_tables=self.kv.group_tables(seq.seq_id), lora_slot=slot)

    def _execute(self, out: SchedulerOutput, chunks: list[SeqChunk]):
        """The plan's shared work on the runner; the logits of its chunks, or None."""
        # Order matters (engine/kv_tiers.py): evicted blocks are serialized before anything
        # reuses them, blocks swapped out may be reused by this step's copies, blocks swapped in
        # may be the source of a copy-on-write.
        self.tiers.run(out)
        if not chunks:
            return None
        start = time.perf_counter()
        logits = self.runner.execute(chunks)
        tokens = sum(len(c.token_ids) for c in chunks)
        if tokens >= 4 * len(chunks):  # mostly prefill: measures the cost of recomputing
            self.kv.costs.observe_prefill(tokens, time.perf_counter() - start)
        return logits

    def _record_prompt_logprobs(self, out: SchedulerOutput, chunks: list[SeqChunk], ends: list[int],
                                logits, step: StepResult) -> None:
        """Logprobs of the prompt tokens this step's all_logits chunks predict (row p of a chunk
        predicts token p + 1), each recorded once even when a preemption recomputes it."""
        for s, chunk, end in zip(out.scheduled, chunks, ends):
            window = _prompt_logprob_window(s) if chunk.all_logits else None
            if window is None or s.group.error is not None:
                continue
            group, (first, last) = s.group, window
            try:
                row0 = end - chunk.num_logits - s.start  # the logits row of position 0, were it here
                group.prompt_logprobs += token_logprobs(logits[row0 + first:row0 + last],
                                                        group.prompt_token_ids[first + 1:last + 1],
                                                        group.params.prompt_logprobs)
            except Exception as exc:  # noqa: BLE001 - this request's alone
                self._fail_requests([group], "prompt logprobs", exc, step)

    def _fail_plan(self, out: SchedulerOutput, exc: Exception, step: StepResult) -> None:
        """The runner failed the plan's shared work: fail every request whose KV it touched.

        A request preempted by recompute in this plan holds no blocks and is left waiting. The
        update then frees the failed requests' blocks and forgets every cached-free block (see
        ``Scheduler.update_from_output``).
        """
        step.computed = False
        touched = [g for rid in sorted(out.request_ids)
                   if (g := self.scheduler.groups.get(rid)) is not None and g.status is not GroupStatus.WAITING]
        logger.error("a step's forward pass failed (%r); failing its %d request(s)", exc, len(touched),
                     exc_info=exc)
        for group in touched:
            self._fail(group, f"the forward pass of this request's batch failed: {exc!r}", step)

    def _fail(self, group: SequenceGroup, message: str, step: StepResult | None) -> None:
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

    def _output(self, group: SequenceGroup) -> RequestOutput:
        try:
            return self.outputs.make_output(group)
        except Exception as exc:  # noqa: BLE001 - e.g. detokenization; fail this request alone
            logger.exception("building the output of %s failed", group.request_id)
            self._fail(group, f"building this request's output failed: {exc!r}", None)
            return self.outputs.make_output(group)  # the error path does not detokenize

    def _sample(self, out: SchedulerOutput, logits, first_row: list[int], step: StepResult) -> None:
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
                bias = _logit_bias(group, logits.shape[-1])
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
                try:
                    group.forked = True
                    seqs += [self._fork(group, seq, step) for _ in range(group.params.n - 1)]
                except Exception as exc:  # noqa: BLE001
                    self._fail_requests([group], "forking", exc, step)
                    continue
            for q in seqs:  # a grammar's allowed tokens, from its state after q's tokens so far
                try:
                    bitmask = (q.grammar.fill_bitmask(self.structured.new_bitmask())  # type: ignore[attr-defined]
                               if q.grammar is not None else None)
                except GrammarLimitError as exc:  # this sequence ends here, its siblings go on
                    self._stop_at_grammar_limit(group, q, exc, step)
                    continue
                except Exception as exc:  # noqa: BLE001
                    self._fail_requests([group], "structured output", exc, step)
                    break
                rows.append(SampleRow(first_row[i], group.params, q.rng, q.token_ids, q.prompt_len, bitmask))
                targets.append((group, q))
        for row, (group, _) in zip(rows, targets):  # the request's bias vector, built once
            row.bias = _logit_bias(group, logits.shape[-1])
        if rows or speculating:
            try:
                batch = self.sampler.prepare(logits, rows + [r for _, spec_rows in speculating for r in spec_rows])
            except Exception as exc:  # noqa: BLE001 - shared work: fail the sampled requests
                self._fail_requests([g for g, _ in targets] + [s.group for s, _ in speculating], "sampling", exc, step)
                targets, speculating = [], []
            for s, spec_rows in speculating:
                self._verify(s, batch, spec_rows, step)
            for (group, seq), row in zip(targets, rows):
                if group.error is not None:
                    continue  # a sibling failed it earlier in this step
                try:
                    self._append(group, seq, batch.sample(row), step)
                except Exception as exc:  # noqa: BLE001 - sampling, stop checks, detokenization
                    self._fail_requests([group], "sampling", exc, step)
                else:
                    step.progressed[group.request_id] = group
        if beam_rows:
            self._beam_step(out, logits, beam_rows, step)

    def _stop_at_grammar_limit(self, group: SequenceGroup, seq: Sequence, exc: GrammarLimitError,
                               step: StepResult) -> None:
        """End ``seq`` with finish_reason "length" (its output so far, which may not match, as a
        max_tokens cut): its grammar hit a per-step limit and cannot go on. Not an error of the
        request (its siblings go on) nor of the server; one short log line."""
        logger.warning("request %s: %s; finish_reason length", group.request_id, exc)
        seq.finish_reason = "length"
        step.finished.append((group, seq))
        step.progressed[group.request_id] = group

    def _fail_requests(self, groups: list[SequenceGroup], stage: str, exc: Exception,
                       step: StepResult) -> None:
        """Fail ``groups`` (once each) for one exception, logged once unless a user's input caused it."""
        groups = list({id(g): g for g in groups}.values())
        if isinstance(exc, SamplingError):
            message = str(exc)
        else:
            logger.error("%s failed for %d request(s): %s", stage, len(groups),
                         ", ".join(g.request_id for g in groups), exc_info=exc)
            message = f"{stage} failed for this request: {type(exc).__name__}: {exc}"
        for group in groups:
            self._fail(group, message, step)

    def _verify(self, s: ScheduledSeq, batch, spec_rows: list[SampleRow], step: StepResult) -> None:
        """Check a sequence's proposal (``speculative/verify.py``), append the tokens it yields (stop
        checks as usual), and tell the update how many of the chunk's tokens keep their KV."""
        group, seq = s.group, s.seq
        if group.error is not None:
            return
        try:
            tokens, accepted = verify(batch, spec_rows, s.proposal)
            appended = 0
            for sampled in tokens:
                self._append(group, seq, sampled, step)
                appended += 1
                if seq.finish_reason is not None:
                    break
        except Exception as exc:  # noqa: BLE001 - sampling, stop checks, detokenization
            self._fail_requests([group], "sampling", exc, step)
            return
        # the KV of the last token and of the accepted proposal tokens that were appended
        step.spec_computed[seq.seq_id] = 1 + min(accepted, appended)
        self.speculative.record(seq, len(s.proposal), accepted)  # type: ignore[union-attr]
        step.progressed[group.request_id] = group

    def _append(self, group: SequenceGroup, seq: Sequence, sampled: Sampled, step: StepResult) -> None:
        seq.token_ids.append(sampled.token)
        grammar_limit: GrammarLimitError | None = None
        if seq.grammar is not None:
            try:
                seq.grammar.accept(sampled.token)  # type: ignore[attr-defined]
            except GrammarLimitError as exc:  # the token stands; the sequence ends after it
                grammar_limit = exc
        self._generation_tokens += 1
        if sampled.top is not None:
            seq.logprobs.append(sampled.top)  # type: ignore[union-attr]
            seq.cumulative_logprob += sampled.logprob  # type: ignore[operator]
        now = time.time()
        if "first_token_time" not in group.metrics:
            group.metrics["first_token_time"] = now
        group.metrics["last_token_time"] = now
        self.outputs.check_stop(group, seq, sampled.token)
        if seq.finish_reason is None and grammar_limit is not None:
            self._stop_at_grammar_limit(group, seq, grammar_limit, step)
        elif seq.finish_reason is not None:
            step.finished.append((group, seq))

    def _beam_step(self, out: SchedulerOutput, logits, beam_rows, step: StepResult) -> None:
        k = max(2 * g.beam_width for _, g, _ in beam_rows)
        try:
            values, ids = top_logprobs(logits[[i for i, _, _ in beam_rows]], min(k, logits.shape[-1]))
        except Exception as exc:  # noqa: BLE001 - shared work: fail the beam requests
            self._fail_requests([g for _, g, _ in beam_rows], "beam search", exc, step)
            return
        for (_, group, seq), v, t in zip(beam_rows, values, ids):
            group.beam_candidates[seq.seq_id] = (v[:2 * group.beam_width], t[:2 * group.beam_width])
        # A beam is ready once its KV is computed: earlier steps' count plus this plan's tokens.
        planned = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
        for group in {id(g): g for _, g, _ in beam_rows}.values():
            if group.error is not None:
                continue
            beams = group.live_seqs
            if all(b.seq_id in group.beam_candidates
                   and self.kv.num_computed(b.seq_id) + planned.get(b.seq_id, 0) == b.num_tokens
                   for b in beams):
                try:
                    if any(x != x for v, _ in group.beam_candidates.values() for x in v):
                        raise SamplingError(NO_CANDIDATE)
                    self._advance_beams(group, beams, step)
                except Exception as exc:  # noqa: BLE001
                    self._fail_requests([group], "beam search", exc, step)
                else:
                    step.progressed[group.request_id] = group

    def _advance_beams(self, group: SequenceGroup, beams: list[Sequence], step: StepResult) -> None:
        live, done = select_beams(beams, group.beam_candidates, group.beam_width,
                                  self.outputs.eos_token_ids, group.params.ignore_eos)
        group.beam_candidates.clear()
        for prop in done:  # finished hypotheses hold no blocks
            hyp = Sequence(f"{group.request_id}#h{len(group.finished_seqs)}", -1, prop.parent.prompt_len,
                           prop.parent.token_ids + [prop.token], finish_reason="stop")
            hyp.cumulative_logprob = prop.cumulative_logprob
            group.finished_seqs.append(hyp)
        used: set[str] = set()
        assignments = []
        for prop in live:  # the first use of a parent keeps it; later uses fork it
            child = prop.parent if prop.parent.seq_id not in used else self._fork(group, prop.parent, step)
            used.add(prop.parent.seq_id)
            assignments.append((child, prop))
        for beam in beams:
            if beam.seq_id not in used:
                beam.finish_reason = "pruned"
                step.finished.append((group, beam))
        self._generation_tokens += len(assignments)
        for child, prop in assignments:
            child.token_ids.append(prop.token)
            child.cumulative_logprob = prop.cumulative_logprob
        for child, _ in assignments:
            if child.num_output_tokens >= group.max_tokens or child.num_tokens >= self.config.max_model_len:
                child.finish_reason = "length"
                group.finished_seqs.append(child)
                step.finished.append((group, child))

    # ------------------------------------------------------------------ helpers
    def _new_seq(self, group: SequenceGroup, index: int, token_ids: list[int]) -> Sequence:
        seed = group.params.seed
        rng = make_generator(seed * 1_000_003 + index) if seed is not None else None
        return Sequence(f"{group.request_id}#{index}", index, len(group.prompt_token_ids), token_ids,
                        logprobs=[] if group.params.logprobs is not None else None, rng=rng)

    def _fork(self, group: SequenceGroup, parent: Sequence, step: StepResult) -> Sequence:
        """A new sequence of ``group`` continuing ``parent`` (its blocks are shared in the update)."""
        child = self._new_seq(group, len(group.seqs), list(parent.token_ids))
        child.cumulative_logprob = parent.cumulative_logprob
        if parent.grammar is not None:
            child.grammar = parent.grammar.fork()  # type: ignore[attr-defined]
        if parent.logprobs is not None:
            child.logprobs = list(parent.logprobs)
        group.seqs.append(child)
        step.forks.append((parent, child))
        return child

    def close(self) -> None:
        """Shut down cleanly: with a disk tier, write the cached blocks it lacks (host tier, then
        device) and release its directory, so a restart finds them. Idempotent; requests still
        unfinished are aborted."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self.scheduler.groups):
            self.scheduler.abort(request_id)
        if self.speculative is not None:
            self.speculative.close()
        self.structured.close()
        written = self.tiers.persist()
        if written:
            logger.info("KV disk tier: %d blocks written at shutdown", written)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Tokenize and check a prompt; any thread may call it (see InputProcessor.tokenize)."""
        return self.inputs.tokenize(prompt)

    def stats(self) -> EngineStats:
        s, runner = self.scheduler, self.runner
        fmt = getattr(runner, "kv_format", None)  # test doubles of the runner may lack these
        quant = runner.kv_quant_error() if hasattr(runner, "kv_quant_error") else None
        return EngineStats(
            kv=self.kv.stats(), num_running=len(s.running), num_waiting=len(s.waiting),
            num_swapped=len(s.swapped), num_running_seqs=s.num_running_seqs,
            preemptions_recompute=s.preemptions["recompute"], preemptions_swap=s.preemptions["swap"],
            prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generation_tokens,
            num_steps=self._steps,
            faults_fired=sum(self.faults.fired.values()) if self.faults else 0,
            kv_cache_dtype=fmt.name if fmt is not None else self.config.kv_cache_dtype,
            enable_prefix_caching=self.config.enable_prefix_caching,
            kv_bytes_per_block=int(getattr(getattr(runner, "cache", None), "bytes_per_block", 0)),
            kv_quant_error=quant, kv_quant_error_max=max_quant_error(quant),
            tier_costs=self.kv.costs.as_dict(), thrash_guarded=s.thrash_guarded, step_costs=self.step_costs.as_dict(),
            **self._spec_stats(),
            lora=self.lora.stats((g.lora for g in s.running), (g.lora for g in s.waiting + s.swapped))
            if self.lora is not None else None)

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculative is None:
            return {}
        c = self.speculative.counters()
        return dict(spec_num_drafts=c.num_drafts, spec_draft_tokens=c.num_draft_tokens,
                    spec_accepted_tokens=c.num_accepted_tokens, spec_acceptance_rate=c.acceptance_rate,
                    spec_mean_accepted_length=c.mean_accepted_length,
                    spec_accepted_per_position=c.accepted_per_position)

def kv_group_windows(runner) -> tuple[int | None, ...]:
    """The memory core's KV groups for the runner's cache (``model_shape.kv_groups``): one per
    group, its window or None."""
    groups = getattr(getattr(runner, "cache", None), "groups", None)
    return tuple(g.window for g in groups) if groups else (None,)


def _logit_bias(group: SequenceGroup, vocab: int):
    """The request's logit_bias as a dense vector, built at its first sampling (None: none)."""
    if not group.params.logit_bias:
        return None
    vec = group.logit_bias_vector
    if vec is None or vec.shape[0] != vocab:
        vec = group.logit_bias_vector = logit_bias_vector(group.params.logit_bias, vocab)
    return vec


def _prompt_logprob_window(s: ScheduledSeq) -> tuple[int, int] | None:
    """Positions ``first .. last - 1`` of this chunk whose logits give prompt logprobs not yet
    recorded (position p predicts prompt token p + 1), or None when the chunk gives none."""
    recorded = s.group.prompt_logprobs
    if recorded is None:
        return None
    first = len(recorded) - 1  # the position whose logits predict the next unrecorded token
    last = min(s.start + s.num_tokens, len(s.group.prompt_token_ids) - 1)
    return (first, last) if last > first >= s.start else None


def build_lora_manager(config: EngineConfig, runner) -> LoRAManager | None:
    """The adapters' manager of an engine with ``enable_lora`` (its runner built with LoRA slots)."""
    if not config.enable_lora:
        return None
    if getattr(runner, "lora", None) is None:
        raise ValueError("enable_lora: the runner has no LoRA slots (build it with max_loras > 0)")
    return LoRAManager(runner, runner.config, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                       max_cpu_loras=config.max_cpu_loras or config.max_loras)
