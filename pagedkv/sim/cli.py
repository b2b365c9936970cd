"""``pagedkv simulate`` and ``pagedkv size``: argument parsers and entry points.

The top-level CLI wires these in with ``add_simulate_parser(subparsers)`` /
``add_size_parser(subparsers)``; each parser sets ``func`` to its ``run_*`` function, which returns
the process exit code (2 and a one-line message on stderr for a bad argument).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
from typing import Any

from pagedkv.workloads import BENCHMARK_CASES, NAMED_SHAPES, resolve_shape

_DATASETS = [*NAMED_SHAPES, "custom"]


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="sharegpt", choices=_DATASETS,
                   help="length distributions: sharegpt (long tail), alpaca (short), custom")
    p.add_argument("--prompt-len", metavar="DIST",
                   help="override prompt lengths: fixed:N, uniform:LO-HI, lognormal:MEDIAN,SIGMA")
    p.add_argument("--output-len", metavar="DIST", help="override output lengths (same forms)")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an ``argparse`` subparsers object; returns the new parser."""
    from pagedkv.model_shape import KV_DTYPE_BYTES
    from pagedkv.sim.policies import DEFAULT_BLOCK_SIZES, DEFAULT_POLICIES

    p = subparsers.add_parser(
        "simulate", help="compare KV memory policies on a simulated serving workload",
        description="Discrete-event simulation of continuous batching: the same request trace "
                    "against contiguous, buddy and paged KV memory (the real KVCacheManager).")
    w = p.add_argument_group("workload")
    _add_dataset_flags(w)
    w.add_argument("--trace", metavar="CSV",
                   help="rows of prompt_len,output_len[,n,beam_width,prefix_id[,tenant[,arrival_step]]], or "
                        "columns named by a header row (replaces --dataset); tenant: who owns the request's KV "
                        "(its own prefix cache, its quota); arrival_step: fixed arrival, else --rate/--clients")
    w.add_argument("--tenant", action="append", metavar="NAME:KEY=VALUE,...", dest="tenants",
                   help="one tenant's traffic, repeat for more (replaces --dataset/--trace, --num-requests, "
                        "--rate, --clients, --turns, --prefix-len): requests=N (100), rate=R (Poisson arrivals "
                        "per step) or every=S (an arrival every S steps; neither: all at start), burst=K "
                        "(requests per arrival, 1), start=STEP (0), prefix=TOKENS (its own system prompt, 0), "
                        "prompt=DIST and output=DIST (as --prompt-len; prompt counts the tokens after the "
                        "system prompt; default: --dataset's); e.g. noisy:requests=48,every=60,burst=8,"
                        "prompt=fixed:400,output=fixed:48")
    w.add_argument("--case", choices=list(BENCHMARK_CASES),
                   help="a benchmark case of pagedkv.workloads (e.g. case_d: 32 requests sharing a 2,048-token "
                        "prefix); replaces --dataset, --num-requests, --prefix-len and --max-model-len")
    w.add_argument("--num-requests", type=int, default=500)
    w.add_argument("--rate", type=float, default=math.inf,
                   help="Poisson arrivals in requests per step (default inf: all at step 0)")
    w.add_argument("--clients", type=int, default=0,
                   help="closed loop of N clients, each sending its next request on completion")
    w.add_argument("--think-steps", type=int, default=0, help="client/chat delay after a completion")
    w.add_argument("--turns", type=int, default=1, help="turns per chat (each resends the history)")
    w.add_argument("--prefix-len", type=int, default=0, help="shared system-prompt tokens")
    w.add_argument("--num-prefixes", type=int, default=1, help="distinct system prompts")
    w.add_argument("--n", type=int, default=1, help="parallel samples per request")
    w.add_argument("--beam-width", type=int, default=1)
    w.add_argument("--beam-reshuffle", type=float, default=0.2,
                   help="per-step probability that a beam is replaced by a copy of another")
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("memory")
    m.add_argument("--kv-tokens", type=int,
                   help="KV capacity in token slots (default 65536, or from --model)")
    m.add_argument("--model", help="derive capacity from a preset/config.json/.gguf (see size)")
    m.add_argument("--device-memory", default="80GiB", help="with --model (e.g. 80GiB)")
    m.add_argument("--kv-dtype", default="fp16", help=f"with --model: {', '.join(KV_DTYPE_BYTES)}")
    m.add_argument("--reserved-fraction", type=float, default=0.10, help="with --model")
    m.add_argument("--tp", type=int, default=1, help="with --model")
    m.add_argument("--max-model-len", type=int, default=2048)
    m.add_argument("--max-num-seqs", type=int, default=1024, help="running sequences cap")
    m.add_argument("--watermark", type=float, default=0.01,
                   help="paged: fraction of blocks a new prompt must leave free")
    m.add_argument("--eviction-policy", default="lru",
                   help="paged+prefix: which cached block to evict first (lru, fifo, lrc)")
    m.add_argument("--tenant-kv-quota", action="append", metavar="NAME=FRACTION",
                   help="paged: the share of the KV pool tenant NAME may hold, in use plus cached; over it, "
                        "its own cached blocks are evicted first and its new requests wait while other "
                        "tenants' go on (repeat for more tenants; as pagedkv serve; contiguous and buddy "
                        "ignore tenants and quotas)")
    m.add_argument("--default-tenant-kv-quota", metavar="FRACTION",
                   help="paged: the share of the KV pool each tenant without a --tenant-kv-quota may hold "
                        "(default: no limit; requests naming no tenant are tenant 'default')")
    s = p.add_argument_group("policies and output")
    s.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="contiguous-max, contiguous-oracle, buddy, paged[+prefix][+cow][@B]")
    s.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
                   help="block sizes for paged policies given without @B")
    s.add_argument("--sample-every", type=int, default=1, help="steps between memory samples")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.add_argument("--plot", metavar="FILE.png", help="plot waste and concurrency (matplotlib)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_simulate)
    return p


def add_size_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``size`` on an ``argparse`` subparsers object; returns the new parser."""
    from pagedkv.block_size import AUTO, DEVICE_KINDS, parse_block_size
    from pagedkv.model_shape import KV_DTYPE_BYTES, KV_QUANT_PARTS, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
    from pagedkv.sim.presets import PRESETS

    p = subparsers.add_parser(
        "size", help="KV cache bytes, blocks and concurrency for a model on a device",
        description="Size the paged KV cache of a model: a preset "
                    f"({', '.join(PRESETS)}), a HF config.json (or its folder) or a .gguf file.")
    p.add_argument("model", help="preset name, config.json path or .gguf path")
    p.add_argument("--device-memory", default="80GiB", help="per device (80GiB, 71GB, ...)")
    p.add_argument("--kv-memory", help="KV memory per rank, overriding the device budget")
    p.add_argument("--weight-memory", help="weights, all ranks (default: parameters x dtype)")
    p.add_argument("--weight-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    p.add_argument("--reserved-fraction", type=float, default=0.10,
                   help="device memory kept for activations, graphs and the runtime")
    p.add_argument("--kv-dtype", default="fp16", help=", ".join(KV_DTYPE_BYTES))
    p.add_argument("--kv-sink-blocks", type=int, default=0,
                   help="with an 8-bit --kv-dtype: blocks a sequence kept at --sink-dtype in a mixed pool, "
                        "split as the engine's kv_sink_blocks splits it (docs/kv_quantization.md)")
    p.add_argument("--sink-dtype", default="bf16", help="the full precision of those blocks (the model dtype)")
    p.add_argument("--kv-quant-parts", default="kv", choices=KV_QUANT_PARTS,
                   help="with an 8-bit --kv-dtype: kv (K and V 8-bit), or v (V 8-bit, K at --sink-dtype), as the "
                        "engine's kv_quant_parts")
    p.add_argument("--block-size", type=parse_block_size, default=AUTO,
                   help=f"tokens per KV block, {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE} (the engine's bounds), or auto "
                        f"(default): the size `pagedkv serve` picks for this model, --max-len and --device")
    p.add_argument("--block-size-seq-len", type=int, metavar="TOKENS",
                   help="with --block-size auto: the workload's typical running sequence length, as serve's "
                        "--block-size-seq-len (without it, the auto line also says what this --dataset's mean "
                        "live length would give)")
    p.add_argument("--device", default="auto", choices=("auto", *DEVICE_KINDS),
                   help="the device --block-size auto chooses for (its row of pagedkv/block_size_table.json); "
                        "auto: cuda where an NVIDIA driver is loaded, else cpu")
    p.add_argument("--max-len", type=int, help="max context (default: the model's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--max-waste", type=float, default=0.02,
                   help="internal-waste target for the block-size recommendation")
    _add_dataset_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run_size)
    return p


def _sizing_inputs(args: argparse.Namespace, block_size: int) -> Any:
    from pagedkv.sim.sizing import SizingInputs
    from pagedkv.units import parse_bytes

    kv_memory = getattr(args, "kv_memory", None)
    weight_memory = getattr(args, "weight_memory", None)
    return SizingInputs(
        device_memory=None if kv_memory else parse_bytes(args.device_memory, "--device-memory"),
        kv_memory=parse_bytes(kv_memory, "--kv-memory") if kv_memory else None,
        weight_memory=parse_bytes(weight_memory, "--weight-memory") if weight_memory else None,
        weight_dtype=getattr(args, "weight_dtype", "bf16"),
        reserved_fraction=args.reserved_fraction, kv_dtype=args.kv_dtype, block_size=block_size,
        max_len=getattr(args, "max_len", None), tp=args.tp,
        max_waste=getattr(args, "max_waste", 0.02), kv_sink_blocks=getattr(args, "kv_sink_blocks", 0),
        sink_dtype=getattr(args, "sink_dtype", "bf16"), kv_quant_parts=getattr(args, "kv_quant_parts", "kv"))


def run_size(args: argparse.Namespace) -> int:
    """``pagedkv size``: print the sizing table (or ``--json``). Returns the exit code."""
    from pagedkv.block_size import is_auto
    from pagedkv.sim.model_spec import load_model_spec
    from pagedkv.sim.report import size_table
    from pagedkv.sim.sizing import DoesNotFit, size_kv_cache

    try:
        spec = load_model_spec(args.model)
        shape = resolve_shape(args.dataset, args.prompt_len, args.output_len)
        block_size, note = _block_size(args, spec)
        result = size_kv_cache(spec, _sizing_inputs(args, block_size), shape)
    except DoesNotFit as exc:  # what would fit: the smallest --tp, the widest weight format
        print(json.dumps(exc.as_dict(), indent=2) if args.json else f"pagedkv size: does not fit: {exc}",
              file=sys.stdout if args.json else sys.stderr)
        return 1
    except ValueError as exc:
        print(f"pagedkv size: error: {exc}", file=sys.stderr)
        return 2
    if is_auto(args.block_size) and args.block_size_seq_len is None:  # the workload's own choice, as a hint
        note += _workload_hint(args, spec, result.mean_live_len)
    result.block_size_choice = note
    print(json.dumps(result.as_dict(), indent=2) if args.json else size_table(result))
    return 0


def _block_size(args: argparse.Namespace, spec: Any) -> tuple[int, str]:
    """``--block-size`` resolved as the engine resolves ``block_size`` (``auto``: the same
    :func:`choose_block_size` call, for --device and the max length), with the choice's reason or
    an explicit size's warning ("" when none)."""
    from pagedkv.block_size import Device, block_size_warning, check_block_size_setting, choose_block_size, is_auto

    setting = check_block_size_setting(args.block_size, "--block-size")
    max_len = args.max_len or spec.max_position_embeddings
    device = Device(local_device_kind() if args.device == "auto" else args.device)
    seq_len = args.block_size_seq_len
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--block-size-seq-len: must be >= 1, got {seq_len}")
    if is_auto(setting):
        choice = choose_block_size(spec, max_len, device, seq_len=seq_len)
        return choice.block_size, str(choice)
    assert isinstance(setting, int)
    return setting, f"warning: {warning}" if (warning := block_size_warning(setting, max_len, device)) else ""


def _workload_hint(args: argparse.Namespace, spec: Any, mean_live: float) -> str:
    """What ``--block-size-seq-len`` set to the dataset's mean live length would choose."""
    from pagedkv.block_size import Device, choose_block_size

    seq_len = max(1, round(mean_live))
    device = Device(local_device_kind() if args.device == "auto" else args.device)
    workload = choose_block_size(spec, args.max_len or spec.max_position_embeddings, device, seq_len=seq_len)
    return (f" (for this --dataset, mean live length {seq_len}: --block-size-seq-len {seq_len} gives "
            f"{workload.block_size})")


def local_device_kind() -> str:
    """``cuda`` where an NVIDIA driver is loaded, else ``cpu``: what the engine's ``device="auto"``
    finds with a CUDA build of torch (this tool imports no torch)."""
    from pathlib import Path

    return "cuda" if Path("/proc/driver/nvidia/version").exists() else "cpu"


def _capacity(args: argparse.Namespace) -> int:
    if args.kv_tokens is not None:
        if args.kv_tokens < 1:
            raise ValueError(f"--kv-tokens: must be >= 1, got {args.kv_tokens}")
        return int(args.kv_tokens)
    if not args.model:
        return 65536
    from pagedkv.sim.model_spec import load_model_spec
    from pagedkv.sim.sizing import size_kv_cache
    from pagedkv.workloads import SHAREGPT

    result = size_kv_cache(load_model_spec(args.model), _sizing_inputs(args, 1), SHAREGPT)
    return result.token_capacity


def _group_windows(args: argparse.Namespace) -> tuple[int | None, ...]:
    """The KV groups of ``--model`` (a hybrid model's sliding-window groups), else one group."""
    if not args.model:
        return (None,)
    from pagedkv.model_shape import kv_groups
    from pagedkv.sim.model_spec import load_model_spec

    return tuple(g.window for g in kv_groups(load_model_spec(args.model)))


def run_simulate(args: argparse.Namespace) -> int:
    """``pagedkv simulate``: run every policy on one trace, print a table (or ``--json``)."""
    from pagedkv.sim.policies import parse_block_sizes, parse_policies
    from pagedkv.sim.report import plot_results, simulate_table, tenant_table
    from pagedkv.sim.simulator import SimConfig, simulate
    from pagedkv.sim.workload import (
        WorkloadConfig,
        generate_tenant_workload,
        generate_workload,
        load_trace,
        parse_tenant_spec,
    )

    if args.plot and importlib.util.find_spec("matplotlib") is None:  # said before a long simulation
        print("pagedkv simulate: --plot needs matplotlib, which is not installed: install the plot extra "
              "(.venv/bin/pip install -e '.[plot]', or pip install matplotlib), or leave --plot out",
              file=sys.stderr)
        return 2
    try:
        shape = resolve_shape(args.dataset, args.prompt_len, args.output_len)
        specs = parse_policies(args.policies, parse_block_sizes(args.block_sizes))
        workload = WorkloadConfig(
            shape=shape, num_requests=args.num_requests, max_model_len=args.max_model_len,
            rate=args.rate, clients=args.clients, think_steps=args.think_steps, turns=args.turns,
            prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, n=args.n,
            beam_width=args.beam_width, seed=args.seed)
        if args.case:  # the benchmark's own definition, with this run's seed
            workload = dataclasses.replace(BENCHMARK_CASES[args.case], seed=args.seed)
            shape, args.max_model_len = workload.shape, workload.max_model_len
        if args.tenants and args.trace:
            raise ValueError("--tenant and --trace: give one or the other (a trace names tenants in a column)")
        if args.tenants:
            requests = generate_tenant_workload([parse_tenant_spec(t) for t in args.tenants], workload)
        elif args.trace:
            requests = load_trace(args.trace, workload)
        else:
            requests = generate_workload(workload)
        quotas, default_quota = _tenant_quotas(args)
        config = SimConfig(capacity=_capacity(args), max_model_len=args.max_model_len,
                           kv_group_windows=_group_windows(args),
                           max_num_seqs=args.max_num_seqs, watermark=args.watermark,
                           eviction_policy=args.eviction_policy,
                           beam_reshuffle=args.beam_reshuffle, sample_every=args.sample_every,
                           seed=args.seed, tenant_quotas=tuple(quotas.items()),
                           default_tenant_quota=default_quota)
        config.validate()
    except (ValueError, OSError) as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    bar = tqdm(total=len(requests) * len(specs), unit="req", file=sys.stderr,
               disable=args.quiet or not sys.stderr.isatty())
    results = []
    for spec in specs:
        bar.set_description(spec.name)
        results.append(simulate(requests, spec, config, on_complete=bar.update))
    bar.close()
    trace = args.trace or f"{shape.name}: prompt {shape.prompt.describe()}, " \
                          f"output {shape.output.describe()}"
    if args.tenants:
        trace = "tenants " + "; ".join(args.tenants)
    tenant_counts: dict[str, int] = {}  # requests per tenant, when the trace names tenants
    if any(r.tenant is not None for r in requests):
        for r in requests:
            tenant_counts[r.tenant or "default"] = tenant_counts.get(r.tenant or "default", 0) + 1
    if args.plot:
        plot_results(results, args.plot, title=f"{trace}, {config.capacity:,} KV slots")
    if args.json:
        print(json.dumps({
            "workload": {"trace": trace, "num_requests": len(requests),
                         "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
                         "mean_output_len": sum(r.output_len for r in requests) / len(requests),
                         "rate": None if math.isinf(args.rate) else args.rate,
                         "clients": args.clients, "seed": args.seed,
                         "tenants": tenant_counts or None},
            "kv_tokens": config.capacity, "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "tenant_kv_quotas": dict(config.tenant_quotas),
            "default_tenant_kv_quota": config.default_tenant_quota,
            "policies": [r.as_dict() for r in results],
        }, indent=2))
    else:
        print(f"workload: {len(requests)} requests, {trace}; KV capacity {config.capacity:,} "
              f"token slots; max_model_len {config.max_model_len}")
        print(simulate_table(results))
        if any(r.tenants for r in results):
            limits = [f"{n}={f:g}" for n, f in config.tenant_quotas]
            if config.default_tenant_quota is not None:
                limits.append(f"others={config.default_tenant_quota:g}")
            print(f"\nper tenant (steps; KV quotas: {', '.join(limits) or 'none'}; paged policies only):")
            print(tenant_table(results))
    return 0


def _tenant_quotas(args: argparse.Namespace) -> tuple[dict[str, float], float | None]:
    """``--tenant-kv-quota`` items and ``--default-tenant-kv-quota`` as fractions; ValueError names
    the flag and the bad item."""
    from pagedkv.memory.tenant_ledger import check_fraction, parse_quotas

    try:
        quotas = parse_quotas(args.tenant_kv_quota)
    except ValueError as exc:
        raise ValueError(str(exc).replace("tenant_kv_quota", "--tenant-kv-quota", 1)) from None
    default = args.default_tenant_kv_quota
    if default is not None:
        default = check_fraction(default, "--default-tenant-kv-quota")
    return quotas, default


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.sim {simulate,size} ...`` until the top-level CLI wires these in."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv.sim")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(subparsers)
    add_size_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))
