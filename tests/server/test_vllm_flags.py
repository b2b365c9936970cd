"""vLLM's ``vllm serve`` command lines: every flag of vLLM 0.32.0's ``vllm serve --help=all``
(tests/data/vllm_0.32.0_serve_help.txt, made by tests/data/make_vllm_serve_help.py) works, is a
no-op with a warning, or is refused naming the flag and why with serve's usage; --max-model-len
beyond the model; CORS preflights; the server-side max-tokens cap."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedkv.cli import build_parser, main
from pagedkv.server.cors import CORSOptions, install_cors
from pagedkv.server.vllm_flags import FLAGS, check_max_model_len, generation_overrides
from pagedkv_testing import TEST_DATA
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

HELP = TEST_DATA / "vllm_0.32.0_serve_help.txt"


def _vllm_options() -> list[tuple[list[str], bool]]:
    """(option strings, takes a value) of each flag in vLLM's help text."""
    out = []
    for line in HELP.read_text().splitlines():
        m = re.match(r"^  (-[^ ].*?)(\s{2,}.*)?$", line)
        if m:
            parts = m.group(1).split(", ")
            out.append(([p.split()[0] for p in parts if p.startswith("-")], any(len(p.split()) > 1 for p in parts)))
    return out


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_vllm_serve_flag_is_classified() -> None:
    options = _vllm_options()
    assert len(options) > 300  # the whole --help=all, not a section of it
    serve = _serve_parser()
    works = {s for a in serve._actions for s in a.option_strings if a.help != argparse.SUPPRESS}
    unclassified, wrong_arity = [], []
    for names, takes_value in options:
        for name in names:
            if name in ("-h", "--help") or name in works:
                continue
            flag = FLAGS.get(name) or FLAGS.get(name.replace("--no-", "--", 1))
            if flag is None:
                if name not in serve._option_string_actions:  # else an alias of a flag pagedkv has (-q)
                    unclassified.append(name)
            elif flag.switch == takes_value:
                wrong_arity.append(name)
    assert not unclassified, f"vLLM flags neither taken, a no-op nor refused: {unclassified}"
    assert not wrong_arity, f"vLLM flags whose value-taking differs from vLLM's: {wrong_arity}"
    shown = {name for names, _ in options for name in names}
    assert {"--max-model-len", "--allowed-origins", "--enable-log-requests", "--override-generation-config",
            "--kv-cache-memory-bytes", "--speculative-config", "--api-key"} <= shown & works


def test_flags_that_work_parse_as_pagedkv_options() -> None:
    args = build_parser().parse_args(["serve", "m", "--max-num-seqs", "3", "-q", "q8_0", "--uvicorn-log-level", "debug",
                                      "--no-enable-log-requests", "--allowed-origins", '["http://a"]',
                                      "--no-allow-credentials"])
    assert args.max_num_seqs == 3 and args.quantization == "q8_0" and args.log_level == "debug"
    assert args.disable_log_requests and args.allowed_origins == ['["http://a"]'] and args.allow_credentials is False
    assert args.vllm_warnings == []


def test_noop_flags_warn_one_line_each() -> None:
    args = build_parser().parse_args(["serve", "m", "--trust-remote-code", "--gpu-memory-utilization", "0.9",
                                      "--pipeline-parallel-size", "1", "--enforce-eager", "--disable-log-stats"])
    assert args.disable_log_stats
    warnings = args.vllm_warnings
    assert len(warnings) == 4 and all("\n" not in w and "is accepted and has no effect" in w for w in warnings)
    assert warnings[0].startswith("--trust-remote-code is accepted") and "never runs a model's own code" in warnings[0]
    assert warnings[1].startswith("--gpu-memory-utilization 0.9") and "--kv-cache-memory-bytes" in warnings[1]
    assert warnings[2].startswith("--pipeline-parallel-size 1")


@pytest.mark.parametrize("argv, expected", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2 is not supported: pagedkv runs one engine"),
    (["--device", "cuda", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization 0.9 is not supported"),
    (["--uds", "/tmp/s"], "--uds /tmp/s is not supported: no Unix-socket listener"),
    (["--enable-request-id-headers"], "--enable-request-id-headers is not supported"),
    (["--task", "embed"], "--task embed is not supported: pagedkv generates text"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_refused_flags_name_the_flag_with_serve_usage(argv: list[str], expected: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedkv serve") and expected in err
    assert err.strip().splitlines()[-1].startswith("pagedkv serve: error: ")


def test_max_model_len_beyond_the_model(tmp_path: Path) -> None:
    check_max_model_len(1024, 1024)
    with pytest.raises(ValueError, match=r"--max-model-len 5000 is greater than the model's own context length "
                                         r"\(max_position_embeddings=1024\).*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        check_max_model_len(5000, 1024)
    model = write_tiny_model(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "pagedkv.server.cli", str(model), "--max-model-len", "5000", "--port", "0",
           "--num-kv-blocks", "64"]
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOW_LONG_MAX_MODEL_LEN")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pagedkv serve: --max-model-len 5000 is greater than the model's own context length" in proc.stderr
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    try:
        check_max_model_len(5000, 1024)  # forced, as vLLM's variable does
    finally:
        del os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"]


def test_generation_overrides() -> None:
    assert generation_overrides('{"max_new_tokens": 7, "temperature": 0.5}', None) == {"max_tokens": 7,
                                                                                        "temperature": 0.5}
    assert generation_overrides('{"max_new_tokens": 7}', 3) == {"max_tokens": 3}
    with pytest.raises(ValueError, match="--override-generation-config: unknown key 'colour'"):
        generation_overrides('{"colour": 1}', None)
    with pytest.raises(ValueError, match="--max-tokens-default: max_tokens=0"):
        generation_overrides(None, 0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    return tiny_engine(write_tiny_model(tmp_path_factory.mktemp("flags") / "tiny"), num_kv_blocks=128, seed=0)


def test_cors_preflight_with_and_without_allowed_origins(engine) -> None:
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with ServerThread(engine, api_key="k") as server:  # no CORS flag: CORS off
        r = httpx.options(f"{server.base_url}/chat/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    server = ServerThread(engine, api_key="k")
    install_cors(server.app, CORSOptions(origins=("http://ui.example",)))
    with server:
        r = httpx.options(f"{server.base_url}/chat/completions", headers=preflight)
        assert r.status_code == 200  # before the API key check: a preflight carries no key
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        other = httpx.options(f"{server.base_url}/chat/completions", headers={**preflight, "Origin": "http://evil"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"


def test_server_side_max_tokens_cap(engine) -> None:
    saved = dict(engine.generation_defaults)
    chat = {"messages": [{"role": "user", "content": "tell me everything"}], "ignore_eos": True}
    try:
        engine.generation_defaults.update(generation_overrides('{"max_new_tokens": 7}', None))
        with ServerThread(engine) as server:
            r = httpx.post(f"{server.base_url}/chat/completions", json=chat, timeout=60).json()
            assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
            r = httpx.post(f"{server.base_url}/chat/completions", json={**chat, "max_tokens": 9}, timeout=60).json()
            assert r["usage"]["completion_tokens"] == 9  # a request's own max_tokens wins
        engine.generation_defaults.update(generation_overrides(None, 4))  # --max-tokens-default 4
        with ServerThread(engine) as server:
            r = httpx.post(f"{server.base_url}/chat/completions", json=chat, timeout=60).json()
            assert r["usage"]["completion_tokens"] == 4
    finally:
        engine.generation_defaults.clear()
        engine.generation_defaults.update(saved)
