"""The pagedkv command: every subcommand parses, and generate runs end to end on a tiny model."""

import subprocess
import sys

import pytest

from pagedkv.cli import build_parser, main
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "simulate", "size"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert command in capsys.readouterr().out


def test_generate_prints_a_completion(tmp_path):
    from pagedkv_testing.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(folder), "--prompt",
           "hello world", "--max-tokens", "5", "--ignore-eos", "--num-kv-blocks", "32", "--stats"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "blocks used" in out.stderr and "KV dtype float32" in out.stderr and out.stdout.strip()
    assert "prefix cache: 0/3 prompt tokens hit" in out.stderr and "first miss per request: none 1" in out.stderr


def test_generate_with_an_int8_kv_cache(tmp_path):
    from pagedkv.ops import native
    from pagedkv_testing.tiny_model import write_tiny_model
    if not native.available():
        pytest.skip("8-bit KV blocks need the native kernels")
    folder = write_tiny_model(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(folder), "--prompt",
           "hello world", "--max-tokens", "5", "--ignore-eos", "--num-kv-blocks", "32", "--stats",
           "--kv-cache-dtype", "int8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "KV dtype int8" in out.stderr and "quantization error" in out.stderr and out.stdout.strip()


def test_generate_reports_bad_flags_clearly(tmp_path, capsys):
    folder = make_hf_checkpoint(tmp_path, "llama")
    code = main(["generate", "--model", str(folder), "--prompt", "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "--prompt", "x", "--block-size", "8"])
    assert args.block_size == 8


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "/no/such/model", "--prompt", "x"],
    ["bench", "--model", "/no/such/model.gguf"],
    ["generate", "--prompt", "x", "--kv-cache-memory", "lots"],
])
def test_user_errors_are_one_line_without_a_traceback(argv):
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pagedkv {argv[0]}: "), out.stderr
