"""Command-line flags for every EngineConfig field, made in this one place for serve, generate and
bench. Names are the fields' with dashes (vLLM's names); a flag left out keeps EngineConfig's
default, which the help text shows.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedkv.engine.config import DEVICES, DTYPES, PREEMPTION_MODES, EngineConfig
from pagedkv.memory import EVICTION_POLICIES
from pagedkv.memory.prefix_index import PREFIX_INDEXES
from pagedkv.model_shape import KV_CACHE_DTYPES
from pagedkv.weight_quant import QUANTIZATIONS


def _size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


# Field -> (help, argparse keywords). Every EngineConfig field but ``model`` has an entry (a test
# checks it), so a new option cannot be forgotten here.
_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tokenizer": ("a tokenizer instead of the model's: a folder with tokenizer.json, a .gguf file or a cached "
                  "Hugging Face repo id (default: the model's own)", {"type": str}),
    "revision": ("the branch, tag or commit of a Hugging Face repo id given as the model (default main)",
                 {"type": str}),
    "download_dir": ("the Hugging Face cache a repo id given as the model is looked up in and downloaded into "
                     "(default: Hugging Face's own, $HF_HUB_CACHE or ~/.cache/huggingface/hub)", {"type": str}),
    "block_size": ("token slots per KV block", {"type": int}),
    "enable_prefix_caching": ("share KV blocks of common prompt prefixes",
                              {"action": argparse.BooleanOptionalAction}),
    "kv_cache_memory": ("memory for the KV cache: bytes or a size such as 512MiB, 2GiB, 4G (= 4GiB, as vLLM's "
                        "--kv-cache-memory-bytes reads it; 4g and 4GB are 4 x 1000^3) (default 1GiB)",
                        {"type": _size}),
    "num_kv_blocks": ("number of KV blocks (instead of --kv-cache-memory)", {"type": int}),
    "kv_offloading_size": ("the host tier in GiB: swapped-out sequences and cached prefix blocks evicted "
                           "from the device (default 0.5)", {"type": float}),
    "swap_space": ("deprecated alias of --kv-offloading-size", {"type": float}),
    "kv_offload_dir": ("directory of the disk tier below the host tier: evicted prefix blocks persist "
                       "there across restarts (owner-only; wipe with `pagedkv kv-cache clear DIR`)",
                       {"type": str}),
    "kv_offload_disk_size": ("size of the disk tier, e.g. 20GiB (default 20GiB; needs --kv-offload-dir)",
                             {"type": _size}),
    "max_num_seqs": ("most sequences in one batch", {"type": int}),
    "max_num_batched_tokens": ("most tokens in one step (chunked prefill)", {"type": int}),
    "max_step_time_s": ("seconds one step should take at most: prefill chunks are sized by the engine's step-time "
                        "estimate (fitted to its measured steps) so that streams beside a long prompt keep their "
                        "inter-token gaps near it; decodes always run; 0: off, the token budget alone",
                        {"type": float, "metavar": "SECONDS"}),
    "max_model_len": ("longest prompt plus output, in tokens (default: the model's)", {"type": int}),
    "preemption_mode": ("how to preempt under memory pressure: auto picks swap or recompute by the "
                        "engine's measured costs", {"choices": PREEMPTION_MODES}),
    "eviction_policy": ("which cached blocks to evict first", {"choices": EVICTION_POLICIES}),
    "prefix_index": ("how cached prefixes are found: SHA-256 hash chain or radix tree",
                     {"choices": PREFIX_INDEXES}),
    "watermark": ("fraction of the KV pool kept free when admitting requests", {"type": float}),
    "dtype": ("model dtype; auto: the checkpoint's where the hardware computes in it natively, else float32",
              {"choices": DTYPES}),
    "kv_cache_dtype": ("KV block format: auto (the model dtype), a float dtype, or 8-bit blocks with "
                       "per-block scales: int8, fp8 (= fp8_e4m3), fp8_e5m2", {"choices": KV_CACHE_DTYPES}),
    "quantization": ("linear weights: none (the model dtype), q8_0 (int8 + a scale and offset per 32 values; "
                     "GGUF types it cannot hold exactly are requantized), auto: a GGUF's weights kept 8-bit where "
                     "exact (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K), the rest dequantized", {"choices": QUANTIZATIONS}),
    "seed": ("global random seed", {"type": int}),
    "debug_integrity": ("check KV-cache integrity after every step",
                        {"action": argparse.BooleanOptionalAction}),
    "fault_injection": ("inject faults, e.g. seed=7,rate=0.05 (also env PAGEDKV_FAULT_INJECTION)",
                        {"type": str}),
    "threads": ("torch CPU threads (default: torch's choice)", {"type": int}),
    "tenant_kv_quota": ("NAME=FRACTION: the share of the device KV pool tenant NAME may hold, in use plus "
                        "cached; over it, its own cached blocks are evicted first and its new requests wait "
                        "(repeat the flag for more tenants)", {"action": "append", "metavar": "NAME=FRACTION"}),
    "default_tenant_kv_quota": ("the share of the device KV pool each tenant without a --tenant-kv-quota may "
                                "hold (default: no limit)", {"type": float, "metavar": "FRACTION"}),
    "max_pin_ttl_s": ("the longest a request's conversation_id may keep its prefix pinned in the KV cache "
                      "(pin_ttl_s), and its default, in seconds", {"type": float, "metavar": "SECONDS"}),
    "max_tenant_pin_fraction": ("the largest share of the device KV pool one tenant's conversation pins may hold; "
                                "a pin past it is refused, with a warning in the response's cache details "
                                "(default: no limit but the pool)", {"type": float, "metavar": "FRACTION"}),
    "speculative_config": ("speculative decoding, as a JSON object (vLLM's): {\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} or "
                           "{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4} "
                           "(default: off)", {"type": str, "metavar": "JSON"}),
    "kv_events": ("record KV cache events (prefix blocks stored and removed per tier) for KV-aware routers; "
                  "pagedkv serve --kv-events-endpoint publishes them", {"action": argparse.BooleanOptionalAction}),
    "device": ("where the model, the KV pool and attention run: cpu, cuda (Triton kernels; also cuda:N) or "
               "auto (cuda when a GPU is visible)", {"type": str, "metavar": "|".join(DEVICES)}),
    "enable_lora": ("serve LoRA adapters (--lora-modules, or selected per request); see docs/lora.md",
                    {"action": argparse.BooleanOptionalAction}),
    "max_loras": ("most distinct LoRA adapters computed in one step (their slots are preallocated)", {"type": int}),
    "max_lora_rank": ("the highest LoRA rank served (slot size)", {"type": int}),
    "max_cpu_loras": ("LoRA adapters kept read in memory while idle (default: --max-loras)", {"type": int}),
    "grammar_compile_timeout_s": ("longest one structured-output grammar may take to compile (in a worker "
                                  "process); past it the request gets a 400", {"type": float, "metavar": "SECONDS"}),
    "grammar_memory_mib": ("memory one grammar compile may map in the worker process (MiB); past it the "
                           "request gets a 400", {"type": int}),
    "grammar_max_lexer_states": ("most lexer states one grammar may build (llguidance's max_lexer_states, "
                                 "~1-2 kB each), at compile time and while generating", {"type": int}),
    "grammar_max_spec_chars": ("most characters of a JSON schema, regex or choice list (as JSON)", {"type": int}),
    "max_guided_choices": ("most strings in a guided_choice list", {"type": int}),
    "grammar_cache_mib": ("memory for compiled grammars kept for reuse, by their text (MiB)", {"type": int}),
    "generation_config": ("sampling defaults for fields a request leaves out: auto (the model folder's "
                          "generation_config.json), vllm (neutral defaults), or a folder holding a "
                          "generation_config.json", {"type": str}),
}


# vLLM's other spellings of a flag.
_ALIASES: dict[str, tuple[str, ...]] = {"kv_cache_memory": ("--kv-cache-memory-bytes",)}


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                         exclude: tuple[str, ...] = ()) -> None:
    """Add a flag for every EngineConfig field (but ``model`` and ``exclude``), default None."""
    for f in engine_fields():
        if f.name in exclude:
            continue
        help_text, kwargs = _FLAGS[f.name]
        if f.default is not None and "(default" not in help_text:
            help_text += f" (default {f.default})"
        parser.add_argument("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()), default=None,
                            help=help_text, **kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user set on the command line, leaving the rest to EngineConfig."""
    return {f.name: value for f in engine_fields() if (value := getattr(args, f.name, None)) is not None}
