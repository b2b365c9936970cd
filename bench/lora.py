"""LoRA serving cost: case b's requests spread over 4 adapters against the same requests on the base model.

    .venv/bin/python bench/lora.py [--threads 1] [--repeat 3] [--adapters 4] [--rank 16]
        [--num-requests 32] [--new-tokens 128] [--model PATH]

The default model, 4 random adapters of rank ``--rank`` on all seven projections (q, k, v, o,
gate, up, down; written in PEFT's format by this script, values small enough to keep the model
sane), ``max_loras`` = the number of adapters so every request of a step runs at once. Case b's 32
prompts (uniform 32..256 tokens, 128 new each, greedy, ignore_eos) go round-robin over the adapters
on an engine with ``enable_lora``, and the same 32 on an engine without it. One thread, runs
alternating (base, LoRA, base, ...) ``--repeat`` times; each figure is the median, the ratio the
median of the per-repeat ratios, and the load average is reported per repeat.

Last line: one JSON object (lora_vs_base_throughput, lora_tok_s, base_tok_s; lora_vs_base_cpu_time,
the same ratio in the process's CPU seconds, steadier on a shared machine; the per-repeat figures
and loads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedkv import LoRARequest, SamplingParams
from pagedkv.benchmark import build_workload
from pagedkv.engine import LLMEngine
from pagedkv.workloads import BENCHMARK_CASES, WorkloadConfig

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA folder for ``config``'s shapes: every layer's seven projections, A and B random
    (B ~ 0.01 / sqrt(rank): the outputs change, the model stays coherent)."""
    from safetensors.torch import save_file

    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for parent, names in PROJECTIONS.items():
            for name in names:
                out_f, in_f = shapes[name]
                base = f"base_model.model.model.layers.{layer}.{parent}.{name}"
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
                tensors[f"{base}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01 / rank ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "use_rslora": False, "bias": "none",
        "target_modules": [n for names in PROJECTIONS.values() for n in names], "task_type": "CAUSAL_LM"}))


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: list[int],
        loras: Sequence[LoRARequest | None]) -> tuple[float, float]:
    """(wall, CPU) seconds to run every request to completion (all added at once; prefix cache
    emptied first). On one thread the CPU time is the figure least moved by other load."""
    engine.reset_prefix_cache()
    for i, (prompt, n, lora) in enumerate(zip(prompts, new_tokens, loras)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           lora_request=lora)
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=None, help="first N of case b's requests (default all 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default case b's 128)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    common = dict(threads=args.threads, max_num_seqs=64)
    base = LLMEngine.from_options(args.model, **common)
    lora = LLMEngine.from_options(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                  **common)
    config = lora.runner.config
    case: WorkloadConfig = BENCHMARK_CASES["case_b"]
    workload = build_workload("case_b", config.vocab_size, config=case)
    n = args.num_requests or len(workload.prompts)
    prompts, new_tokens = workload.prompts[:n], workload.new_tokens[:n]
    if args.new_tokens is not None:
        new_tokens = [args.new_tokens] * n
    with tempfile.TemporaryDirectory(prefix="pagedkv-lora-bench-") as tmp:
        requests = []
        for k in range(args.adapters):
            folder = Path(tmp) / f"adapter{k}"
            write_random_adapter(folder, config, args.rank, seed=k)
            requests.append(LoRARequest(f"adapter{k}", k + 1, str(folder)))
        loras = [requests[i % args.adapters] for i in range(n)]
        warm = build_workload("case_a", config.vocab_size, seed=1)  # the same untimed warm-up for both
        run(base, warm.prompts, [16], [None])
        run(lora, warm.prompts * args.adapters, [16] * args.adapters, requests)
        out_tokens = sum(new_tokens)
        rows = []
        for rep in range(args.repeat):
            t_base, c_base = run(base, prompts, new_tokens, [None] * n)
            t_lora, c_lora = run(lora, prompts, new_tokens, loras)
            row = {"repeat": rep, "base_tok_s": out_tokens / t_base, "lora_tok_s": out_tokens / t_lora,
                   "ratio": t_base / t_lora, "cpu_ratio": c_base / c_lora, "load": os.getloadavg()[0]}
            rows.append(row)
            print(f"repeat {rep}: base {row['base_tok_s']:.1f} tok/s, LoRA {row['lora_tok_s']:.1f} tok/s, "
                  f"ratio {row['ratio']:.3f} (CPU time {row['cpu_ratio']:.3f}), load {row['load']:.2f}",
                  file=sys.stderr)
    result = {
        "lora_vs_base_throughput": round(statistics.median(r["ratio"] for r in rows), 4),
        "lora_vs_base_cpu_time": round(statistics.median(r["cpu_ratio"] for r in rows), 4),
        "lora_tok_s": round(statistics.median(r["lora_tok_s"] for r in rows), 2),
        "base_tok_s": round(statistics.median(r["base_tok_s"] for r in rows), 2),
        "adapters": args.adapters, "rank": args.rank, "requests": n, "output_tokens": out_tokens,
        "threads": args.threads, "slot_loads": lora.stats().lora.slot_loads,
        "repeats": rows,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
