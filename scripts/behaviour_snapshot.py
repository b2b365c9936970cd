"""Behaviour snapshot: the token ids and ``stats()`` counters of a fixed set of engine runs, as JSON.

Why: a refactor that must not change behaviour ("Architecture v2", issue 28) is checked by running
the same cases at the base commit and at the end and comparing the two files. Each case builds an
``LLM`` on a tiny random model (float32, fixed seeds, one thread) and records, per request, every
completion's token ids, finish reason, logprobs (rounded) and cached-token count, then the engine's
``stats()`` flattened to dotted keys.

    # at the base commit (PYTHONPATH makes the base tree win over the editable install)
    PYTHONPATH=/work/base .venv/bin/python scripts/behaviour_snapshot.py --out /tmp/snap_base.json
    # at HEAD, then compare (prints each difference, exits 1 on any)
    .venv/bin/python scripts/behaviour_snapshot.py --out /tmp/snap_head.json
    .venv/bin/python scripts/behaviour_snapshot.py --compare /tmp/snap_base.json /tmp/snap_head.json

``--cases a,b`` runs a subset (``--list`` names them). About 30 s on one core (a first run at a
tree also builds the native CPU kernels once, one to two minutes).

Only public API is used (``LLM``, ``SamplingParams``, ``LLM.stats()``, ``LLM.beam_search``), so the
script runs against both trees. Two things are pinned so that a run depends on nothing but the
code (both documented in ``_deterministic``):

- ``max_step_time_s=0``: the step-time budget sizes prefill chunks from measured step times;
- the reload-or-recompute and swap-or-recompute decisions (``TierCosts``) are fed no timings, so
  they take their documented unmeasured answer ("reload", "swap") every time.

Excluded from the snapshot, as timings (``EXCLUDED``): seconds and rates over time, the step-time
fit, the disk writer's queue depth; in cases that read the disk tier, ``num_steps`` too (a waiting
request's disk read takes a number of idle steps that depends on the disk's speed).

KEY MAP: when a refactor renames a ``stats()`` field, add ``"new.dotted.name": "base.dotted.name"``
to ``KEY_MAP`` (a key, or a prefix ending a dotted path); the snapshot is written with the base
names, so base and end files compare equal when behaviour is equal. Renames so far: none (the
spec -> speculative package rename kept the ``spec_*`` stats names).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# new dotted stats key -> the base commit's name (see the module docstring)
KEY_MAP: dict[str, str] = {}

# dotted stats keys (or prefixes) that are timings, not behaviour
EXCLUDED: tuple[str, ...] = (
    "step_costs.s_per_",            # fitted seconds per feature
    "step_costs.mean_error_factor",  # measured / estimated step time
    "tier_costs.prefill_tokens_per_s",
    "tier_costs.recompute_s_per_block",
    "tier_costs.host_read_s_per_block",
    "tier_costs.host_write_s_per_block",
    "tier_costs.disk_read_s_per_block",
    "kv.disk_queue_depth",          # the disk writer's backlog at the instant of the call
)
EXCLUDED_WITH_DISK_READS: tuple[str, ...] = ("num_steps", "step_costs.steps_observed")

FLOAT_DIGITS = 5  # floats (logprobs, rates, quantization errors) are rounded to this many decimals

B = 4  # block size of the tiny-model cases: many blocks per prompt, block edges everywhere


# ---------------------------------------------------------------------------------------- models
def _checkpoint(folder: Path, kind: str, seed: int, **overrides: Any) -> Path:
    """A tiny random transformers checkpoint (safetensors, float32) in ``folder``."""
    import torch
    import transformers

    from pagedkv_testing.hf_checkpoints import randomize_

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[kind]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    config = cls[0](**{**base, **overrides})
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    randomize_(model, seed)  # the tests' weights: O(1) activations, no greedy ties
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _truncated(folder: Path, out: Path, keep_layers: int) -> Path:
    """A draft model: ``folder``'s weights with only the first ``keep_layers`` layers."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = keep_layers
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items()
               if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= keep_layers)},
              str(out / "model.safetensors"))
    return out


