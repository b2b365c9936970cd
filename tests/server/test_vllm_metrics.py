"""vLLM's metric names on a live pagedkv /metrics: every metric vLLM 0.32.0 registers
(tests/data/vllm_metrics/vllm_0.32.0_metrics.json, extracted from its package by extract.py
there) that applies here is served, with vLLM's type and bucket edges; the ones that do not
apply are listed below with why. Then vLLM's example Grafana dashboard's queries
(tests/data/vllm_metrics/grafana_queries.txt) find every series they select."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.server.vllm_metrics import request_tokens_buckets
from pagedkv_testing import TEST_DATA
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

DATA = TEST_DATA / "vllm_metrics"
VLLM = json.loads((DATA / "vllm_0.32.0_metrics.json").read_text())["metrics"]

# vLLM metrics pagedkv does not export, and why.
NOT_APPLICABLE = {
    "vllm:engine_sleep_state": "no sleep mode (--enable-sleep-mode is refused)",
    "vllm:external_prefix_cache_queries": "no KV connector: nothing is fetched from other instances",
    "vllm:external_prefix_cache_hits": "no KV connector",
    "vllm:num_requests_kv_fetch_by_stage": "no KV connector",
    "vllm:num_requests_waiting_by_reason": "one reason to wait here (no KV fetches): vllm:num_requests_waiting",
    "vllm:mm_cache_queries": "text-only models: no multimodal cache",
    "vllm:mm_cache_hits": "text-only models",
    "vllm:corrupted_requests": "vLLM's NaN-logits check (VLLM_COMPUTE_NANS_IN_LOGITS) has no counterpart",
    "vllm:watermark_requests": "no output watermarking (--watermark-config is refused)",
    "vllm:kv_block_lifetime_seconds": "vLLM's sampled KV residency metrics (--kv-cache-metrics, off by default)",
    "vllm:kv_block_idle_before_evict_seconds": "vLLM's --kv-cache-metrics, off by default",
    "vllm:kv_block_reuse_gap_seconds": "vLLM's --kv-cache-metrics, off by default",
    "vllm:request_num_preemptions": "preemptions are counted per engine (vllm:num_preemptions_total), not per request",
    "vllm:diffusion_num_denoising_steps": "no diffusion language models",
    "vllm:diffusion_num_canvas_positions": "no diffusion language models",
    "vllm:diffusion_num_committed_tokens": "no diffusion language models",
}
# Exported only when the feature is on (tests of the feature check them).
WHEN_ON = {
    "vllm:lora_requests_info": "with --enable-lora (tests/server/test_server_lora.py)",
    "vllm:spec_decode_num_drafts": "with --speculative-config",
    "vllm:spec_decode_num_draft_tokens": "with --speculative-config",
    "vllm:spec_decode_num_accepted_tokens": "with --speculative-config",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "with --speculative-config",
}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics after a few requests (streamed and not, one over the queue limit: a 429)."""
    model = write_tiny_model(tmp_path_factory.mktemp("vm") / "tiny")
    engine = tiny_engine(model, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN, seed=0)
    with ServerThread(engine, served_model_names=["tiny"]) as server:
        for body in ({"prompt": "hello there", "max_tokens": 6}, {"prompt": "hello there", "max_tokens": 3, "n": 2},
                     {"prompt": "again", "max_tokens": 4, "stream": True}):
            assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
        server.wait_idle()  # the stream's admission is released after its last chunk: let it go first
        deadline = time.monotonic() + 30
        while server.state.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.active == 0, server.state.active
        server.state.max_queue = 0  # nothing may wait: a request beyond max_num_seqs is a 429
        server.state.active = server.state.max_num_seqs
        assert httpx.post(f"{server.base_url}/completions", json={"prompt": "x"}, timeout=60).status_code == 429
        server.state.active, server.state.max_queue = 0, None
        server.wait_idle()
        return httpx.get(f"{server.url}/metrics", timeout=30).text


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_fixture_is_vllms_whole_set() -> None:
    assert len(VLLM) >= 45 and VLLM["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert set(NOT_APPLICABLE) | set(WHEN_ON) <= set(VLLM), "a listed metric vLLM 0.32.0 does not register"


def test_every_vllm_metric_that_applies_is_served(scrape: str) -> None:
    families = _families(scrape)
    missing, wrong = [], []
    for name, spec in VLLM.items():
        if name in NOT_APPLICABLE or name in WHEN_ON:
            continue
        family = families.get(name)
        if family is None:
            missing.append(name)
            continue
        kind = "gauge" if spec["type"] == "gauge" else spec["type"]
        if family.type != kind:
            wrong.append(f"{name}: {family.type}, vLLM's is {kind}")
        if spec["type"] == "histogram":
            edges = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
                           - {float("inf")})
            want = spec["buckets"] if isinstance(spec["buckets"], list) else request_tokens_buckets(MAX_MODEL_LEN)
            if edges != [float(e) for e in want]:
                wrong.append(f"{name}: buckets {edges}, vLLM's {want}")
        for s in family.samples:
            if s.labels.get("model_name") != "tiny":
                wrong.append(f"{name}: model_name {s.labels.get('model_name')!r}")
                break
    assert not missing, f"vLLM metrics not served: {missing}"
    assert not wrong, wrong


def test_the_vllm_histograms_hold_the_requests(scrape: str) -> None:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(scrape) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))]

    assert value("vllm:time_to_first_token_seconds_count") == 3  # three requests (n=2 is one, two completions)
    assert value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:request_generation_tokens_sum") == 6 + 2 * 3 + 4
    assert value("vllm:request_max_num_generation_tokens_sum") == 6 + 3 + 4
    assert value("vllm:request_params_n_sum") == 1 + 2 + 1
    assert value("vllm:request_params_max_tokens_sum") == 6 + 3 + 4
    assert value("vllm:request_success_total", finished_reason="length") == 4  # completions
    assert value("vllm:inter_token_latency_seconds_count") == 5 + 2 + 3  # a request's gaps (n=2: its longest)
    assert value("vllm:request_queue_time_seconds_count") == 3
    assert value("vllm:prompt_tokens_total") == value("vllm:request_prompt_tokens_sum")
    assert samples[("vllm:admission_rejections_total",
                    (("model_name", "tiny"), ("reason", "max_num_queued_reqs")))] == 1


def test_grafana_dashboard_queries_find_every_series(scrape: str) -> None:
    series = [(s.name, s.labels) for f in text_string_to_metric_families(scrape) for s in f.samples]
    queries = [line.split(": ", 1)[1] for line in (DATA / "grafana_queries.txt").read_text().splitlines()
               if line and not line.startswith("#")]
    assert len(queries) >= 19
    not_found = []
    for query in queries:
        for name, matchers in re.findall(r"(vllm:[a-zA-Z0-9_:]+)(\{[^}]*\})?", query):
            want = dict(re.findall(r'(\w+)="([^"]*)"', matchers.replace("$model_name", "tiny")))
            if not any(n == name and want.items() <= labels.items() for n, labels in series):
                not_found.append(f"{name}{matchers}")
    assert not not_found, f"dashboard series with no sample: {not_found}"
