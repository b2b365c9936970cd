"""Paged decode attention vs contiguous ``F.scaled_dot_product_attention`` on the same K/V.

For each context length and block size, B sequences' K/V are written into a shuffled paged cache
(block tables never contiguous) and into contiguous ``[B, kv_heads, ctx, d]`` tensors. One decode
query per sequence is attended by the paged paths and by contiguous SDPA; the timings are
interleaved (A B C A B C ...) and their medians compared. Paged paths: ``native``, the C++ kernel
that reads blocks in place (``pagedkv/ops/csrc``, what the engine runs where it builds), and
``plain``, the PyTorch fallback (gather K + ``embedding_bag`` over V). Per-step metadata is built
once per step and shared by all layers, so it is timed separately and amortized over ``--layers``.

``--shared``: decode rows that share a prefix (64 rows x 1,024 shared + 64 own tokens, every layer
of the default model's shape), attended per row and with the shared run attended once for all rows
(shared-block attention, ``pagedkv/ops/cascade.py``), float32 and int8 blocks; the last line is JSON
with ``shared_prefix_speedup`` and ``shared_prefix_speedup_int8``.

    .venv/bin/python bench/attention.py --threads 1
    .venv/bin/python bench/attention.py --threads 1 --shared --reps 10
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from pagedkv.ops import DecodeMetadata, native, paged_decode_attention, write_kv
from pagedkv.ops.paged_attention import NativeMetadata, native_paged_attention


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run_case(ctx: int, block_size: int, args: argparse.Namespace) -> dict[str, float]:
    gen = torch.Generator().manual_seed(ctx * 1000 + block_size)
    b, heads, kvh, d = args.batch, args.heads, args.kv_heads, args.head_dim
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = b * blocks_per_seq + 8
    k_cache = torch.zeros(num_blocks, block_size, kvh, d)
    v_cache = torch.zeros(num_blocks, block_size, kvh, d)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k = torch.randn(b, ctx, kvh, d, generator=gen)
    v = torch.randn(b, ctx, kvh, d, generator=gen)
    tables = []
    pos = torch.arange(ctx)
    for i in range(b):
        table, perm = perm[:blocks_per_seq], perm[blocks_per_seq:]
        tables.append(table)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv(k_cache, v_cache, k[i], v[i], slots)
    q = torch.randn(b, heads, d, generator=gen)
    k_contig = k.transpose(1, 2).contiguous()  # [B, kv_heads, ctx, d]
    v_contig = v.transpose(1, 2).contiguous()

    def build() -> DecodeMetadata:
        return DecodeMetadata.build(tables, [ctx] * b, block_size=block_size, num_heads=heads,
                                    kv_heads=kvh, head_dim=d, dtype=torch.float32)

    meta = build()

    def build_native() -> NativeMetadata:
        return NativeMetadata.build(tables, list(range(b)), [ctx] * b)

    native_meta = build_native() if args.native else None
    out = torch.empty(b, heads, d)

    def paged() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta)

    def paged_native() -> torch.Tensor:
        return native_paged_attention(out, q, k_cache, v_cache, native_meta)  # type: ignore[arg-type]  # --native: built

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_contig, v_contig,
                                              enable_gqa=heads != kvh).squeeze(2)

    torch.testing.assert_close(paged(), contiguous(), atol=1e-4, rtol=1e-4)
    if args.native:
        torch.testing.assert_close(paged_native(), contiguous(), atol=1e-4, rtol=1e-4)
    for _ in range(args.warmup):
        paged()
        contiguous()
        if args.native:
            paged_native()
    t_paged, t_contig, t_native = [], [], []
    for _ in range(args.reps):  # interleaved so machine noise hits all alike
        t_paged += _time(paged, 1)
        t_contig += _time(contiguous, 1)
        if args.native:
            t_native += _time(paged_native, 1)
    reps = max(3, args.reps // 4)
    t_build = statistics.median(_time(build, reps))
    paged_s, contig_s = statistics.median(t_paged), statistics.median(t_contig)
    row = {
        "ctx": ctx, "block_size": block_size, "plain_ms": paged_s * 1e3, "contiguous_ms": contig_s * 1e3,
        "plain_ratio": paged_s / contig_s, "plain_metadata_ms": t_build * 1e3,
        "plain_ratio_with_metadata": (paged_s + t_build / args.layers) / contig_s,
    }
    if args.native:
        native_s = statistics.median(t_native)
        t_native_build = statistics.median(_time(build_native, reps))
        row.update(native_ms=native_s * 1e3, native_ratio=native_s / contig_s,
                   native_metadata_ms=t_native_build * 1e3,
                   native_ratio_with_metadata=(native_s + t_native_build / args.layers) / contig_s)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="layers sharing one step's metadata")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 4096])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-native", dest="native", action="store_false", help="time the plain path only")
    ap.add_argument("--block-size-sweep", action="store_true",
                    help="measure the native kernel's block-size preference over --contexts and --block-sizes "
                         "and print the device row of pagedkv/block_size_table.json")
    ap.add_argument("--write", action="store_true",
                    help="with --block-size-sweep: store the row as the 'cpu' entry of the committed table")
    ap.add_argument("--shared", action="store_true",
                    help="shared-block (cascade) attention: --shared-rows decode rows sharing --shared-tokens "
                         "tokens (plus --own-tokens each), all --layers, float32 and int8 blocks, with and "
                         "without the sharing detected; last line JSON shared_prefix_speedup(_int8)")
    ap.add_argument("--shared-rows", type=int, default=64)
    ap.add_argument("--shared-tokens", type=int, default=1024)
    ap.add_argument("--own-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="--shared: the pool's block size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.native and not native.available():
        print(f"native kernels unavailable ({native.why_unavailable()}): timing the plain path only")
        args.native = False
    if args.block_size_sweep:
        block_size_sweep(args)
        return
    if args.shared:
        shared_prefix(args)
        return
    results = []
    with torch.inference_mode():
        for ctx in args.contexts:
            for bs in args.block_sizes:
                results.append(run_case(ctx, bs, args))
    print(f"paged / contiguous decode attention time (median of {args.reps}, interleaved); "
          f"batch={args.batch} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
          f"threads={args.threads} load={os.getloadavg()[0]:.2f}")
    header = "ctx \\ block " + "".join(f"{bs:>8d}" for bs in args.block_sizes) + "   contiguous_ms"
    for path in ("native", "plain") if args.native else ("plain",):
        for key, title in ((f"{path}_ratio", ""), (f"{path}_ratio_with_metadata", ", metadata amortized over "
                                                    f"{args.layers} layers")):
            print(f"{path}{title}:")
            print(header)
            for ctx in args.contexts:
                row = [r for r in results if r["ctx"] == ctx]
                print(f"{ctx:>12d} " + "".join(f"{r[key]:8.2f}" for r in row) + f"   {row[0]['contiguous_ms']:.3f}")
    path = "native" if args.native else "plain"
    gate = [r[f"{path}_ratio"] for r in results if r["block_size"] == 16 and r["ctx"] >= 512]
    summary = {
        "bench": "attention", "path": path, "threads": args.threads, "batch": args.batch, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0],
        "median_ratio": statistics.median(r[f"{path}_ratio"] for r in results),
        "max_ratio_block16_ctx_ge_512": max(gate) if gate else None, "results": results,
    }
    print(json.dumps(summary))


def _sweep_context(ctx: int, sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Median native decode time per block size at ``ctx`` (the step's metadata amortized over
    ``--layers``), every size timed in turn within each repetition so load changes hit all alike."""
    gen = torch.Generator().manual_seed(ctx)
    b, kvh, d = args.batch, args.kv_heads, args.head_dim
    k, v = torch.randn(b, ctx, kvh, d, generator=gen), torch.randn(b, ctx, kvh, d, generator=gen)
    q = torch.randn(b, args.heads, d, generator=gen)
    out = torch.empty(b, args.heads, d)
    calls = {}
    for bs in sizes:  # each size's own shuffled cache holding the same K/V
        per_seq = -(-ctx // bs)
        k_cache, v_cache = torch.zeros(b * per_seq + 8, bs, kvh, d), torch.zeros(b * per_seq + 8, bs, kvh, d)
        perm = torch.randperm(b * per_seq + 8, generator=gen).tolist()
        tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(b)]
        pos = torch.arange(ctx)
        for i, table in enumerate(tables):
            write_kv(k_cache, v_cache, k[i], v[i], torch.tensor(table)[pos // bs] * bs + pos % bs)

        def call(k_cache=k_cache, v_cache=v_cache, tables=tables) -> None:
            meta = NativeMetadata.build(tables, list(range(b)), [ctx] * b)
            for _ in range(args.layers):  # one step: metadata once, attention per layer
                native_paged_attention(out, q, k_cache, v_cache, meta)
        calls[bs] = call
    for _ in range(args.warmup):
        for call in calls.values():
            call()
    times: dict[int, list[float]] = {bs: [] for bs in sizes}
    for _ in range(args.reps):
        for bs, call in calls.items():
            times[bs] += _time(call, 1)
    return {bs: statistics.median(t) for bs, t in times.items()}


def block_size_sweep(args: argparse.Namespace) -> None:
    """The kernel's measured block-size preference on this machine, per context length: the row
    ``block_size="auto"`` reads (``pagedkv/block_size.py``). For each context, each block size's
    decode time (metadata amortized over ``--layers``) relative to block 16's; the preferred size is
    the one with the least time per token held (``pagedkv.block_size.preferred_block_size``: a larger
    block must be faster by more than the slots its tail wastes)."""
    import platform

    from pagedkv.block_size import AUTO_MIN_BLOCK_SIZE, preferred_block_size, write_device_row

    if not args.native:
        raise SystemExit("--block-size-sweep measures the native kernel, which is unavailable here")
    sizes = sorted(set(args.block_sizes) | {AUTO_MIN_BLOCK_SIZE})
    relative: dict[str, dict[str, float]] = {}
    preferred: dict[str, int] = {}
    with torch.inference_mode():
        for ctx in args.contexts:
            times = _sweep_context(ctx, sizes, args)
            relative[str(ctx)] = {str(bs): round(t / times[AUTO_MIN_BLOCK_SIZE], 3) for bs, t in times.items()}
            preferred[str(ctx)] = preferred_block_size(ctx, {bs: t / times[AUTO_MIN_BLOCK_SIZE]
                                                             for bs, t in times.items()})
            print(f"ctx {ctx:>6d}: " + "  ".join(f"{bs}:{r:.2f}" for bs, r in relative[str(ctx)].items())
                  + f"  -> {preferred[str(ctx)]}", flush=True)
    row = {
        "source": "measured",
        "command": (f"bench/attention.py --block-size-sweep --threads {args.threads} --batch {args.batch} "
                    f"--heads {args.heads} --kv-heads {args.kv_heads} --head-dim {args.head_dim} --contexts "
                    + " ".join(map(str, args.contexts)) + " --block-sizes " + " ".join(map(str, sizes))
                    + f" --layers {args.layers} --reps {args.reps}"),
        "kernel": "native (pagedkv/ops/csrc), float32, decode",
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "batch": args.batch},
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} cores, "
                   f"load {os.getloadavg()[0]:.2f}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "preferred": preferred,
        "relative_time": relative,
    }
    print(json.dumps(row, indent=2))
    if args.write:
        print(f"wrote the 'cpu' row of {write_device_row('cpu', row)}")