class Models:
    """The checkpoints, built once per run on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def get(self, name: str) -> str:
        if name not in self._built:
            folder = self.root / name
            if name == "llama":
                self._built[name] = _checkpoint(folder, "llama", seed=5, num_hidden_layers=3)
            elif name == "draft":
                self._built[name] = _truncated(Path(self.get("llama")), folder, keep_layers=1)
            elif name == "gemma3":  # hybrid KV: sliding-window layers 0, 1 and 3 in groups of their own
                self._built[name] = _checkpoint(folder, "gemma3", seed=5, num_hidden_layers=4, sliding_window=6,
                                                sliding_window_pattern=3, head_dim=24)
            else:
                raise KeyError(name)
        return str(self._built[name])


# ---------------------------------------------------------------------------------------- prompts
def _ragged(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _copy_heavy(seed: int, lengths: list[int]) -> list[list[int]]:
    """A passage repeated: the n-gram proposer finds matches at once."""
    import random

    rng = random.Random(seed)
    out = []
    for n in lengths:
        passage = [rng.randrange(3, 256) for _ in range(n)]
        out.append(passage + passage + passage[:n // 2])
    return out


PREFIX = [(7 * i + 3) % 97 + 5 for i in range(48)]  # 12 blocks of 4 shared by the tier cases


def _shared_prefix_prompts(n: int) -> list[list[int]]:
    return [PREFIX + [200 + 3 * i, 201 + i, 150 + i] for i in range(n)]


# ---------------------------------------------------------------------------------------- recording
def _num(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, FLOAT_DIGITS)
    return x


def _jsonable(x: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return _num(x)


def _logprobs(entries: Any) -> Any:
    if entries is None:
        return None
    return [None if step is None else {str(t): [_num(lp.logprob), lp.rank] for t, lp in sorted(step.items())}
            for step in entries]


def record_outputs(outs: list[Any]) -> list[dict[str, Any]]:
    """Per request: prompt ids, cached tokens, and each completion's ids, finish and logprobs."""
    rows = []
    for o in outs:
        rows.append({
            "prompt_token_ids": list(o.prompt_token_ids),
            "num_cached_tokens": o.num_cached_tokens,
            "prompt_logprobs": _logprobs(o.prompt_logprobs),
            "error": o.error,
            "outputs": [{"index": c.index, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason, "cumulative_logprob": _num(c.cumulative_logprob),
                         "logprobs": _logprobs(c.logprobs)} for c in o.outputs],
        })
    return rows


