"""LLMEngine: the one place that wires the scheduler, the memory core and the model runner.

    add_request ─> Scheduler.waiting
    step():  Scheduler.schedule() ─> SchedulerOutput (frozen plan)
             runner (a ``Runner``): block moves (TierMover), execute(chunks) ─> logits
             StepUpdater.update(plan, chunks, logits) ─> request state + StepResult
                 (prompt logprobs, sampling, speculative verification, beams, forks, stop checks)
             Scheduler.update_from_output(plan, result): KV marked computed, forks, frees

The engine holds wiring, not work: its parts are built in ``build.py`` and here, and each step
only routes the plan between them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pagedkv.distributed.launch import RankFailedError
from pagedkv.engine.beam_search import BeamSearch
from pagedkv.engine.build import build_lora_manager, build_runner, build_speculative_decoder, kv_group_windows
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import EngineDeadError, RequestRejectedError
from pagedkv.engine.faults import FaultInjectingScheduler, FaultInjector, install_disk_faults
from pagedkv.engine.grammar_compiler import CompiledGrammar, GrammarLimits
from pagedkv.engine.input_processor import InputProcessor, PromptInput, TokenizedPrompt
from pagedkv.engine.kv_quality import KVQuantGuard, max_quant_error, request_kv_salt
from pagedkv.engine.kv_tiers import TierMover, disk_write_queue, open_disk_store, remote_tiers
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepResult
from pagedkv.engine.sequence import SequenceGroup
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.step_cost import StepCostModel
from pagedkv.engine.step_update import StepUpdater, new_sequence, prompt_logprob_window
from pagedkv.engine.structured_output import GrammarError, GrammarState, StructuredOutputs
from pagedkv.kv_events import KVEvent
from pagedkv.lora.request import LoRARequest
from pagedkv.memory import KVCacheManager
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.outputs import RequestOutput
from pagedkv.runner.batch import SeqChunk
from pagedkv.runner.protocol import Runner
from pagedkv.sampling.sampler import Sampler
from pagedkv.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Not thread-safe: one thread calls add_request / abort_request / step.
    """

    def __init__(self, config: EngineConfig, *, runner: Runner | None = None, tokenizer: Tokenizer | None = None,
                 model_name: str | None = None, max_position_embeddings: int | None = None,
                 model_identity: dict[str, str] | None = None,
                 generation_defaults: dict[str, Any] | None = None) -> None:
        """Build the engine's parts for ``config`` (``build.py`` loads the model), or wire a
        ``runner`` built by the caller, with its tokenizer and model facts."""
        if runner is None:
            (runner, tokenizer, model_name, max_position_embeddings, model_identity,
             generation_defaults) = build_runner(config)
        self.runner: Runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name or "pagedkv-model"
        # Sampling defaults for fields a request leaves out (EngineConfig.generation_config), by
        # SamplingParams' names; the server and LLM apply them, the engine never does. Read only.
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})
        B = runner.block_size
        model_len = config.max_model_len or max_position_embeddings or runner.num_blocks * B
        self.config = config.with_max_model_len(model_len)
        runner.set_context_length(model_len)  # longrope picks its factors by the context served
        if config.kv_offload_dir is not None and runner.num_host_blocks == 0:
            raise ValueError("the disk tier (kv_offload_dir) reads blocks back through the host tier, "
                             "which has no blocks: give a larger kv_offloading_size")
        costs = TierCosts(B)  # (the remote tier decides with the manager's costs)
        remote = remote_tiers(config, runner, self.model_name, model_identity, costs)
        disk = open_disk_store(config, runner, self.model_name, model_identity)
        self.kv = KVCacheManager(runner.num_blocks, B, num_host_blocks=runner.num_host_blocks, costs=costs,
                                 more_tiers=remote,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 eviction_policy=config.eviction_policy, watermark=config.watermark,
                                 prefix_index=config.prefix_index, offload_to_host=True, disk=disk,
                                 disk_write_queue=disk_write_queue(runner),
                                 kv_group_windows=kv_group_windows(runner),
                                 tenant_quotas=config.tenant_quotas,
                                 default_tenant_quota=config.default_tenant_kv_quota,
                                 kv_events=config.kv_events,
                                 max_tenant_pin_fraction=config.max_tenant_pin_fraction,
                                 num_full_blocks=runner.kv_full_blocks,
                                 kv_sink_blocks=config.kv_sink_blocks)
        self.tiers = TierMover(runner, self.kv)
        self._closed = False
        spec = config.faults
        self.faults = FaultInjector(spec) if spec else None
        if self.faults is not None and disk is not None:
            install_disk_faults(disk, self.faults)
        self.lora = build_lora_manager(config, runner)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode,
                                max_loras=config.max_loras if self.lora is not None else 0)
        # the step-time estimate the scheduler budgets by, fitted to every step's measured time
        self.step_costs = StepCostModel.for_model(runner.config, config.max_step_time_s)
        self.scheduler = (FaultInjectingScheduler(sched, self.kv, self.faults, self.step_costs) if self.faults
                          else Scheduler(sched, self.kv, self.step_costs))
        # 8-bit KV blocks: watch the error of what is stored (engine/kv_quality.py)
        self.kv_guard = KVQuantGuard(runner) if runner.write_error is not None else None
        self.outputs = OutputProcessor(tokenizer, model_len)
        vocab_size = runner.config.vocab_size
        self.inputs = InputProcessor(tokenizer, model_len, self.kv, vocab_size,
                                     chunk=config.max_num_batched_tokens)
        # Structured output: grammars compile in a worker process, under limits (grammar_compiler.py)
        self.structured = StructuredOutputs(tokenizer, vocab_size, self.outputs.eos_token_ids,
                                            limits=GrammarLimits.of(config))
        self.speculative = build_speculative_decoder(config, runner, tokenizer, model_len)
        # the step's post-processing: logits -> tokens, forks, stop checks, into the requests
        self.updater = StepUpdater(Sampler(config.seed), self.outputs, self.structured, self.speculative,
                                   BeamSearch(self.outputs.eos_token_ids, model_len,
                                              self.kv.num_computed),
                                   self.scheduler)
        self._arrivals = 0
        self._steps = 0
        self.last_step_tokens = 0  # tokens computed by the last step (the iteration-tokens histogram)
        self._prompt_tokens = 0

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
        if params.kv_cache_dtype is not None:  # the request's own KV precision (engine/kv_quality.py)
            salt = request_kv_salt(params.kv_cache_dtype, salt, self.runner,
                                   -(-(len(ids) + max_tokens) // self.runner.block_size))
        ttl = self._pin_ttl(conversation_id, pin_ttl_s)
        lora = self._resolve_lora(lora_request)
        group = SequenceGroup(request_id, text, ids, params, self._arrivals, priority, salt,
                              tenant if tenant is not None else cache_salt, conversation_id, ttl, max_tokens,
                              beam_width, length_penalty)
        if lora is not None:
            group.lora, group.lora_key = lora, lora.key
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # nothing predicts the first prompt token
        group.seqs.append(new_sequence(group, 0, list(ids)))
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

    def _start_grammar(self, params: SamplingParams, beam_width: int) -> GrammarState | None:
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
        except RankFailedError as exc:  # a tensor-parallel rank is gone: no step can run again
            raise EngineDeadError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - the shared work failed: fail this plan's requests, keep the engine
            self.updater.fail_plan(out, exc, step)
        else:
            if logits is not None:
                self.updater.update(out, chunks, logits, step)
        self.scheduler.update_from_output(out, step)
        if self.speculative is not None:  # proposals for the next step's decodes
            self.speculative.propose(self.scheduler.running, self.kv.num_computed)
        self.last_step_tokens = sum(c.num_tokens for c in chunks)
        if not out.scheduled:  # nothing to compute: requests may be waiting for loads (disk reads)
            self.kv.wait_for_loads(0.05)  # (returns at once without a tier loading in the background)
        if not (out.scheduled or out.preempted or out.resumed or out.swap_out or out.swap_in or out.to_disk
                or out.from_disk):  # nothing ran: not a step
            return self._outputs([g for g in step.progressed.values() if not only_finished or g.is_finished])
        if out.scheduled:
            self.step_costs.observe(out.work, time.perf_counter() - started)
        self._steps += 1
        if self.kv_guard is not None:
            self.kv_guard.after_step(self._steps)
        if self.config.debug_integrity:
            self.kv.check_integrity()
            if self.speculative is not None and self.speculative.draft is not None:
                self.speculative.draft.kv.check_integrity()
        return self._outputs([g for g in step.progressed.values() if not only_finished or g.is_finished])

    def _chunk(self, s: ScheduledSeq, lora_slots: dict[str, int]) -> SeqChunk:
        seq = s.seq
        slot = lora_slots[s.group.lora_key] if s.group.lora_key is not None else -1
        if s.proposal:  # the last token, then the proposal: every position's logits verify
            return SeqChunk(seq.token_ids[s.start:s.start + 1] + list(s.proposal), s.start,
                            self.kv.block_table(seq.seq_id), all_logits=True,
                            group_tables=self.kv.group_tables(seq.seq_id), lora_slot=slot)
        return SeqChunk(seq.token_ids[s.start:s.start + s.num_tokens], s.start,
                        self.kv.block_table(seq.seq_id), all_logits=prompt_logprob_window(s) is not None,
                        group_tables=self.kv.group_tables(seq.seq_id), lora_slot=slot)

    def _execute(self, out: SchedulerOutput, chunks: list[SeqChunk]) -> torch.Tensor | None:
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

    def _outputs(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """The outputs of ``groups``. Building one that raises (e.g. detokenization) fails that
        request alone, at once (its output then carries the error); one isolation context covers a
        run of requests, not one per request."""
        made: list[RequestOutput] = []
        if not groups:
            return made
        current = [groups[0]]  # the request whose output is being built: what a failure fails
        pending = iter(groups)
        while True:
            with self.updater.isolate(current, "building the output", None) as work:
                for group in pending:
                    current[0] = group
                    made.append(self.outputs.make_output(group))
            if not work.failed:
                return made
            made.append(self.outputs.make_output(current[0]))  # failed and aborted: the error path does not detokenize

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
        try:
            written = self.tiers.persist()
        finally:
            self.runner.close()  # (a tensor-parallel runner's worker ranks stop)
        if written:
            logger.info("KV disk tier: %d blocks written at shutdown", written)

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once if the engine dies between steps (a tensor-parallel rank
        died: the next step raises EngineDeadError); the server stops on it."""
        self.runner.on_failure(callback)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Tokenize and check a prompt; any thread may call it (see InputProcessor.tokenize)."""
        return self.inputs.tokenize(prompt)

    @property
    def model_context_length(self) -> int:
        """The model's own context length (its config's max_position_embeddings), which
        ``max_model_len`` may exceed only where the caller allows it (vLLM's rule, server side)."""
        return self.runner.config.max_position_embeddings

    def take_kv_events(self) -> list[KVEvent]:
        """The KV cache events (blocks stored, removed, all cleared) since the last call, oldest
        first; always empty unless the engine was built with ``kv_events``."""
        events = self.kv.events
        return events.take() if events is not None and events.events else []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds, on the device and in the host tier, without
        moving it down a tier (a benchmark's fresh start; vLLM's ``reset_prefix_cache``)."""
        self.kv.clear_prefix_cache()

    def tenant_names(self) -> frozenset[str]:
        """The tenants the engine's configuration names (``tenant_quotas``): names an operator
        chose, so they may label metrics."""
        return frozenset(self.config.tenant_quotas or ())

    def stats(self) -> EngineStats:
        s, runner = self.scheduler, self.runner
        quant = runner.kv_quant_error()
        return EngineStats(
            kv=self.kv.stats(), num_running=len(s.running), num_waiting=len(s.waiting),
            num_swapped=len(s.swapped), num_running_seqs=s.num_running_seqs,
            preemptions_recompute=s.preemptions["recompute"], preemptions_swap=s.preemptions["swap"],
            prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self.updater.generation_tokens,
            num_steps=self._steps,
            faults_fired=sum(self.faults.fired.values()) if self.faults else 0,
            kv_cache_dtype=runner.kv_format.name,
            enable_prefix_caching=self.config.enable_prefix_caching,
            kv_bytes_per_block=runner.bytes_per_block,
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
