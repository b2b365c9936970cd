"""pagedkv/envs.py is the one place the package reads environment variables, and
docs/environment.md shows its table as it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedkv import envs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedkv"


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the environment: ``os.getenv(...)``, ``os.environ.get(...)``,
    ``os.environ[...]`` as a value, ``... in os.environ``. Handing the whole environment on to a
    child process (``{**os.environ, ...}``) reads no setting and is allowed."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv" or (node.func.attr in ("get", "setdefault", "pop")
                                              and is_environ(node.func.value)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "envs.py":
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in _environment_reads(ast.parse(path.read_text()))]
    assert not offenders, ("these read the environment directly; declare the variable in pagedkv/envs.py "
                           f"(name, kind, default, meaning) and read it through it: {offenders}")


def test_the_check_sees_each_kind_of_read() -> None:
    source = ("import os\nos.getenv('A')\nos.environ.get('B')\nx = os.environ['C']\n'D' in os.environ\n"
              "env = {**os.environ, 'E': '1'}\n")
    assert _environment_reads(ast.parse(source)) == [2, 3, 4, 5]


def test_docs_table_matches_envs() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert envs.markdown_table() in doc, "docs/environment.md's table is stale: paste envs.markdown_table() into it"


def test_names_are_unique_and_documented() -> None:
    names = [n for var in envs.ALL for n in (var.name, *var.aliases)]
    assert len(names) == len(set(names))
    declared = {name for name, value in vars(envs).items() if isinstance(value, envs.EnvVar)}
    assert declared == {name for name, value in vars(envs).items() if any(value is v for v in envs.ALL)}
    assert all(var.meaning for var in envs.ALL)


def test_empty_is_unset_and_own_name_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_LOG_STATS_INTERVAL", "")
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "3")
    assert envs.LOG_STATS_INTERVAL.get() == 3.0
    monkeypatch.setenv("PAGEDKV_LOG_STATS_INTERVAL", "0.5")
    assert envs.LOG_STATS_INTERVAL.get() == 0.5
    monkeypatch.delenv("PAGEDKV_LOG_STATS_INTERVAL")
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL")
    assert envs.LOG_STATS_INTERVAL.get() == 10.0


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.delenv("PAGEDKV_LOG_STATS_INTERVAL", raising=False)
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
        envs.LOG_STATS_INTERVAL.get()


def test_switches_keep_their_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", "0")
    assert envs.NATIVE.get() is False
    monkeypatch.setenv("PAGEDKV_NATIVE", "1")
    assert envs.NATIVE.get() is True
    monkeypatch.setenv("PAGEDKV_QUIET", "0")
    assert envs.QUIET.get() is False
    monkeypatch.setenv("PAGEDKV_QUIET", "yes")
    assert envs.QUIET.get() is True
    monkeypatch.setenv("HF_HUB_OFFLINE", "ON")
    assert envs.HF_HUB_OFFLINE.get() is True
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert envs.HF_HUB_OFFLINE.get() is False
