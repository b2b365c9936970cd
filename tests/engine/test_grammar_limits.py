"""Issue 27, items 1 and 11: structured output with bounded cost, and errors that stay small.

Each probe runs with /health polled beside it (every answer a 200 within 1 s) and victim streams
beside it (time to first token <= 10 s, longest inter-token gap <= 5 s, default flags):

- against a ``pagedkv serve`` process (its RSS is its own: within 5% of before after each probe):
  an ``allOf`` of 30 ``.*x.*`` patterns (once killed the server: minutes, 8 GB), 300,000 choices
  (refused by a count check before any work), a 10,000-property schema (stalled generation 55 s,
  then a 500); each answered within a bound, a 200 or a 400 naming the limit, in a small body;
- against an in-process server whose engine has few lexer states (``grammar_max_lexer_states``):
  a repeated schema compiles once (the compiler's counters), and a grammar that hits that limit
  mid-generation ends that sequence with finish_reason "length" (a 200, not a 500), its log line
  short.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pagedkv_testing.latency_probe import HealthProbe, rss_bytes, victim_streams
from pagedkv_testing.server import ServerThread, free_port, spawn_server, stop_server, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(240), pytest.mark.serial]

SMALL_ERROR = 1000  # bytes: the most any error body here may take (the inputs are megabytes)


def settled_rss(pid: int) -> int:
    """RSS once it stops moving (freed memory is handed back shortly after a request ends)."""
    last = rss_bytes(pid)
    for _ in range(16):
        time.sleep(0.25)
        now = rss_bytes(pid)
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


class Spawned:
    """A ``pagedkv serve`` process; its output is read on a thread (kept for the log checks)."""

    def __init__(self, proc, port: int) -> None:
        self.proc, self.url = proc, f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-grammar"))


@pytest.fixture(scope="module")
def spawned(model_dir: Path) -> Iterator[Spawned]:
    port = free_port()
    proc, _ = spawn_server([str(model_dir), "--port", str(port), "--served-model-name", "tiny",
                            "--max-model-len", "1024", "--num-kv-blocks", "512", "--block-size", "16"])
    try:
        yield Spawned(proc, port)
    finally:
        stop_server(proc)


@contextmanager
def watched(url: str, rss_pid: int | None = None) -> Iterator[None]:
    """/health polled every 0.1 s and victim streams (one after another) while the block runs;
    on exit asserts each /health answered 200 within 1 s, each victim's first token came within
    10 s and no gap between its tokens exceeded 5 s, and (given ``rss_pid``) that process's RSS
    is within 5% of before."""
    before = settled_rss(rss_pid) if rss_pid is not None else 0
    with victim_streams(url, HealthProbe(url, interval=0.1)):
        yield
    if rss_pid is not None:
        after = settled_rss(rss_pid)
        assert after <= before * 1.05, (before >> 20, after >> 20)


def post(url: str, body: dict, bound_s: float) -> httpx.Response:
    """POST a completion; the answer must come within ``bound_s`` seconds."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 8, **body},
                   timeout=bound_s + 30)
    took = time.monotonic() - t0
    assert took <= bound_s, f"answered in {took:.1f} s, bound {bound_s} s"
    return r


def assert_refused(r: httpx.Response, param: str, limits: tuple[str, ...]) -> None:
    """A 400 naming the field and one of ``limits``, in a small body."""
    assert r.status_code == 400, r.text[:SMALL_ERROR]
    assert len(r.content) <= SMALL_ERROR, len(r.content)
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "grammar_limit_exceeded", error
    assert any(limit in error["message"] for limit in limits), error["message"]


ALL_OF = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i % 26)}{i // 26 or ''}.*"} for i in range(30)]}
TIME_OR_MEMORY = ("grammar_compile_timeout_s", "grammar_memory_mib", "initial_lexer_fuel", "max_lexer_states")


def test_all_of_thirty_patterns_is_refused_and_kills_nothing(spawned: Spawned) -> None:
    with watched(spawned.url, spawned.proc.pid):
        r = post(spawned.url, {"guided_json": ALL_OF}, bound_s=30)  # the 10 s compile limit, and slack
    assert_refused(r, "guided_json", TIME_OR_MEMORY)
    # the same text again: the refusal is remembered, nothing compiles
    t0 = time.monotonic()
    assert_refused(post(spawned.url, {"guided_json": ALL_OF}, bound_s=5), "guided_json", TIME_OR_MEMORY)
    assert time.monotonic() - t0 < 2
    assert spawned.proc.poll() is None


def test_three_hundred_thousand_choices_are_refused_by_count(spawned: Spawned) -> None:
    choices = [f"choice number {i}" for i in range(300_000)]
    with watched(spawned.url, spawned.proc.pid):
        r = post(spawned.url, {"guided_choice": choices}, bound_s=10)
    assert_refused(r, "guided_choice", ("max_guided_choices",))
    assert "choice number 1" not in r.text


def test_ten_thousand_properties_answer_within_the_limits(spawned: Spawned) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    with watched(spawned.url, spawned.proc.pid):
        # a 400 after the 10 s compile limit; or, on a machine fast enough, two compiles (the
        # worker's, then the server's) and a short generation
        r = post(spawned.url, {"guided_json": schema, "max_tokens": 4}, bound_s=40)
    if r.status_code != 200:
        assert_refused(r, "guided_json", TIME_OR_MEMORY)


def test_no_log_line_echoes_a_grammar(spawned: Spawned) -> None:
    """Whatever the probes above made the server log, no line repeats their inputs; a long
    invalid regex is a 400 quoting a short excerpt of it."""
    r = post(spawned.url, {"guided_regex": "(" + "a" * 20_000}, bound_s=15)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert len(r.content) <= SMALL_ERROR and "a" * 300 not in r.text
    time.sleep(0.2)
    assert all(len(line) < SMALL_ERROR and "a" * 300 not in line and "SearchRegex" not in line
               for line in spawned.lines), max(spawned.lines, key=len)[:300]


# ----------------------------------------------------------------- an in-process server
@pytest.fixture(scope="module")
def few_states(model_dir: Path) -> Iterator[ServerThread]:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=512, max_model_len=512, seed=0,
                         grammar_max_lexer_states=50)
    with ServerThread(engine, served_model_names=["tiny"]) as server:
        yield server


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name"]}