def _flatten(x: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = x


def _canonical(key: str) -> str:
    """``key`` under its base-commit name (KEY_MAP: exact names, or dotted prefixes)."""
    if key in KEY_MAP:
        return KEY_MAP[key]
    for new, old in KEY_MAP.items():
        if key.startswith(new + "."):
            return old + key[len(new):]
    return key


def record_stats(stats: Any, *, disk_reads: bool = False) -> dict[str, Any]:
    """``stats()`` flattened to dotted keys under base names, timings left out."""
    raw = stats.as_dict() if hasattr(stats, "as_dict") else _jsonable(stats)
    flat: dict[str, Any] = {}
    _flatten(_jsonable(raw), "", flat)
    excluded = EXCLUDED + (EXCLUDED_WITH_DISK_READS if disk_reads else ())
    out = {}
    for key, value in flat.items():
        name = _canonical(key)
        if not any(name == e or name.startswith(e) for e in excluded):
            out[name] = value
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------- determinism
@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """While inside: feed the reload/swap-or-recompute decisions no timings, so they give their unmeasured answer.

    ``TierCosts`` (memory/tier_costs.py at the base commit; found by name wherever a refactor moves
    it) compares measured seconds per block with measured prefill seconds: on these tiny models the
    two are close, and the answer flips with the machine's load. Without measurements it always
    answers "reload" / "swap". Its decision counters stay in the snapshot.
    """
    import importlib
    import pkgutil

    import pagedkv.memory as memory

    found = []
    names = [memory.__name__] + [m.name for m in pkgutil.walk_packages(memory.__path__, memory.__name__ + ".")]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module a refactor left half-moved: the class is elsewhere
            continue
        cls = getattr(module, "TierCosts", None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    if not found:
        raise RuntimeError("behaviour_snapshot: class TierCosts not found under pagedkv.memory: "
                           "update _deterministic() to where it moved")
    saved = [(cls, name, cls.__dict__[name]) for cls in found for name in ("observe", "observe_prefill")]
    for cls, name, _ in saved:
        setattr(cls, name, _no_timing)
    try:
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def _no_timing(self: Any, *args: Any, **kwargs: Any) -> None:
    """``TierCosts.observe`` / ``observe_prefill`` while snapshotting: the measurement is dropped."""


def _llm(model: str | None, **options: Any) -> Any:
    from pagedkv import LLM

    options.setdefault("max_step_time_s", 0)
    options.setdefault("seed", 0)
    options.setdefault("dtype", "float32")
    options.setdefault("debug_integrity", True)
    return LLM(model, **options)


def _close(llm: Any) -> None:
    close = getattr(llm, "close", None)
    if close is not None:
        close()


def _case(llm: Any, prompts: Any, params: Any, *, disk: bool = False, disk_reads: bool = False) -> dict[str, Any]:
    """Generate, record, close. With a disk tier (``disk``) the stats are read after the close: the
    disk writer works in the background, and only a closed engine has written everything."""
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if not disk:
            return {"requests": record_outputs(outs), "stats": record_stats(llm.stats(), disk_reads=disk_reads)}
    finally:
        _close(llm)
    return {"requests": record_outputs(outs), "stats": record_stats(llm.stats(), disk_reads=disk_reads)}


# ---------------------------------------------------------------------------------------- cases
def case_greedy(m: Models, tmp: Path) -> Any:
    """Ragged greedy batch with logprobs and prompt logprobs, chunked prefill; then the same prompts
    again (prefix-cache hits)."""
    from pagedkv import SamplingParams

    llm = _llm(m.get("llama"), block_size=B, num_kv_blocks=200, max_num_batched_tokens=32)
    prompts = _ragged(0, [3, 17, 40, 9, 33, 1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    params_again = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    params_again.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2))
    try:
        first = record_outputs(llm.generate(prompts, params, use_tqdm=False))
        again = _case(llm, prompts + _ragged(1, [20]), params_again)
    finally:
        _close(llm)
    return {"first": first, "again": again}


def case_sampling(m: Models, tmp: Path) -> Any:
    """Seeded sampling (per-request seeds, and the engine's seed), penalties, stop ids, min tokens."""
    from pagedkv import SamplingParams

    prompts = _ragged(2, [5, 18, 11, 30])
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11 + i, max_tokens=14,
                             repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                             min_tokens=2, stop_token_ids=(7, 9)) for i in range(3)]
    params.append(SamplingParams(temperature=1.0, min_p=0.05, max_tokens=14, logprobs=1))
    return _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=200, seed=3), prompts, params)


def case_n_best(m: Models, tmp: Path) -> Any:
    """n > 1 (forks sharing the prompt's blocks, copy on write), seeded."""
    from pagedkv import SamplingParams

    prompts = _ragged(3, [6, 21])
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    return _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=200), prompts, params)


def case_beam(m: Models, tmp: Path) -> Any:
    """Native beam search (width 3)."""
    llm = _llm(m.get("llama"), block_size=B, num_kv_blocks=200)
    try:
        outs = llm.beam_search(_ragged(4, [7, 15]), beam_width=3, max_tokens=8, ignore_eos=True)
        return {"requests": record_outputs(outs), "stats": record_stats(llm.stats())}
    finally:
        _close(llm)


def case_spec_ngram(m: Models, tmp: Path) -> Any:
    """Speculative decoding, n-gram proposer, greedy, on copy-heavy prompts."""
    from pagedkv import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=400, speculative_config=spec),
                 _copy_heavy(4, [5, 14, 22]), params)


def case_spec_draft(m: Models, tmp: Path) -> Any:
    """Speculative decoding with a draft model (the target's first layer), greedy and seeded sampling."""
    from pagedkv import SamplingParams

    spec = {"method": "draft_model", "model": m.get("draft"), "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    return _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=400, speculative_config=spec),
                 _copy_heavy(5, [6, 13, 9]), params)


