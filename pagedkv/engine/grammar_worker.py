"""The grammar worker: a separate process that compiles structured-output grammars under limits.

Why a process: some grammars cost without bound inside llguidance where its own limits (lexer
fuel, lexer states, grammar size) do not reach. An ``allOf`` of 30 ``.*a.*``-style patterns asks
it whether the intersection of 30 regexes is empty, which takes minutes and gigabytes before any
limit fires; a Rust allocation failure then aborts the whole process. Here that process is this
worker: it runs with an address-space limit (``RLIMIT_AS``, so an oversized allocation kills the
worker, not the server) at a lower CPU priority, and the server kills it when a compile outlives
its time limit (pagedkv/engine/grammar_compiler.py). The server builds its own matcher only for a
grammar this worker compiled within the limits, so its cost there is known and bounded.

This file runs as a script (``python -P grammar_worker.py``): it imports llguidance and the
standard library only, never pagedkv (so no torch), and starts in a fraction of a second. The
server imports :func:`grammar_text` from it, so both sides turn a structured output into the same
grammar text.

Wire format on stdin/stdout: frames of a 4-byte big-endian length and that many bytes of UTF-8
JSON. The first frame sets the worker up::

    {"tokenizer": "<tokenizer.json text>", "n_vocab": N, "eos": [ids], "limits": {LLParserLimits},
     "memory_bytes": bytes this worker may map beyond what it holds after setup}

then it answers ``{"ready": true, "rss": bytes}``, and for each ``{"kind", "spec"}`` job::

    {"ok": true, "grammar": text, "seconds": s, "bytes": memory the compiled matcher held}
    {"ok": false, "error": short message, "limit": llguidance's limit that fired, or null}
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# compact JSON: no runs of whitespace for a model to fill
_NO_FLEX_WHITESPACE: JsonCompileOptions = {"whitespace_flexible": False}
ERROR_EXCERPT = 200  # characters of an error message (or of the input) that any error repeats

# llguidance's messages when one of its limits fires, and the LLParserLimits field each names
_LIMIT_MESSAGES = (
    ("too many states", "max_lexer_states"),
    ("lexer configuration (grammar) too big", "initial_lexer_fuel"),
    ("fuel exhausted when checking relevance", "initial_lexer_fuel"),
    ("grammar size (number of symbols) too big", "max_grammar_size"),
    ("too many items", "step_max_items"),
    ("too many expressions constructed", "max_lexer_states"),
    ("fuel", "step_lexer_fuel"),
)


def excerpt(text: object, limit: int = ERROR_EXCERPT) -> str:
    """``text`` (or an error, as its message) cut to ``limit`` characters (with a note of what was
    cut): errors and log lines never echo a whole grammar or input."""
    line = str(text).replace("\n", " ")
    return line if len(line) <= limit else f"{line[:limit]}... ({len(line) - limit} more characters)"


def limit_named(message: str) -> str | None:
    """The LLParserLimits field an llguidance error message says fired, or None."""
    lowered = message.lower()
    return next((name for marker, name in _LIMIT_MESSAGES if marker in lowered), None)


def escape_literal(text: str) -> str:
    """``text`` as a regex that matches it literally (llguidance reads Rust regex syntax: every
    punctuation character it may treat specially is escaped)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar text for a structured output's key (``kind`` "json", "regex" or
    "choice"; ``spec`` the schema text, the regex, or the JSON list of choices). Cheap: the
    grammar is checked when it is compiled. ValueError for a schema that is not a JSON object."""
    import llguidance

    M = llguidance.LLMatcher
    if kind == "json":
        return M.grammar_from_json_schema(spec, defaults=_NO_FLEX_WHITESPACE)
    if kind == "regex":
        return M.grammar_from_regex(spec)
    if kind == "choice":
        return M.grammar_from_regex("|".join(escape_literal(c) for c in json.loads(spec)))
    raise ValueError(f"unknown structured output kind {kind!r}")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def compile_job(tokenizer: Any, limits: Any, kind: str, spec: str) -> dict[str, Any]:
    """Compile one grammar (with an llguidance LLTokenizer and LLParserLimits) and compute its
    first token mask (lexer states are built lazily, on the first mask); the reply frame."""
    import llguidance

    start, before = time.perf_counter(), rss_bytes()
    try:
        grammar = grammar_text(kind, spec)
    except ValueError as exc:
        return {"ok": False, "error": excerpt(exc), "limit": None}
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        matcher.compute_bitmask()
        if matcher.is_error():  # e.g. the regex [^\s\S]: no token, not even EOS, can start it
            message = matcher.get_error()
            return {"ok": False, "error": f"the grammar matches no text ({excerpt(message)})",
                    "limit": limit_named(message)}
    else:
        message = matcher.get_error()
        return {"ok": False, "error": excerpt(message), "limit": limit_named(message)}
    held = max(0, rss_bytes() - before)
    return {"ok": True, "grammar": grammar, "seconds": time.perf_counter() - start, "bytes": held}


def read_frame(stream: IO[bytes]) -> Any | None:
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack(">I", header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream: IO[bytes], obj: Any) -> None:
    body = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _die_with_parent()
    setup = read_frame(stdin)
    if setup is None:
        return
    import llguidance

    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    limits = llguidance.LLParserLimits(**setup["limits"])
    del setup["tokenizer"]
    try:
        os.nice(10)  # the engine thread and the event loop come first
    except OSError:
        pass
    budget = int(setup["memory_bytes"])
    if budget > 0:
        cap = _vm_size() + budget
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    write_frame(stdout, {"ready": True, "rss": rss_bytes()})
    while (job := read_frame(stdin)) is not None:
        write_frame(stdout, compile_job(tokenizer, limits, job["kind"], job["spec"]))
        _trim_memory()


def _die_with_parent() -> None:
    """SIGKILL this worker when the server that started it dies (Linux), even mid-compile."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above
        sys.exit(0)


def _trim_memory() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
