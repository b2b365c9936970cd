"""Command-line flags for every EngineConfig field, made in this one place for serve, generate and
bench, and the table of options in docs/configuration.md.

Each option is documented once, where it is defined: its help is the field's ``metadata["help"]``
in ``engine/config.py``. This module holds only what argparse needs besides: the value's type or
choices and vLLM's other spellings. Names are the fields' with dashes (vLLM's names); a flag left
out keeps EngineConfig's default, which the help text shows.

    python -m pagedkv.engine.flags     # prints the options table of docs/configuration.md
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedkv.block_size import parse_block_size
from pagedkv.engine.config import DEVICES, DTYPES, PREEMPTION_MODES, EngineConfig
from pagedkv.memory import EVICTION_POLICIES
from pagedkv.memory.prefix_index import PREFIX_INDEXES
from pagedkv.model_shape import KV_CACHE_DTYPES, KV_QUANT_PARTS
from pagedkv.weight_quant import QUANTIZATIONS


def _size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


_SWITCH: dict[str, Any] = {"action": argparse.BooleanOptionalAction}

# Field -> argparse keywords (never the help: that is the field's). Every EngineConfig field but
# ``model`` has an entry (a test checks it), so a new option cannot be forgotten here.
_ARGPARSE: dict[str, dict[str, Any]] = {
    "tokenizer": {"type": str},
    "revision": {"type": str},
    "download_dir": {"type": str},
    "block_size": {"type": parse_block_size, "metavar": "N|auto"},
    "block_size_seq_len": {"type": int, "metavar": "TOKENS"},
    "enable_prefix_caching": _SWITCH,
    "kv_cache_memory": {"type": _size},
    "num_kv_blocks": {"type": int},
    "kv_offloading_size": {"type": float},
    "swap_space": {"type": float},
    "kv_offload_dir": {"type": str},
    "kv_offload_disk_size": {"type": _size},
    "kv_remote_url": {"type": str, "metavar": "URL"},
    "kv_remote_key_prefix": {"type": str},
    "max_num_seqs": {"type": int},
    "max_num_batched_tokens": {"type": int},
    "max_step_time_s": {"type": float, "metavar": "SECONDS"},
    "max_model_len": {"type": int},
    "preemption_mode": {"choices": PREEMPTION_MODES},
    "eviction_policy": {"choices": EVICTION_POLICIES},
    "prefix_index": {"choices": PREFIX_INDEXES},
    "watermark": {"type": float},
    "dtype": {"choices": DTYPES},
    "kv_cache_dtype": {"choices": KV_CACHE_DTYPES},
    "kv_sink_blocks": {"type": int},
    "kv_quant_parts": {"choices": KV_QUANT_PARTS},
    "kv_recent_block": _SWITCH,
    "quantization": {"choices": QUANTIZATIONS},
    "seed": {"type": int},
    "debug_integrity": _SWITCH,
    "fault_injection": {"type": str},
    "threads": {"type": int},
    "tensor_parallel_size": {"type": int, "metavar": "N"},
    "tenant_kv_quota": {"action": "append", "metavar": "NAME=FRACTION"},
    "default_tenant_kv_quota": {"type": float, "metavar": "FRACTION"},
    "max_pin_ttl_s": {"type": float, "metavar": "SECONDS"},
    "max_tenant_pin_fraction": {"type": float, "metavar": "FRACTION"},
    "speculative_config": {"type": str, "metavar": "JSON"},
    "kv_events": _SWITCH,
    "device": {"type": str, "metavar": "|".join(DEVICES)},
    "disable_cascade_attn": _SWITCH,
    "native_layers": _SWITCH,
    "enable_lora": _SWITCH,
    "max_loras": {"type": int},
    "max_lora_rank": {"type": int},
    "max_cpu_loras": {"type": int},
    "grammar_compile_timeout_s": {"type": float, "metavar": "SECONDS"},
    "grammar_memory_mib": {"type": int},
    "grammar_max_lexer_states": {"type": int},
    "grammar_max_spec_chars": {"type": int},
    "max_guided_choices": {"type": int},
    "grammar_cache_mib": {"type": int},
    "generation_config": {"type": str},
}


# vLLM's other spellings of a flag.
_ALIASES: dict[str, tuple[str, ...]] = {"kv_cache_memory": ("--kv-cache-memory-bytes",),
                                        "tensor_parallel_size": ("-tp",)}


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def flag_name(name: str) -> str:
    """The command-line flag of EngineConfig field ``name``."""
    return "--" + name.replace("_", "-")


def option_help(f: dataclasses.Field) -> str:
    """The field's documentation, with its default when the text does not state one."""
    text = f.metadata["help"]
    if f.default is not None and "(default" not in text:
        text += f" (default {f.default})"
    return text


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                         exclude: tuple[str, ...] = ()) -> None:
    """Add a flag for every EngineConfig field (but ``model`` and ``exclude``), default None."""
    for f in engine_fields():
        if f.name in exclude:
            continue
        parser.add_argument(flag_name(f.name), *_ALIASES.get(f.name, ()), default=None,
                            help=option_help(f), **_ARGPARSE[f.name])


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user set on the command line, leaving the rest to EngineConfig."""
    return {f.name: value for f in engine_fields() if (value := getattr(args, f.name, None)) is not None}


def options_table() -> str:
    """docs/configuration.md's table of engine options, made from EngineConfig and the argparse
    keywords here (a test keeps the document equal to it)."""
    rows = ["| option | flag | values | default | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(EngineConfig):
        flags = ", ".join(f"`{s}`" for s in (flag_name(f.name), *_ALIASES.get(f.name, ())))
        if f.name == "model":  # not an engine flag: each command adds its own (serve: also positional)
            flags += " (serve: also positional)"
        default = "" if f.default is None else f"`{f.default!r}`"
        text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {flags} | {_values(_ARGPARSE.get(f.name, {'type': str}))} | {default} | {text} |")
    return "\n".join(rows) + "\n"


def _values(keywords: dict[str, Any]) -> str:
    """What a flag takes, in words, from its argparse keywords."""
    if "choices" in keywords:
        return " \\| ".join(f"`{c}`" for c in keywords["choices"])
    if keywords.get("action") is argparse.BooleanOptionalAction:
        return "switch (`--no-` form)"
    if keywords.get("action") == "append":
        return f"`{keywords['metavar']}`, repeatable"
    kind = {int: "integer", float: "number", str: "text", _size: "bytes or a size",
            parse_block_size: "integer or auto"}[keywords["type"]]
    metavar = keywords.get("metavar")
    return f"`{metavar}` ({kind})".replace("|", "\\|") if metavar else kind


if __name__ == "__main__":
    print(options_table(), end="")
