"""CORS with vLLM's flags: ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``.

Off unless one of them is given (vLLM allows every origin by default; a server here answers
browsers of other origins only when its operator says so). Once on, a flag left out takes vLLM's
default: every origin, method and header ("*"), no credentials. Each list flag takes vLLM's JSON
list (``--allowed-origins '["https://app.example"]'``) or plain values
(``--allowed-origins https://a.example https://b.example``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

_LISTS = {"allowed_origins": "origins", "allowed_methods": "methods", "allowed_headers": "headers"}


@dataclass(frozen=True, slots=True)
class CORSOptions:
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def add_cors_arguments(p: argparse.ArgumentParser) -> None:
    for name, what in _LISTS.items():
        p.add_argument("--" + name.replace("_", "-"), action="extend", nargs="+", default=None, metavar="VALUE",
                       help=f"CORS: the {what} browsers may use, as vLLM's JSON list or plain values (default: "
                            f"CORS off; once any CORS flag is given, \"*\")")
    p.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=None,
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests")


def cors_options(args: argparse.Namespace) -> CORSOptions | None:
    """The CORS settings the flags give, or None (CORS off). Raises ValueError naming the flag."""
    given = {name: getattr(args, name) for name in _LISTS if getattr(args, name, None) is not None}
    if not given and not getattr(args, "allow_credentials", None):
        return None
    values = {_LISTS[name]: _parse_list(name, items) for name, items in given.items()}
    return CORSOptions(**values, credentials=bool(args.allow_credentials))


def _parse_list(name: str, items: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for item in items:
        if item.lstrip().startswith("["):
            try:
                parsed = json.loads(item)
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {item!r} is not a JSON list: {exc}") from None
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise ValueError(f"--{name.replace('_', '-')}: give a JSON list of strings, got {item!r}")
            out += parsed
        else:
            out += [v for v in item.split(",") if v.strip()]
    if not out:
        raise ValueError(f"--{name.replace('_', '-')}: no value given")
    return tuple(v.strip() for v in out)


def install_cors(app: Starlette, options: CORSOptions) -> None:
    """Answer CORS preflights and add CORS headers (before routing and the API-key check, as a
    preflight carries no key)."""
    app.add_middleware(CORSMiddleware, allow_origins=list(options.origins), allow_methods=list(options.methods),
                       allow_headers=list(options.headers), allow_credentials=options.credentials)
