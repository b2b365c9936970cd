"""Paged decode attention vs contiguous ``F.scaled_dot_product_attention`` on the same K/V.

For each context length and block size, B sequences' K/V are written into a shuffled paged cache
(block tables never contiguous) and into contiguous ``[B, kv_heads, ctx, d]`` tensors. One decode
query per sequence is attended both ways; the two timings are interleaved (A B A B ...) and their
medians compared. The per-step metadata (gather indices, mask) is built once per step and shared by
all layers, so it is timed separately and reported amortized over ``--layers``.

    .venv/bin/python bench/attention.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from pagedkv.ops import DecodeMetadata, paged_decode_attention, write_kv


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

    def paged() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta)

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_contig, v_contig,
                                              enable_gqa=heads != kvh).squeeze(2)

    torch.testing.assert_close(paged(), contiguous(), atol=1e-4, rtol=1e-4)
    for _ in range(args.warmup):
        paged()
        contiguous()
    t_paged, t_contig = [], []
    for _ in range(args.reps):  # interleaved so machine noise hits both alike
        t_paged += _time(paged, 1)
        t_contig += _time(contiguous, 1)
    t_build = statistics.median(_time(build, max(3, args.reps // 4)))
    paged_s, contig_s = statistics.median(t_paged), statistics.median(t_contig)
    return {
        "ctx": ctx, "block_size": block_size, "paged_ms": paged_s * 1e3, "contiguous_ms": contig_s * 1e3,
        "ratio": paged_s / contig_s, "metadata_ms": t_build * 1e3,
        "ratio_with_metadata": (paged_s + t_build / args.layers) / contig_s,
    }


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with torch.inference_mode():
        for ctx in args.contexts:
            for bs in args.block_sizes:
                results.append(run_case(ctx, bs, args))
    print(f"paged / contiguous decode attention time (median of {args.reps}, interleaved); "
          f"batch={args.batch} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
          f"threads={args.threads} load={os.getloadavg()[0]:.2f}")
    header = "ctx \\ block " + "".join(f"{bs:>8d}" for bs in args.block_sizes) + "   contiguous_ms"
    print(header)
    for ctx in args.contexts:
        row = [r for r in results if r["ctx"] == ctx]
        print(f"{ctx:>12d} " + "".join(f"{r['ratio']:8.2f}" for r in row) + f"   {row[0]['contiguous_ms']:.3f}")
    print("with per-step metadata amortized over", args.layers, "layers:")
    for ctx in args.contexts:
        row = [r for r in results if r["ctx"] == ctx]
        print(f"{ctx:>12d} " + "".join(f"{r['ratio_with_metadata']:8.2f}" for r in row))
    summary = {
        "bench": "attention", "threads": args.threads, "batch": args.batch, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "torch": torch.__version__,
        "median_ratio": statistics.median(r["ratio"] for r in results), "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
