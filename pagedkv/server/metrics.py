"""Prometheus metrics of the server, named ``pagedkv_*``, in a registry owned by one app; the
figures routers read are also exported under vLLM's names (``vllm:*``).

Engine figures (KV blocks, prefix cache, preemptions, swaps, queue lengths, token totals) are not
copied into gauges as they change: ``/metrics`` fetches one ``engine.stats()`` snapshot on the
engine thread and :class:`EngineStatsCollector` renders exactly that snapshot, so a scrape always
agrees with the engine. Latency histograms are observed by the request handlers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine import DEFAULT_TENANT
from pagedkv.server.vllm_metrics import VLLMRequestMetrics, snapshot_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Up to two hours: a long generation on a CPU takes minutes, and +Inf says nothing.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                    640.0, 1280.0, 2560.0, 3600.0, 7200.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  40.0, 80.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


class EngineStatsCollector(Collector):
    """Renders the latest ``EngineStats`` snapshot handed to :meth:`set_snapshot`."""

    def __init__(self, model_name: str, public_tenants: frozenset[str] = frozenset()) -> None:
        self._model = model_name
        self._stats: Any | None = None
        # Tenants whose names may be labels (API key tenants, quota names, the default); others
        # are cache_salt values, secret to their clients, and are summed as tenant="other".
        self._public_tenants = public_tenants | {DEFAULT_TENANT}
        # (reason as its caller was told, tenant label) -> requests. Not the engine's own count, which
        # has the true reason: "different_tenant" there says another tenant holds a guessed prompt.
        self.first_misses: dict[tuple[str, str], int] = {}

    def count_first_miss(self, caller_reason: str, tenant: str) -> None:
        key = (caller_reason, self._label(tenant))
        self.first_misses[key] = self.first_misses.get(key, 0) + 1

    def set_snapshot(self, stats: Any) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are dynamic in the sense of optional; skip registry duplicate checks

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        if s is None:
            return
        kv = s.kv
        labels = ["model_name"]
        value = [self._model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagedkv_{name}", doc, labels=labels)
            g.add_metric(value, float(v))
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagedkv_{name}", doc, labels=labels)
            c.add_metric(value, float(v))
            return c

        yield gauge("kv_blocks_total", "KV-cache blocks in the pool.", kv.num_blocks)
        yield gauge("kv_block_size", "Token slots per KV-cache block.", kv.block_size)
        yield gauge("kv_blocks_free", "Blocks with no owner (cached blocks included).", kv.free_blocks)
        yield gauge("kv_blocks_used", "Blocks referenced by at least one sequence.", kv.used_blocks)
        yield gauge("kv_blocks_cached", "Blocks holding a reusable, hashed prefix.", kv.cached_blocks)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", kv.usage)
        yield gauge("kv_fragmentation_ratio", "Allocated slots holding no token (0..1).", kv.fragmentation)
        if hasattr(kv, "evictable_blocks"):
            yield gauge("kv_blocks_evictable", "Free blocks that still hold a cached prefix.", kv.evictable_blocks)
        if hasattr(kv, "host_blocks"):
            yield gauge("kv_host_blocks_total", "Blocks in the host (swap) tier.", kv.host_blocks)
            yield gauge("kv_host_blocks_used", "Host-tier blocks holding swapped-out KV.", kv.host_used_blocks)
        cache = GaugeMetricFamily("pagedkv_cache_config_info", "The KV cache's configuration (value 1; "
                                  "vLLM's cache_config_info).", labels=["model_name", "block_size", "num_blocks",
                                                                        "num_host_blocks", "cache_dtype"])
        cache.add_metric([self._model, str(kv.block_size), str(kv.num_blocks), str(getattr(kv, "host_blocks", 0)),
                          str(getattr(s, "kv_cache_dtype", ""))], 1.0)
        yield cache
        if getattr(s, "kv_bytes_per_block", 0):
            info = GaugeMetricFamily("pagedkv_kv_cache_dtype_info", "The KV block format (value 1).",
                                     labels=["model_name", "kv_cache_dtype"])
            info.add_metric([self._model, s.kv_cache_dtype], 1.0)
            yield info
            yield gauge("kv_bytes_per_block", "Bytes of one KV block (all layers, K and V, scales).",
                        s.kv_bytes_per_block)
        if getattr(s, "kv_quant_error", None) is not None:
            err = GaugeMetricFamily(
                "pagedkv_kv_quant_relative_error",
                "Relative RMS error of the K/V rows stored in 8-bit blocks, per layer, since start.",
                labels=["model_name", "layer", "kv"])
            for layer, (k_err, v_err) in enumerate(s.kv_quant_error):
                err.add_metric([self._model, str(layer), "k"], k_err)
                err.add_metric([self._model, str(layer), "v"], v_err)
            yield err
        yield gauge("kv_filled_slots", "Token slots holding a token.", kv.filled_slots)
        yield gauge("kv_allocated_slots", "Token slots in allocated blocks.", kv.allocated_slots)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_hit_tokens)
        yield counter("kv_evictions", "Cached blocks evicted to make room.", kv.evictions)
        if hasattr(kv, "host_hit_tokens"):
            yield counter("prefix_cache_host_hits", "Prompt tokens found in the host tier (reloaded, not "
                          "recomputed; included in prefix_cache_hits).", kv.host_hit_tokens)
            yield counter("kv_offloaded_blocks", "Cached blocks copied down to the host tier on eviction.",
                          kv.offloaded_blocks)
            yield counter("kv_offloads_dropped", "Evicted cached blocks not offloaded (no host block free).",
                          kv.offloads_dropped)
            yield counter("kv_reloaded_blocks", "Host-tier blocks copied back up for a prompt's prefix.",
                          kv.reloaded_blocks)
            yield gauge("kv_host_blocks_cached", "Host-tier blocks holding an offloaded prefix block.",
                        kv.host_cached_blocks)
        if hasattr(kv, "tier_hit_tokens"):
            yield from self._tier_metrics(s, kv, gauge, counter)
        yield counter("kv_cow_copies", "Copy-on-write block copies.", kv.cow_copies)
        yield counter("kv_rolled_back_blocks", "Blocks given back by rejected speculative tokens.",
                      getattr(kv, "rolled_back_blocks", 0))
        yield counter("kv_window_released_blocks", "Sliding-window blocks released once out of every "
                      "query's window (hybrid models).", getattr(kv, "window_released_blocks", 0))

        pre = CounterMetricFamily(
            "pagedkv_preemptions", "Sequences preempted, by mode.", labels=["model_name", "mode"]
        )
        pre.add_metric([self._model, "recompute"], float(s.preemptions_recompute))
        pre.add_metric([self._model, "swap"], float(s.preemptions_swap))
        yield pre
        swapped = CounterMetricFamily(
            "pagedkv_swapped_blocks", "Blocks copied between device and host tier, by direction.",
            labels=["model_name", "direction"],
        )
        swapped.add_metric([self._model, "out"], float(kv.swapped_out_blocks))
        swapped.add_metric([self._model, "in"], float(kv.swapped_in_blocks))
        yield swapped

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to the host tier.", s.num_swapped)
        yield counter("prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        if hasattr(s, "num_steps"):
            yield counter("engine_steps", "Engine scheduling steps run.", s.num_steps)
        if getattr(s, "spec_accepted_per_position", ()):  # speculative decoding is on
            yield from self._spec_metrics(s, counter, gauge)
        yield from self._vllm_metrics(s, kv)
        if getattr(s, "lora", None) is not None:  # LoRA adapters (server/lora.py)
            from pagedkv.server.lora import lora_metrics
            yield from lora_metrics(self._model, s.lora)
        if getattr(kv, "tenants", None):
            yield from self._tenant_metrics(kv)
        if self.first_misses:
            misses = CounterMetricFamily(
                "pagedkv_prefix_cache_first_miss", "Requests by why the first block of their prompt that "
                "was not a prefix-cache hit missed (none: every block that could hit did), as the request's "
                "caller may see it: a block only another tenant holds counts as never_seen (or partial_block).",
                labels=["model_name", "reason", "tenant"])
            for (reason, tenant), n in sorted(self.first_misses.items()):
                misses.add_metric([self._model, reason, tenant], float(n))
            yield misses

    def _vllm_metrics(self, s: Any, kv: Any) -> Iterator[Metric]:
        """The same figures under vLLM's names (labels ``model_name``, ``engine``), for the routers
        and gateways that read them: the Gateway API Inference Extension's endpoint picker,
        vLLM's production-stack router, Dynamo, SMG. Always exported."""
        labels, value = ["model_name", "engine"], [self._model, "0"]

        def family(kind, name: str, doc: str, v: float):
            m = kind(f"vllm:{name}", doc, labels=labels)
            m.add_metric(value, float(v))
            return m

        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", s.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield family(GaugeMetricFamily, "num_requests_swapped", "Requests swapped out to the host tier.",
                     s.num_swapped)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", kv.usage)
        yield family(GaugeMetricFamily, "gpu_cache_usage_perc", "KV-cache usage: 1 means 100 percent (the legacy "
                     "name older routers scrape; the device here may be a CPU).", kv.usage)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     kv.prefix_query_tokens)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     kv.prefix_hit_tokens)
        yield family(CounterMetricFamily, "num_preemptions", "Sequences preempted.",
                     s.preemptions_recompute + s.preemptions_swap)
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield family(CounterMetricFamily, "generation_tokens", "Tokens generated.", s.generation_tokens_total)
        if getattr(s, "spec_accepted_per_position", ()):  # speculative decoding is on (vLLM V1's names)
            yield family(CounterMetricFamily, "spec_decode_num_drafts", "Verifications of a proposal.",
                         s.spec_num_drafts)
            yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Tokens proposed.",
                         s.spec_draft_tokens)
            yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                         s.spec_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens by their position in the proposal.",
                                          labels=[*labels, "position"])
            for i, n in enumerate(s.spec_accepted_per_position):
                per_pos.add_metric([*value, str(i)], float(n))
            yield per_pos
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache's configuration (value 1).",
                                   labels=["model_name", "engine", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                           "cache_dtype", "enable_prefix_caching"])
        config.add_metric([self._model, "0", str(kv.block_size), str(kv.num_blocks),
                           str(getattr(kv, "host_blocks", 0)), str(getattr(s, "kv_cache_dtype", "auto")),
                           str(getattr(s, "enable_prefix_caching", True))], 1.0)
        yield config
        yield from snapshot_families(self._model, s, kv)  # vllm:prompt_tokens_cached and by source

    def _spec_metrics(self, s: Any, counter, gauge) -> Iterator[Metric]:
        """Speculative decoding (vLLM's spec_decode metrics, pagedkv's names)."""
        yield counter("spec_decode_num_drafts", "Verifications: a sequence's proposal checked in a step.",
                      s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Tokens proposed.", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.",
                      s.spec_accepted_tokens)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed tokens since start.", s.spec_acceptance_rate)
        yield gauge("spec_decode_mean_accepted_length", "Tokens emitted per verification (accepted + 1) since start.",
                    s.spec_mean_accepted_length)
        per_pos = CounterMetricFamily("pagedkv_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens by their position in the proposal.",
                                      labels=["model_name", "position"])
        for i, n in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric([self._model, str(i)], float(n))
        yield per_pos

    def _label(self, tenant: str) -> str:
        return tenant if tenant in self._public_tenants else "other"

    def _tenant_metrics(self, kv: Any) -> Iterator[Metric]:
        """Per-tenant KV quotas: blocks held, of them cached, the limit, and allocations refused."""
        rows: dict[str, list[float]] = {}
        for tenant, (held, cached, limit) in kv.tenants.items():
            row = rows.setdefault(self._label(tenant), [0, 0, 0, 0])
            row[0] += held
            row[1] += cached
            row[2] += limit or 0
        for tenant, waits in kv.tenant_quota_waits.items():
            rows.setdefault(self._label(tenant), [0, 0, 0, 0])[3] += waits
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("pagedkv_tenant_kv_blocks", "Device KV blocks a tenant holds (in use plus cached).",
                              labels=["model_name", "tenant"]),
            GaugeMetricFamily("pagedkv_tenant_kv_blocks_cached", "Of those, blocks only caching a prefix.",
                              labels=["model_name", "tenant"]),
            GaugeMetricFamily("pagedkv_tenant_kv_quota_blocks", "The tenant's quota in blocks (0: none).",
                              labels=["model_name", "tenant"]),
            CounterMetricFamily("pagedkv_tenant_quota_waits", "Allocations a tenant's quota refused (its "
                                "request waited or its own work gave way).", labels=["model_name", "tenant"]),
        ]
        for tenant, row in sorted(rows.items()):
            for family, v in zip(families, row):
                family.add_metric([self._model, tenant], float(v))
        yield from families


    def _tier_metrics(self, s: Any, kv: Any, gauge, counter) -> Iterator[Metric]:
        """Per-tier hits and misses, the disk and remote tiers' I/O and the reload-or-recompute decisions."""
        def per_tier(name: str, doc: str, values: dict[str, int]) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagedkv_{name}", doc, labels=["model_name", "tier"])
            for tier, v in values.items():
                c.add_metric([self._model, tier], float(v))
            return c

        yield per_tier("kv_tier_hit_tokens", "Prompt tokens found in each KV tier (disk hits are reloaded "
                       "through the host tier and counted there too).", kv.tier_hit_tokens)
        yield per_tier("kv_tier_miss_tokens", "Prompt tokens a KV tier was asked for and did not hold.",
                       kv.tier_miss_tokens)
        if kv.disk_capacity_bytes:
            yield gauge("kv_disk_enabled", "1 while the disk tier writes blocks (0 after a write error).",
                        kv.disk_enabled)
            yield gauge("kv_disk_blocks", "Blocks stored in the disk tier.", kv.disk_blocks)
            yield gauge("kv_disk_bytes_used", "Bytes of block files in the disk tier.", kv.disk_bytes_used)
            yield gauge("kv_disk_capacity_bytes", "Size of the disk tier.", kv.disk_capacity_bytes)
            yield gauge("kv_offload_queue_depth", "Blocks waiting for the disk writer.", kv.disk_queue_depth)
            yield counter("kv_disk_writes_dropped", "Evicted blocks not written to disk: the queue was full.",
                          kv.disk_writes_dropped)
            yield counter("kv_disk_corrupt_discarded", "Disk block files that failed a check and were "
                          "deleted (their tokens recomputed).", kv.disk_corrupt_discarded)
            yield counter("kv_disk_read_errors", "Disk tier reads that failed (tokens recomputed).",
                          kv.disk_read_errors)
            yield counter("kv_disk_write_errors", "Disk tier writes that failed (writing stops).",
                          kv.disk_write_errors)
        remote = getattr(kv, "remote_enabled", False)
        written = {**({"disk": kv.disk_bytes_written} if kv.disk_capacity_bytes else {}),
                   **({"remote": kv.remote_bytes_written} if remote else {})}
        if written:
            yield per_tier("kv_tier_bytes_written", "Bytes written to a KV tier below the device.", written)
            yield per_tier("kv_tier_bytes_read", "Bytes read from a KV tier below the device.",
                           {**({"disk": kv.disk_bytes_read} if kv.disk_capacity_bytes else {}),
                            **({"remote": kv.remote_bytes_read} if remote else {})})
        if remote:  # a server shared by replicas (its URL is never shown: it may hold a password)
            yield gauge("kv_remote_connected", "1 while the remote tier's server answers (0 while backing off).",
                        kv.remote_connected)
            yield gauge("kv_remote_queue_depth", "Blocks waiting for the remote tier's writer.", kv.remote_queue_depth)
            yield counter("kv_remote_blocks_written", "Blocks this replica wrote to the remote tier.",
                          kv.remote_blocks_written)
            yield counter("kv_remote_blocks_read", "Blocks read from the remote tier (written by any replica).",
                          kv.remote_blocks_read)
            yield counter("kv_remote_already_present", "Remote writes skipped: the server had the block.",
                          kv.remote_already_present)
            yield counter("kv_remote_writes_dropped", "Blocks not written to the remote tier: its queue was full "
                          "or the server unreachable.", kv.remote_writes_dropped)
            yield counter("kv_remote_misses", "Remote reads of blocks the server no longer had (evicted, "
                          "flushed).", kv.remote_misses)
            yield counter("kv_remote_corrupt_discarded", "Remote values that failed a check (checksum, format "
                          "version, key, size) and were deleted (their tokens recomputed).",
                          kv.remote_corrupt_discarded)
            yield counter("kv_remote_errors", "Remote tier round trips that failed: the server down, slow or "
                          "refusing (blocks recomputed or not written).", kv.remote_errors)
            yield counter("kv_remote_reconnects", "Times the remote tier's server answered again after failing.",
                          kv.remote_reconnects)
        costs = getattr(s, "tier_costs", None)
        if costs:
            decisions = CounterMetricFamily(
                "pagedkv_kv_tier_decisions", "Reload-or-recompute decisions (prefix found in a lower tier) "
                "and swap-or-recompute decisions (preemption), by the engine's measured costs.",
                labels=["model_name", "decision"])
            for key, v in costs.items():
                if key.startswith("decisions_"):
                    decisions.add_metric([self._model, key[len("decisions_"):]], float(v or 0))
            yield decisions
            cost = GaugeMetricFamily("pagedkv_kv_tier_cost_seconds", "Measured seconds per block: recomputing "
                                     "it (prefill), host copies down and up, disk reads.",
                                     labels=["model_name", "what"])
            for key, v in costs.items():
                if key.endswith("_s_per_block") and v is not None:
                    cost.add_metric([self._model, key[:-len("_s_per_block")]], float(v))
            yield cost


