"""Suppression markers say what they silence and why.

``ruff check`` and ``mypy`` (configured in pyproject.toml, run by scripts/test.sh before the tests)
already refuse a ``noqa`` no rule needs (RUF100), a blanket ``# noqa`` or ``# type: ignore``
(PGH003/PGH004), a ``type: ignore`` without its error code and one no error needs any more
(mypy's ``ignore-without-code`` and ``warn_unused_ignores``). What no tool checks is the reason, and
a file-wide switch-off. This test does: every ``type: ignore[code]`` and every ``noqa: CODE`` is
followed by a reason on its line (``# type: ignore[union-attr]  # reason``,
``# noqa: BLE001 - reason``), or sits under a comment that gives it (a comment on the line above,
or above a run of such markers that it explains); no file turns a checker off
(``# ruff: noqa``, ``# flake8: noqa``, ``# mypy: ignore-errors``, ``# type: ignore`` on its own).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", "build", "dist", ".git", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}

_TYPE_IGNORE = re.compile(r"type:\s*ignore(\[[^\]]*\])?(.*)")
_NOQA = re.compile(r"#\s*noqa\b(:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(.*)", re.IGNORECASE)
_FILE_WIDE = re.compile(r"#\s*(ruff:\s*noqa|flake8:\s*noqa|mypy:\s*ignore-errors)\b", re.IGNORECASE)


def _python_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


def _comments(path: Path) -> dict[int, tuple[str, bool]]:
    """Line -> (its comment, whether code comes before it on the line)."""
    out: dict[int, tuple[str, bool]] = {}
    code_lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING)
    for tok in tokenize.tokenize(io.BytesIO(path.read_bytes()).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = (tok.string, tok.start[0] in code_lines)
        elif tok.type not in skip:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return out


def _reason_after(tail: str) -> bool:
    """Whether ``tail`` (what follows the codes) holds a reason: words, not just punctuation."""
    return re.search(r"[A-Za-z]{2,}", tail) is not None


def _problems(path: Path, root: Path = ROOT) -> list[str]:
    comments = _comments(path)
    where = path.relative_to(root)
    problems = []
    for line, (text, after_code) in sorted(comments.items()):
        if _FILE_WIDE.search(text):
            problems.append(f"{where}:{line}: turns a checker off for the whole file: {text.strip()}")
            continue
        if (m := _TYPE_IGNORE.search(text)) is not None:
            if not after_code:
                problems.append(f"{where}:{line}: a type: ignore on its own line silences the whole file")
            elif m.group(1) is None:
                problems.append(f"{where}:{line}: a type: ignore without its error code")
            elif not _reason_after(m.group(2)) and not _reason_above(comments, line, _TYPE_IGNORE):
                problems.append(f"{where}:{line}: a type: ignore{m.group(1)} without a reason "
                                "(a comment after it, or on the line above)")
        if (m := _NOQA.search(text)) is not None:
            if m.group(1) is None:
                problems.append(f"{where}:{line}: a noqa without its rule")
            elif not _reason_after(m.group(2)) and not _reason_above(comments, line, _NOQA):
                problems.append(f"{where}:{line}: a noqa{m.group(1)} without a reason (# noqa: CODE - why, "
                                "or a comment on the line above)")
    return problems


def _reason_above(comments: dict[int, tuple[str, bool]], line: int, marker: re.Pattern[str]) -> bool:
    """A comment on the line above gives the reason; a marker of the same kind there without one
    hands the question up (one comment over a run of ignores, e.g. imports after a path setup)."""
    above = line - 1
    while above in comments:
        text = comments[above][0]
        if (m := marker.search(text)) is None:
            return True
        if _reason_after(m.group(2)):
            return True
        above -= 1
    return False


def test_every_suppression_names_its_rule_and_reason() -> None:
    problems = [p for path in _python_files() for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_it_should(tmp_path: Path) -> None:
    """The rules above, on a file that breaks each of them once and keeps each of them once."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "# ruff: noqa\n"
        "x: int = 'a'  # type: ignore\n"
        "v = 1\n"
        "y: int = 'b'  # type: ignore[assignment]\n"
        "v = 2\n"
        "import os  # noqa: F401\n"
        "import sys  # noqa\n"
        "# the next one is a str on purpose\n"
        "z: int = 'c'  # type: ignore[assignment]\n"
        "w: int = 'd'  # type: ignore[assignment]  # a str on purpose\n"
        "import re  # noqa: F401 - imported for its side effect\n"
    )
    found = [p.split(": ", 1)[1] for p in _problems(bad, tmp_path)]
    assert found == [
        "turns a checker off for the whole file: # ruff: noqa",
        "a type: ignore without its error code",
        "a type: ignore[assignment] without a reason (a comment after it, or on the line above)",
        "a noqa: F401 without a reason (# noqa: CODE - why, or a comment on the line above)",
        "a noqa without its rule",
    ]