def _shared_step(args: argparse.Namespace, kind: str, gen: torch.Generator):
    """--shared: one decode step's inputs and per-layer pools (every layer its own K/V, as a
    model's, so the step's working set is all layers' blocks), and the step with and without the
    sharing detected."""
    from pagedkv.ops.cascade import cascade_attention, find_shared_runs

    b, bs, kvh, d = args.shared_rows, args.block_size, args.kv_heads, args.head_dim
    shared_blocks, own_blocks = -(-args.shared_tokens // bs), -(-args.own_tokens // bs)
    num_blocks = shared_blocks + b * own_blocks + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: tables never contiguous
    prefix, rest = perm[:shared_blocks], perm[shared_blocks:]
    tables = [prefix + rest[i * own_blocks:(i + 1) * own_blocks] for i in range(b)]
    row_seq, row_len = list(range(b)), [args.shared_tokens + args.own_tokens] * b
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    for _ in range(args.layers):
        if kind == "int8":
            k = torch.randint(-127, 128, (num_blocks, bs, kvh, d), dtype=torch.int8, generator=gen)
            v = torch.randint(-127, 128, (num_blocks, bs, kvh, d), dtype=torch.int8, generator=gen)
            ks, vs = torch.rand(num_blocks, kvh, generator=gen) / 127, torch.rand(num_blocks, kvh, generator=gen) / 127
            layers.append((k, v, ks, vs))
        else:
            layers.append((torch.randn(num_blocks, bs, kvh, d, generator=gen),
                           torch.randn(num_blocks, bs, kvh, d, generator=gen), None, None))
    q = torch.randn(b, args.heads, d, generator=gen)
    out = torch.empty(b, args.heads, d)

    def step(sharing: bool) -> torch.Tensor:
        meta = NativeMetadata.build(tables, row_seq, row_len)  # once per step, as the runner
        plan = find_shared_runs(tables, row_seq, row_len, bs) if sharing else None
        for k, v, ks, vs in layers:
            cascade_attention(out, q, k, v, meta, plan, k_scales=ks, v_scales=vs)
        return out

    return step


def shared_prefix(args: argparse.Namespace) -> None:
    """Decode attention of rows sharing a prefix, attended per row and with the shared run attended
    once for all rows (``pagedkv/ops/cascade.py``); one step = every layer, timed A B A B."""
    from pagedkv.ops import cascade

    if not cascade.available():
        raise SystemExit("--shared measures the native cascade kernel, which is unavailable here: "
                         f"{native.why_unavailable() or 'an older build without cascade_attention'}")
    speedups: dict[str, float] = {}
    rows: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for kind in ("float32", "int8"):
            step = _shared_step(args, kind, torch.Generator().manual_seed(0))
            alone = step(False).clone()
            torch.testing.assert_close(step(True), alone, atol=2e-5, rtol=1e-5)
            for _ in range(args.warmup):
                step(False)
                step(True)
            t_alone, t_shared = [], []
            for _ in range(args.reps):  # A B A B: machine noise hits both alike
                t_alone += _time(functools.partial(step, False), 1)
                t_shared += _time(functools.partial(step, True), 1)
            a, s = statistics.median(t_alone), statistics.median(t_shared)
            speedups[kind] = a / s
            rows[kind] = {"per_row_ms": a * 1e3, "shared_ms": s * 1e3, "speedup": a / s}
            print(f"{kind:>8}: per-row {a * 1e3:8.2f} ms  shared once {s * 1e3:8.2f} ms  speedup {a / s:5.2f}x  "
                  f"({args.layers} layers, median of {args.reps})", flush=True)
    print(json.dumps({
        "bench": "attention_shared", "threads": args.threads, "rows": args.shared_rows,
        "shared_tokens": args.shared_tokens, "own_tokens": args.own_tokens, "block_size": args.block_size,
        "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "reps": args.reps, "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0], "results": rows,
        "shared_prefix_speedup": speedups["float32"], "shared_prefix_speedup_int8": speedups["int8"],
    }))


if __name__ == "__main__":
    main()