def test_a_repeated_schema_compiles_once(few_states: ServerThread) -> None:
    compiler = few_states.engine.structured.compiler
    before = compiler.stats()
    schema = {**SCHEMA, "title": "compiled once"}  # a text no other test compiles
    with watched(few_states.url):
        results: list[httpx.Response] = []
        # one seed per thread (a lambda here would read i when the thread runs: all three sent seed 2)
        threads = [threading.Thread(target=lambda seed=i: results.append(
            post(few_states.url, {"guided_json": schema, "temperature": 1.0, "seed": seed}, bound_s=30)))
            for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(post(few_states.url, {"guided_json": schema}, bound_s=30))
    assert [r.status_code for r in results] == [200] * 4, [r.text[:300] for r in results]
    after = compiler.stats()
    assert after.compiled - before.compiled == 1, (before, after)
    assert after.cache_hits - before.cache_hits == 3, (before, after)


def test_a_grammar_limit_mid_generation_ends_the_sequence_with_length(
        few_states: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """[a-z]{1,40} compiles within 50 lexer states but needs more as its output grows: the
    sequences that reach the limit end with "length" before max_tokens; a 200, never a 500."""
    caplog.set_level(logging.WARNING, logger="pagedkv.engine.llm_engine")
    with watched(few_states.url):
        r = post(few_states.url, {"guided_regex": "[a-z]{1,40}", "n": 4, "temperature": 1.0, "seed": 3,
                                  "max_tokens": 60}, bound_s=30)
        streamed = httpx.post(few_states.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "x", "guided_regex": "[a-z]{1,40}", "temperature": 1.0, "seed": 4,
            "max_tokens": 60, "stream": True})
    assert r.status_code == 200, r.text[:SMALL_ERROR]
    body = r.json()
    cut = [c for c in body["choices"] if c["finish_reason"] == "length"]
    assert cut, body["choices"]
    assert body["usage"]["completion_tokens"] < 4 * 60  # cut by the grammar, not by max_tokens
    assert streamed.status_code == 200 and '"error"' not in streamed.text and "[DONE]" in streamed.text
    lines = [rec.getMessage() for rec in caplog.records if "grammar limit" in rec.getMessage()]
    assert lines and all(len(line) < 400 for line in lines), lines
    few_states.wait_idle()


# ----------------------------------------------------------------- the engine alone (offline)
def test_the_worker_memory_cap_refuses_and_the_next_grammar_compiles(model_dir: Path) -> None:
    """The allOf probe under a 64 MiB cap: the worker dies on it, the engine names the limit and
    starts another worker for the next grammar; the engine's process is untouched."""
    from pagedkv import SamplingParams, StructuredOutput
    from pagedkv.engine import RequestRejectedError
    from pagedkv.engine.grammar_compiler import GrammarLimitError

    engine = tiny_engine(model_dir, num_kv_blocks=64, grammar_memory_mib=64)
    try:
        with pytest.raises(GrammarLimitError) as info:
            engine.compile_grammar(StructuredOutput(json=ALL_OF)).result(timeout=60)
        assert info.value.limit == "grammar_memory_mib" and "--grammar-memory-mib" in str(info.value)
        assert len(str(info.value)) < 300
        engine.compile_grammar(StructuredOutput(regex="[a-c]+")).result(timeout=60)
        stats = engine.structured.compiler.stats()
        assert (stats.compiled, stats.refused, stats.worker_starts) == (1, 1, 2), stats
        # the offline path (add_request compiles, waiting) refuses the same way, naming the field
        with pytest.raises(RequestRejectedError, match="grammar_memory_mib") as rejected:
            engine.add_request("r", "hi", SamplingParams(structured_output=StructuredOutput(json=ALL_OF)))
        assert rejected.value.param == "structured_output"
    finally:
        engine.close()


def test_size_limits_refuse_before_any_compile(model_dir: Path) -> None:
    from pagedkv import StructuredOutput
    from pagedkv.engine import EngineConfig
    from pagedkv.engine.grammar_compiler import GrammarLimitError

    with pytest.raises(ValueError, match="grammar_memory_mib"):
        EngineConfig(grammar_memory_mib=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        EngineConfig(grammar_compile_timeout_s=float("nan"))
    engine = tiny_engine(model_dir, num_kv_blocks=64, max_guided_choices=3, grammar_max_spec_chars=100)
    try:
        for so, limit in [(StructuredOutput(choice=["a", "b", "c", "d"]), "max_guided_choices"),
                          (StructuredOutput(regex="a" * 101), "grammar_max_spec_chars")]:
            with pytest.raises(GrammarLimitError) as info:
                engine.compile_grammar(so)  # raised here, not in a future: no compile was queued
            assert info.value.limit == limit and limit in str(info.value)
        assert engine.structured.compiler.stats().worker_starts == 0
    finally:
        engine.close()
