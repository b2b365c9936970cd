"""vLLM's request and latency metrics under vLLM's names (``vllm:*``, labels ``model_name`` and
``engine``) with vLLM 0.32.0's bucket edges, beside pagedkv's own ``pagedkv_*`` histograms (whose
buckets reach further), so that vLLM's dashboards and alerts read a pagedkv server unchanged.

The gauges and counters taken from an engine snapshot (running, waiting, KV usage, prefix cache,
tokens) are in metrics.py's ``_vllm_metrics``; this module holds what the request handlers
observe, plus the per-source prompt-token counters taken from the snapshot.
tests/server/test_vllm_metrics.py checks the names, types and edges against the metrics vLLM 0.32.0
registers (tests/data/vllm_metrics/) and lists the ones that do not apply here, with why.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

# vLLM 0.32.0's bucket families (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason strings


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VLLMRequestMetrics:
    """The ``vllm:*`` histograms and counters request handlers observe, in ``registry``; every
    child exists from the start (as vLLM's), so a dashboard finds each series before traffic."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int | None) -> None:
        labels, self._values = ["model_name", "engine"], (model_name, "0")
        tokens = request_tokens_buckets(max_model_len or 131072)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(f"vllm:{name}", doc, labels, buckets=tuple(buckets), registry=registry).labels(
                *self._values)

        latency = REQUEST_LATENCY_BUCKETS
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                     INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        # vLLM's older name of the inter-token histogram, still on its example Grafana dashboard
        self.tpot_legacy = histogram("time_per_output_token_seconds", "Histogram of time per output token in "
                                     "seconds (vLLM's deprecated name of inter_token_latency_seconds).",
                                     INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency)
        self.phases = {
            "queue": histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               latency),
            "inference": histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", latency),
            "prefill": histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                 "request.", latency),
            "decode": histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                latency)}
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.prefill_computed = histogram("request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                          "computed during prefill (excluding cached tokens).", tokens)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*self._values, reason) for reason in FINISH_REASONS}
        rejections = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue "
                             "limit, by reason.", ["model_name", "reason"], registry=registry)
        # pagedkv's one admission limit is --max-queue: vLLM's max_num_queued_reqs
        self.queue_full = rejections.labels(model_name, "max_num_queued_reqs")
        rejections.labels(model_name, "max_num_queued_tokens")

    def observe_finished(self, outputs: Iterable[Any], n: int, max_tokens: int | None, max_model_len: int) -> None:
        """Finished requests' counts: their n and max_tokens (the rest of the context when none was
        given), most tokens of one completion, prompt tokens computed (not found in the cache)."""
        for out in outputs:
            prompt = len(out.prompt_token_ids)
            self.params_n.observe(n)
            self.params_max_tokens.observe(max_tokens if max_tokens is not None else max(max_model_len - prompt, 0))
            self.max_generation_tokens.observe(max((len(c.token_ids) for c in out.outputs), default=0))
            self.prefill_computed.observe(max(prompt - out.num_cached_tokens, 0))


def snapshot_families(model_name: str, s: Any, kv: Any) -> Iterator[Metric]:
    """vLLM's cached-prompt counters from an engine snapshot: ``prompt_tokens_cached`` and the
    per-source split (vLLM's sources device, host, disk are pagedkv's tiers)."""
    labels, values = ["model_name", "engine"], [model_name, "0"]
    cached = CounterMetricFamily("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                                 labels=labels)
    cached.add_metric(values, float(kv.prefix_hit_tokens))
    yield cached
    by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                    labels=[*labels, "source"])
    by_source.add_metric([*values, "local_compute"], float(max(s.prompt_tokens_total - kv.prefix_hit_tokens, 0)))
    by_source.add_metric([*values, "local_cache_hit"], float(kv.prefix_hit_tokens))
    by_source.add_metric([*values, "external_kv_transfer"], 0.0)
    yield by_source
    tiers = dict(getattr(kv, "tier_hit_tokens", None) or {"device": kv.prefix_hit_tokens})
    if "disk" in tiers and "host" in tiers:  # disk hits are counted in the host tier's too
        tiers["host"] = max(tiers["host"] - tiers["disk"], 0)
    per_tier = CounterMetricFamily("vllm:prompt_tokens_cached_by_source", "Number of cached prompt tokens by the "
                                   "tier their KV came from.", labels=[*labels, "source"])
    for tier in ("device", "host", "disk"):
        per_tier.add_metric([*values, tier], float(tiers.get(tier, 0)))
    yield per_tier