class ServerMetrics:
    """The registry of one app: the engine collector plus the handlers' histograms and counters."""

    def __init__(self, model_name: str, public_tenants: frozenset[str] = frozenset(),
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine = EngineStatsCollector(model_name, public_tenants)
        self.registry.register(self.engine)
        labels = ["model_name"]
        self._model = model_name
        self.time_to_first_token = Histogram(
            "pagedkv_time_to_first_token_seconds", "Time from request arrival to its first token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pagedkv_time_per_output_token_seconds", "Mean time between output tokens after the first.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "pagedkv_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        # vLLM's request phases, from the engine's timestamps (RequestOutput.metrics)
        self.phases = {phase: Histogram(
            f"pagedkv_request_{phase}_time_seconds", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
            for phase, doc in (
                ("queue", "Time from arrival until the request is first computed (waiting in the queue)."),
                ("prefill", "Time from the request's first computation to its first token."),
                ("decode", "Time from the request's first token to its last."),
                ("inference", "Time from the request's first computation to its last token."))}
        self.inter_token_latency = Histogram(
            "pagedkv_inter_token_latency_seconds", "Time between successive output tokens of a request.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.iteration_tokens = Histogram(
            "pagedkv_iteration_tokens_total", "Tokens computed per engine step (prefill and decode).",
            labels, buckets=_ITERATION_BUCKETS, registry=self.registry)
        self.prompt_tokens = Histogram(
            "pagedkv_request_prompt_tokens", "Prompt tokens per request.", labels,
            buckets=_TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.generation_tokens = Histogram(
            "pagedkv_request_generation_tokens", "Generated tokens per request (all its completions).", labels,
            buckets=_TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.requests_finished = Counter(
            "pagedkv_requests_finished", "Completions finished, by finish reason (stop, length, abort).",
            ["model_name", "finish_reason"], registry=self.registry,
        )
        self.request_errors = Counter(
            "pagedkv_request_errors", "Requests answered with an error, by HTTP status.",
            ["model_name", "status"], registry=self.registry,
        )
        # the same observations under vLLM's names and buckets (server/vllm_metrics.py)
        self.vllm = VLLMRequestMetrics(self.registry, model_name, max_model_len)
        self._max_model_len = max_model_len or 0

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int) -> None:
        if ttft is not None:
            self.time_to_first_token.labels(self._model).observe(ttft)
            self.vllm.ttft.observe(ttft)
            if num_output_tokens > 1:
                tpot = (e2e - ttft) / (num_output_tokens - 1)
                self.time_per_output_token.labels(self._model).observe(tpot)
                self.vllm.tpot.observe(tpot)
        self.e2e_latency.labels(self._model).observe(e2e)
        self.vllm.e2e.observe(e2e)

    def observe_phases(self, times: dict[str, float], prompt_tokens: int, generation_tokens: int) -> None:
        """A finished request's phases from its engine timestamps (``RequestOutput.metrics``)."""
        spans = {"queue": ("arrival_time", "first_scheduled_time"),
                 "prefill": ("first_scheduled_time", "first_token_time"),
                 "decode": ("first_token_time", "last_token_time"),
                 "inference": ("first_scheduled_time", "last_token_time")}
        for phase, (start, end) in spans.items():
            if start in times and end in times:
                self.phases[phase].labels(self._model).observe(max(times[end] - times[start], 0.0))
                self.vllm.phases[phase].observe(max(times[end] - times[start], 0.0))
        self.prompt_tokens.labels(self._model).observe(prompt_tokens)
        self.generation_tokens.labels(self._model).observe(generation_tokens)
        self.vllm.prompt_tokens.observe(prompt_tokens)
        self.vllm.generation_tokens.observe(generation_tokens)

    def observe_finished(self, outputs: Any, n: int, max_tokens: int | None) -> None:
        """Finished requests' parameters and counts under vLLM's names (vllm:request_params_n, ...)."""
        self.vllm.observe_finished(outputs, n, max_tokens, self._max_model_len)

    def observe_inter_token(self, gaps: list[float]) -> None:
        child = self.inter_token_latency.labels(self._model)
        for gap in gaps:
            child.observe(gap)
            self.vllm.inter_token.observe(gap)
            self.vllm.tpot_legacy.observe(gap)

    def observe_iteration(self, num_tokens: int) -> None:
        """One engine step's token count (called on the engine thread; prometheus_client locks)."""
        self.iteration_tokens.labels(self._model).observe(num_tokens)
        self.vllm.iteration_tokens.observe(num_tokens)

    def count_finish(self, reason: str | None) -> None:
        self.requests_finished.labels(self._model, reason or "abort").inc()
        success = self.vllm.success.get(reason or "abort")
        if success is not None:
            success.inc()

    def count_first_miss(self, caller_reason: str, tenant: str) -> None:
        """A finished request's first prefix-cache miss, by the reason its caller may see."""
        self.engine.count_first_miss(caller_reason, tenant)

    def count_error(self, status: int) -> None:
        self.request_errors.labels(self._model, str(status)).inc()
        if status == 429:  # the queue was full (--max-queue)
            self.vllm.queue_full.inc()

    def render(self, stats: Any) -> bytes:
        """The exposition text for this engine snapshot (call on the event loop, not concurrently)."""
        self.engine.set_snapshot(stats)
        return generate_latest(self.registry)
