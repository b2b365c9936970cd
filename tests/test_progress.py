"""A first start is never silent: the native kernels' build says so (with an empty build cache), a
built cache loads without a word, and ``LLM.generate``'s progress bar (vLLM's ``use_tqdm``) counts
the prompts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedkv.ops import native

BUILD_MESSAGE = "pagedkv: building the native CPU kernels once for this machine"


def _native_main(cache: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedkv.ops.native"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PAGEDKV_CACHE_DIR": str(cache), "PAGEDKV_NATIVE": "1", **env})


def test_an_empty_build_cache_says_the_kernels_are_being_built(tmp_path: Path) -> None:
    """With an empty PAGEDKV_CACHE_DIR the build announces itself (where, and how long it takes)
    before compiling; the test stops the compiler once the message is out."""
    proc = _native_main(tmp_path / "cache")
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line or BUILD_MESSAGE in line:
                break
        assert BUILD_MESSAGE in line, line
        assert str(tmp_path / "cache" / "native") in line and "minutes" in line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the compiler too (its own process group)
        proc.wait(timeout=30)


def test_a_failed_build_is_announced_and_ends_in_one_line(tmp_path: Path) -> None:
    """No compiler: the announcement, then how long it took to fail, then why (the plain
    PyTorch path runs)."""
    proc = _native_main(tmp_path / "cache", CXX="/nonexistent/c++")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "unavailable" in out
    lines = [line for line in err.splitlines() if line.startswith("pagedkv: ")]
    assert BUILD_MESSAGE in lines[0] and "failed after" in lines[-1], err[-2000:]
    assert "native CPU kernels unavailable" in err


def test_a_built_cache_loads_without_a_message(tmp_path: Path) -> None:
    from pagedkv.paths import cache_root

    if not native.available():
        pytest.skip(f"native kernels unavailable here: {native.why_unavailable()}")
    key = native._build_key()
    shutil.copytree(cache_root() / "native" / key, tmp_path / "cache" / "native" / key,
                    ignore=shutil.ignore_patterns("lock", "pagedkv-build.lock"))
    proc = _native_main(tmp_path / "cache")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0 and "built and loaded" in out, err[-2000:]
    assert "building" not in err


def test_phase_lines_on_a_pipe(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.progress import phase

    monkeypatch.delenv("PAGEDKV_QUIET", raising=False)
    with phase("doing a thing"):
        pass
    with pytest.raises(RuntimeError), phase("doing another"):
        raise RuntimeError("no")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "pagedkv: doing a thing ..." and err[1].startswith("pagedkv: doing a thing: done in ")
    assert err[3].startswith("pagedkv: doing another: failed after ")
    monkeypatch.setenv("PAGEDKV_QUIET", "1")
    with phase("silent"):
        pass
    assert capsys.readouterr().err == ""


def _in_a_terminal(argv: list[str], timeout: float = 240.0) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal (stdout and stderr a tty); its exit code and output."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # a terminal of 120 columns (a new pseudo-terminal has 0: tqdm would draw nothing)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.execvpe(argv[0], argv, {**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 1.0)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
        else:
            raise AssertionError(f"{argv} still running after {timeout} s:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagedkv_testing.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("progress") / "model")


def test_bench_shows_its_phases_and_a_bar_in_a_terminal(tiny: Path) -> None:
    code, out = _in_a_terminal([sys.executable, "-m", "pagedkv.cli", "bench", "--model", str(tiny),
                                "--case", "case_a"])
    assert code == 0, out[-3000:]
    assert f"pagedkv: bench: loading {tiny} ..." in out and f"pagedkv: bench: loading {tiny}: loaded in " in out
    assert "pagedkv: bench: running case_a: 1 requests, 128 output tokens ..." in out
    assert re.search(r"case_a: +\d+%\|.*\| *\d+/128 \[", out), out[-3000:]  # the tqdm bar, in tokens
    assert "pagedkv: bench: running case_a: 1 requests, 128 output tokens: finished in " in out
    assert '"case": "case_a"' in out


def test_generate_progress_bar(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's "Processed prompts" bar with use_tqdm=True; by default (None) only on a terminal,
    and pytest's stderr is none."""
    from pagedkv import LLM, SamplingParams

    with LLM(str(tiny), num_kv_blocks=64) as llm:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        capsys.readouterr()
        llm.generate(["a b c", "hello", "the quick brown fox"], params, use_tqdm=True)
        err = capsys.readouterr().err
        assert "Processed prompts: 100%" in err and "3/3" in err
        assert re.search(r"est\. speed input: [\d.]+ toks/s, output: [\d.]+ toks/s", err)
        llm.generate(["a b c"], params)
        llm.chat([{"role": "user", "content": "hi"}], params)
        assert "Processed prompts" not in capsys.readouterr().err


def test_large_weights_are_announced(tiny: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights from LOUD_WEIGHT_BYTES on print a start and an end line (a log shows why a server
    is not listening yet); small ones load silently."""
    from pagedkv.models import hf_loader

    monkeypatch.delenv("PAGEDKV_QUIET", raising=False)
    hf_loader.load_hf_folder(tiny)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(hf_loader, "LOUD_WEIGHT_BYTES", 1)
    hf_loader.load_hf_folder(tiny)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("pagedkv: loading 0.0 GiB of weights from ") and err[0].endswith(" ...")
    assert ": loaded in " in err[1]