def case_int8(m: Models, tmp: Path) -> Any:
    """int8 KV blocks (one scale per block, layer, K/V and KV head)."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=120, kv_cache_dtype="int8"),
                 _ragged(6, [9, 26, 4]), params)


def case_hybrid(m: Models, tmp: Path) -> Any:
    """A hybrid sliding-window model (gemma3): window blocks released as sequences advance; prefix hits."""
    from pagedkv import SamplingParams

    llm = _llm(m.get("gemma3"), block_size=B, num_kv_blocks=300, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = _ragged(7, [5, 30, 17])
    try:
        first = record_outputs(llm.generate(prompts, params, use_tqdm=False))
        again = _case(llm, prompts, params)
    finally:
        _close(llm)
    return {"first": first, "again": again}


def case_preemption(m: Models, tmp: Path) -> Any:
    """A pool too small for the batch: preemption by recompute and by swap (and "auto")."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _ragged(8, [5, 30, 14, 22, 9, 41, 3, 18])
    out = {}
    for mode in ("recompute", "swap", "auto"):
        out[mode] = _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=40, max_num_batched_tokens=48,
                               kv_offloading_size=0.0003, preemption_mode=mode), prompts, params)
    return out


def case_faults(m: Models, tmp: Path) -> Any:
    """Seeded fault injection (forced recompute and swap preemption, eviction, failed allocations)
    on a small pool, greedy and seeded sampling."""
    from pagedkv import SamplingParams

    prompts = _ragged(9, [5, 30, 14, 22, 9, 41, 3, 18])
    params = [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=18, ignore_eos=True)] * 4
    out = {}
    for faults in ("seed=1,rate=0.15", "seed=4,rate=0.3"):
        out[faults] = _case(_llm(m.get("llama"), block_size=B, num_kv_blocks=60, max_num_batched_tokens=48,
                                 kv_offloading_size=0.0003, preemption_mode="recompute" if "seed=1" in faults
                                 else "swap", fault_injection=faults), prompts, params)
    return out


def case_tiers(m: Models, tmp: Path) -> Any:
    """Host and disk tiers: a small device pool evicts the shared prefix into the host tier and onto
    disk (later prompts reload it); a restart on the same directory hits on disk."""
    from pagedkv import SamplingParams

    kv_dir = tmp / "kv"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=B, num_kv_blocks=40, kv_offloading_size=0.002, kv_offload_dir=str(kv_dir))
    out: dict[str, Any] = {}
    llm = _llm(m.get("llama"), **options)
    try:
        out["first"] = record_outputs(llm.generate(_shared_prefix_prompts(4), greedy, use_tqdm=False))
        other = [[(11 * i + j) % 90 + 3 for j in range(60)] for i in range(6)]
        out["pressure"] = record_outputs(llm.generate(other, greedy, use_tqdm=False))  # evicts the prefix
        out["host_reload"] = _case(llm, _shared_prefix_prompts(4), greedy, disk=True)
    finally:
        _close(llm)
    out["restart"] = _case(_llm(m.get("llama"), **options), _shared_prefix_prompts(5), greedy, disk=True,
                           disk_reads=True)
    return out


def _engine(model: str, **options: Any) -> Any:
    from pagedkv.engine import LLMEngine

    options.setdefault("max_step_time_s", 0)
    options.setdefault("dtype", "float32")
    options.setdefault("debug_integrity", True)
    return LLMEngine.from_options(model, **options)


def _drain(engine: Any) -> dict[str, Any]:
    """Step ``engine`` until idle; the finished requests' records by request id."""
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = record_outputs([out])[0]
    return dict(sorted(done.items()))


def _tenant_prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def case_tenancy(m: Models, tmp: Path) -> Any:
    """Tenants with KV quotas, conversation pins (one past max_tenant_pin_fraction), priorities and
    fault injection on a small pool; then a quiet tenant's prefix kept cached through a noisy
    tenant's burst by the noisy tenant's quota."""
    from pagedkv import SamplingParams

    out: dict[str, Any] = {}
    engine = _engine(m.get("llama"), block_size=B, num_kv_blocks=40, max_num_batched_tokens=40,
                     tenant_kv_quota=["a=0.3"], default_tenant_kv_quota=0.4, kv_offloading_size=0.0002,
                     max_tenant_pin_fraction=0.3, fault_injection="seed=2,rate=0.15")
    try:
        for i, n in enumerate([5, 30, 14, 22, 9, 41, 3, 18]):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=12 + i, ignore_eos=True)
            engine.add_request(f"r{i}", _tenant_prompt(i, n), params, tenant=("a", "b", "c")[i % 3],
                               priority=i % 2, conversation_id=f"chat-{i % 4}" if i % 2 else None)
        out["pins"] = {"requests": _drain(engine), "stats": record_stats(engine.stats())}
    finally:
        engine.close()
    engine = _engine(m.get("llama"), block_size=B, num_kv_blocks=48, max_num_batched_tokens=256,
                     kv_offloading_size=0, tenant_kv_quota=["noisy=0.5"])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        engine.add_request("q0", _tenant_prompt(1, 33), params, tenant="quiet")
        first = _drain(engine)
        for i in range(12):
            engine.add_request(f"n{i}", _tenant_prompt(100 + i, 40), params, tenant="noisy")
        first.update(_drain(engine))
        engine.add_request("q1", _tenant_prompt(1, 33), params, tenant="quiet")
        first.update(_drain(engine))
        out["quota"] = {"requests": first, "stats": record_stats(engine.stats())}
    finally:
        engine.close()
    return out


