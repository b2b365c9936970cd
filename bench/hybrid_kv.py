"""KV blocks and bytes one sequence holds with the hybrid cache, for Gemma 3 shapes, against a cache
that keeps every layer's history.

The memory core itself is run (``KVCacheManager`` with the model's KV groups): one sequence is
prefilled in chunks of ``--chunk`` tokens and decoded to each context length; the blocks it holds
are read from the manager (``block_ids``) at the end and at their peak (a chunk's blocks are held
until the step that computes them is over). The full cache holds ``ceil(n / B)`` blocks of every
layer. Pure Python, no model weights: it takes seconds.

    .venv/bin/python bench/hybrid_kv.py [--contexts 4096,8192] [--block-size 16] [--chunk 2048]

Last line: one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import math

from pagedkv.memory import KVCacheManager
from pagedkv.model_shape import kv_blocks_per_sequence, kv_bytes_per_block, kv_groups, kv_layer_slots
from pagedkv.sim.presets import PRESETS

MODELS = ("gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b")


def run_sequence(windows: tuple[int | None, ...], context: int, block_size: int, chunk: int) -> tuple[int, int]:
    """(blocks held at ``context`` tokens, peak blocks held on the way) by the memory core."""
    kv = KVCacheManager(len(windows) * (context // block_size + 2), block_size,
                        enable_prefix_caching=False, kv_group_windows=windows)
    tokens = [7] * context
    prompt = tokens[:context // 2]  # half prompt (prefilled in chunks), half decoded
    seq: list[int] = list(prompt)
    kv.allocate_prompt("s", seq, min(chunk, len(prompt)))
    peak = 0
    while kv.num_computed("s") < context:
        done = kv.num_computed("s")
        if done >= len(seq):
            seq.append(7)  # a decoded token
        n = min(chunk, len(seq) - done)
        if done:
            kv.allocate_slots("s", n)
        peak = max(peak, len(kv.block_ids("s")))
        kv.mark_computed("s", n)
    kv.check_integrity()
    return len(kv.block_ids("s")), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kv-dtype", default="bfloat16")
    args = ap.parse_args()
    B = args.block_size
    rows = []
    print(f"{'model':<13} {'groups':<26} {'context':>7} {'blocks':>7} {'peak':>6} {'full-cache':>10} "
          f"{'KV MiB':>8} {'full MiB':>9} {'saving':>7}")
    for name in MODELS:
        shape = PRESETS[name]
        groups = kv_groups(shape)
        windows = tuple(g.window for g in groups)
        block_bytes = kv_bytes_per_block(shape, B, args.kv_dtype)
        full_block_bytes = block_bytes // kv_layer_slots(shape) * shape.num_hidden_layers
        for context in (int(c) for c in args.contexts.split(",")):
            held, peak = run_sequence(windows, context, B, args.chunk)
            assert held == kv_blocks_per_sequence(shape, context, B), (name, context, held)
            full_blocks = math.ceil(context / B)
            hybrid_bytes, full_bytes = held * block_bytes, full_blocks * full_block_bytes
            desc = f"{sum(g.window is None for g in groups)} full + {sum(g.window is not None for g in groups)} " \
                   f"sliding x {kv_layer_slots(shape)}"
            print(f"{name:<13} {desc:<26} {context:>7} {held:>7} {peak:>6} {full_blocks:>10} "
                  f"{hybrid_bytes / 2**20:>8.1f} {full_bytes / 2**20:>9.1f} {full_bytes / hybrid_bytes:>6.2f}x")
            rows.append({"model": name, "context": context, "blocks": held, "peak_blocks": peak,
                         "full_cache_blocks": full_blocks, "kv_bytes": hybrid_bytes,
                         "full_cache_kv_bytes": full_bytes, "saving_ratio": round(full_bytes / hybrid_bytes, 3)})
    print(json.dumps({"block_size": B, "chunk": args.chunk, "kv_dtype": args.kv_dtype, "rows": rows}))


if __name__ == "__main__":
    main()
