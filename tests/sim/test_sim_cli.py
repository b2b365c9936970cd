"""``python -m pagedkv.sim simulate|size``: JSON contract, table, plot, errors, and no torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.sim.cli import add_simulate_parser, add_size_parser, main
from pagedkv_testing import REPO_ROOT

ROOT = REPO_ROOT
SMALL = ["--num-requests", "40", "--kv-tokens", "8192", "--quiet"]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedkv.sim", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_importing_the_simulator_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pagedkv.sim, pagedkv.sim.cli, pagedkv.sim.simulator, pagedkv.sim.sizing\n"
        "import pagedkv.sim.report, pagedkv.sim.model_spec\n"
        "from pagedkv.sim.cli import main\n"
        "assert main(['simulate', '--num-requests', '20', '--kv-tokens', '4096', '--quiet',\n"
        "             '--policies', 'contiguous-max,buddy,paged+prefix+cow@16']) == 0\n"
        "assert main(['size', 'llama-3-8b']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'matplotlib', 'gguf') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_simulate_json_is_one_object_with_policies() -> None:
    out = _run_cli("simulate", "--json", *SMALL, "--policies",
                   "contiguous-max,contiguous-oracle,buddy,paged,paged+prefix@16,paged+cow@16",
                   "--block-sizes", "8,16", "--n", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = [p["name"] for p in data["policies"]]
    assert names == ["contiguous-max", "contiguous-oracle", "buddy", "paged@8", "paged@16",
                     "paged+prefix@16", "paged+cow@16"]
    for entry in data["policies"]:
        for key in ("name", "block_size", "waste", "mean_concurrency", "peak_concurrency",
                    "preemptions", "internal_frag", "external_frag", "prefix_hit_rate",
                    "throughput"):
            assert key in entry
        assert 0.0 <= entry["waste"] <= 1.0
    assert data["policies"][0]["block_size"] is None and data["policies"][3]["block_size"] == 8
    assert data["kv_tokens"] == 8192 and data["workload"]["num_requests"] == 40


def test_simulate_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert main(["simulate", *SMALL, "--policies", "contiguous-max,paged", "--block-sizes",
                 "4,16,64", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "waste" in text and "paged@64" in text and "contiguous-max" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_from_a_trace_and_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_len,output_len,n,beam_width,prefix_id\n" +
                     "".join(f"{50 + i},{10 + i},1,1,{i % 2}\n" for i in range(20)))
    assert main(["simulate", "--trace", str(trace), "--prefix-len", "32", "--quiet", "--json",
                 "--model", "smollm2-135m", "--device-memory", "1GiB",
                 "--policies", "paged+prefix@16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["num_requests"] == 20
    assert data["kv_tokens"] == (2**30 - int(0.1 * 2**30) - 134_515_008 * 2) // 23_040
    assert data["policies"][0]["prefix_hit_rate"] > 0.3


@pytest.mark.parametrize("args, flag", [
    (["simulate", "--block-sizes", "0"], "--block-sizes"),
    (["simulate", "--policies", "paged+magic"], "--policies"),
    (["simulate", "--prompt-len", "fixed:-3"], "--prompt-len"),
    (["simulate", "--kv-tokens", "0"], "--kv-tokens"),
    (["simulate", "--eviction-policy", "random"], "--eviction-policy"),
    (["size", "not-a-model"], "MODEL"),
    (["size", "llama-2-70b", "--tp", "3"], "--tp"),
    (["size", "llama-2-7b", "--device-memory", "lots"], "--device-memory"),
])
def test_bad_arguments_exit_2_naming_the_flag(args: list[str], flag: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert flag in capsys.readouterr().err


def test_size_json_worked_example() -> None:
    out = _run_cli("size", "llama-2-7b", "--kv-dtype", "fp8", "--block-size", "32",
                   "--max-len", "4096", "--kv-memory", "71GB", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["kv_bytes_per_token"], data["block_bytes"], data["num_blocks"],
            data["max_concurrent_at_max_len"]) == (262_144, 8_388_608 + 8_192, 8455, 66)  # + fp8 scales
    for key in ("max_concurrent_steady", "recommended_block_size", "recommendation"):
        assert key in data


def test_parsers_plug_into_a_parent_cli() -> None:
    parser = argparse.ArgumentParser(prog="pagedkv")
    sub = parser.add_subparsers(dest="command")
    add_simulate_parser(sub)
    add_size_parser(sub)
    args = parser.parse_args(["size", "mistral-7b", "--tp", "2"])
    assert args.func.__name__ == "run_size" and args.tp == 2
    args = parser.parse_args(["simulate", "--rate", "0.5"])
    assert args.func.__name__ == "run_simulate" and args.rate == 0.5


def test_top_level_pagedkv_command_runs_size_and_simulate() -> None:
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "size", "llama-2-70b", "--tp", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_bytes_per_token"] == 327_680 // 2
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "simulate", "--json", *SMALL,
                          "--policies", "paged@16"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["policies"][0]["name"] == "paged@16"
