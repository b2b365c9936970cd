"""GGUF Q8_0 weights kept quantized: the native ``q8_0_linear`` against float32 matmul on the same
(dequantized) weights, and PyTorch's own CPU weight-only ops for comparison.

For each weight shape (the default model's q/k/v-o, gate/up and a 7B-sized layer) and batch rows
M, the ops alternate (A B A B ...) ``--reps`` times; each figure is a median.

    .venv/bin/python bench/quant_matmul.py [--threads 1] [--reps 15]

Last line: one JSON object with ``speedup_<N>x<K>_m<M>`` (float32 time / q8_0 time) per shape and
M, ``torch_int8pack_vs_f32_m1`` and ``torch_int4pack_vs_f32_m1`` (float32 time / PyTorch op time
on the 7B-sized layer; below 1 means slower) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pagedkv.ops import native

SHAPES = [(576, 576), (1536, 576), (8192, 2048)]
ROWS = [1, 4, 8, 16, 32]


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).clamp_min(1e-12)
    return (blocks / d[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k).contiguous(), d.contiguous()


def timed(fns: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("native kernels unavailable: nothing to measure")
    out: dict[str, float] = {}
    for n, k in SHAPES:
        w = torch.randn(n, k)
        q, d = q8_0(w)
        deq = (q.float().view(n, k // 32, 32) * d[..., None]).view(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            res = torch.empty(m, n)
            t = timed({"q8_0": lambda: torch.ops.pagedkv.q8_0_linear(res, x, q, d),  # noqa: B023 - timed in this iteration
                       "f32": lambda: x @ deq.t()}, args.reps)  # noqa: B023 - timed in this iteration
            out[f"speedup_{n}x{k}_m{m}"] = round(t["f32"] / t["q8_0"], 3)
            print(f"{n:5d} x {k:4d}  M={m:2d}  q8_0 {t['q8_0'] * 1e3:7.3f} ms  float32 {t['f32'] * 1e3:7.3f} ms  "
                  f"speedup {t['f32'] / t['q8_0']:.2f}")
    n, k = SHAPES[-1]
    w, x = torch.randn(n, k), torch.randn(1, k)
    scales = w.abs().amax(1) / 127
    w8 = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    fns = {"f32": lambda: x @ w.t(),
           "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scales)}
    try:
        groups = w.view(n, k // 32, 32)
        gs = groups.abs().amax(-1) / 7
        q4 = ((groups / gs[..., None]).round().clamp(-8, 7) + 8).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        sz = torch.stack([gs.t().contiguous(), torch.zeros_like(gs.t())], -1).contiguous()
        fns["int4pack"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    except (RuntimeError, AttributeError) as e:
        print(f"PyTorch int4 weight-only matmul unavailable: {e}")
    t = timed(fns, args.reps)
    for name in ("int8pack", "int4pack"):
        if name in t:
            out[f"torch_{name}_vs_f32_m1"] = round(t["f32"] / t[name], 3)
            print(f"PyTorch {name} at M=1 on {n} x {k}: {t[name] * 1e3:.2f} ms against float32 {t['f32'] * 1e3:.2f} ms")
    out["threads"] = args.threads
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
