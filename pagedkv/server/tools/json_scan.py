"""Where a JSON value ends in text that may still be growing: the tool parsers' one scanner.

A streamed tool call is parsed many times while its text grows, so these functions never need
the text to be complete: each says "ends at i", "not finished yet" (None), or raises
:class:`NotJSON` as soon as the text can no longer be JSON. They find boundaries only; the
finished slice is then checked with ``json.loads``.

    {"name": "get_weather", "arguments": {"city": "Par
    ^ scan_object: members [("name", 9, 22), ("arguments", 37, None)], end None (still open)
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class NotJSON(ValueError):
    """The text at this position cannot be (the start of) a JSON value."""


class Member(NamedTuple):
    """One ``"key": value`` of an object: the value is ``text[start:end]``; end None: not finished."""

    key: str
    start: int
    end: int | None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_value(text: str, i: int, resume: dict | None = None) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``; None if the text ends first.

    ``resume``: where earlier scans of the same, shorter text stopped (a dict the caller keeps
    while the text grows by appending): a long value is then scanned once in all, not once per
    new token."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _scan_string(text, i, resume)
    if c in "{[":
        return _scan_nested(text, i, resume)
    m = _SCALAR.match(text, i)
    if m is None:
        if _could_start_scalar(text[i:]):
            return None
        raise NotJSON(f"unexpected {c!r} at {i}")
    if m.end() == len(text):  # 12 may go on as 123; true is finished but treat alike
        return None
    return m.end()


def _could_start_scalar(rest: str) -> bool:
    if any(word.startswith(rest) for word in ("true", "false", "null")):
        return True
    return re.fullmatch(r"-?\d*\.?\d*", rest) is not None


_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')


def _scan_string(text: str, i: int, resume: dict | None = None) -> int | None:
    j = resume.get(("s", i), i + 1) if resume is not None else i + 1
    while True:
        m = _STRING_STOP.search(text, j)
        if m is None or (m.group() == "\\" and m.end() >= len(text)):
            if resume is not None:
                resume[("s", i)] = m.start() if m is not None else len(text)
            return None
        if m.group() == "\\":
            j = m.end() + 1
            continue
        return m.end()


def _scan_nested(text: str, i: int, resume: dict | None = None) -> int | None:
    j, depth = resume.get(("n", i), (i, 0)) if resume is not None else (i, 0)
    while True:
        m = _NESTED_STOP.search(text, j)
        if m is None:
            j = len(text)
            break
        c = m.group()
        if c == '"':
            end = _scan_string(text, m.start(), resume)
            if end is None:
                j = m.start()
                break
            j = end
            continue
        depth += 1 if c in "{[" else -1
        j = m.end()
        if depth == 0:
            return j
    if resume is not None:
        resume[("n", i)] = (j, depth)
    return None


def scan_object(text: str, i: int, resume: dict | None = None) -> tuple[list[Member], int | None]:
    """The members of the object starting at ``text[i]`` (``{``) as far as the text goes, and its
    end (None: not closed yet). A member whose value has not started has ``start == len(text)``."""
    if i >= len(text) or text[i] != "{":
        raise NotJSON(f"expected an object at {i}")
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return members, j + 1
    while True:
        if j >= len(text):
            return members, None
        if text[j] != '"':
            raise NotJSON(f"expected a key at {j}")
        key_end = _scan_string(text, j, resume)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise NotJSON(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        end = scan_value(text, j, resume)
        members.append(Member(key, j, end))
        if end is None:
            return members, None
        j = skip_ws(text, end)
        if j >= len(text):
            return members, None
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] == "}":
            return members, j + 1
        else:
            raise NotJSON(f"expected ',' or '}}' at {j}")


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (text that must
    be held back while streaming, as the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