def case_default_model(m: Models, tmp: Path) -> Any:
    """The bundled default model (SmolLM2-135M GGUF): a few greedy tokens from text prompts."""
    from pagedkv import SamplingParams

    llm = _llm(None, block_size=16, num_kv_blocks=64, dtype="auto")
    return _case(llm, ["The capital of France is", "def fibonacci(n):"],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))


CASES = {"greedy": case_greedy, "sampling": case_sampling, "n_best": case_n_best, "beam": case_beam,
         "spec_ngram": case_spec_ngram, "spec_draft": case_spec_draft, "int8": case_int8,
         "hybrid": case_hybrid, "preemption": case_preemption, "faults": case_faults, "tiers": case_tiers,
         "tenancy": case_tenancy,
         "default_model": case_default_model}


def snapshot(cases: list[str], workdir: Path | None = None) -> dict[str, Any]:
    """Run ``cases`` and return ``{case: record}``; timings per case go to stderr."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with _deterministic(), tempfile.TemporaryDirectory(prefix="pagedkv-snap-", dir=workdir) as tmp:
        models = Models(Path(tmp) / "models")
        result = {}
        for name in cases:
            fn = CASES[name]
            case_dir = Path(tmp) / name
            case_dir.mkdir()
            start = time.perf_counter()
            result[name] = fn(models, case_dir)
            print(f"  {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return result


# ---------------------------------------------------------------------------------------- compare
def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ, as readable lines (``path: a != b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            p = f"{path}.{k}" if path else k
            if k not in a:
                out.append(f"{p}: only in B ({json.dumps(b[k])[:200]})")
            elif k not in b:
                out.append(f"{p}: only in A ({json.dumps(a[k])[:200]})")
            else:
                out.extend(differences(a[k], b[k], p))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) and all(not isinstance(x, (dict, list)) for x in a + b):
            return [f"{path}: {json.dumps(a)[:300]} != {json.dumps(b)[:300]}"]
        out = [f"{path}: length {len(a)} != {len(b)}"] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out.extend(differences(x, y, f"{path}[{i}]"))
        return out
    return [] if a == b else [f"{path}: {json.dumps(a)[:300]} != {json.dumps(b)[:300]}"]


def compare(path_a: str, path_b: str) -> int:
    a = json.loads(Path(path_a).read_text())
    b = json.loads(Path(path_b).read_text())
    diffs = differences(a.get("cases", a), b.get("cases", b))
    for line in diffs:
        print(line)
    print(f"{len(diffs)} difference(s) between {path_a} and {path_b}" if diffs else
          f"equal: {path_a} and {path_b}")
    return 1 if diffs else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the snapshot JSON here")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two snapshots; exit 1 on a difference")
    parser.add_argument("--cases", help="comma-separated subset of the cases (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, fn in CASES.items():
            print(f"{name:14s} {(fn.__doc__ or '').splitlines()[0]}")
        return 0
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("give --out PATH (or --compare A B)")
    cases = args.cases.split(",") if args.cases else list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list names them")
    import pagedkv

    start = time.perf_counter()
    result = snapshot(cases)
    meta = {"pagedkv": str(Path(pagedkv.__file__).resolve().parent), "cases_run": cases}
    Path(args.out).write_text(json.dumps({"cases": result, "meta": meta}, sort_keys=True, indent=1) + "\n")
    print(f"wrote {args.out} ({len(cases)} cases, {time.perf_counter() - start:.1f} s, pagedkv from "
          f"{meta['pagedkv']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
