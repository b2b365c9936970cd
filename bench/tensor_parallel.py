"""Tensor parallelism's throughput: ``bench/throughput.py --tensor-parallel-size N`` runs this.

One engine over N ranks (``--threads`` each, every rank pinned to its own cores) against one engine
on one rank with ``--threads``, in the same process and run, alternating (TP=1, TP=N, TP=1, ...)
``--repeat`` times over the cases; each ratio is the median of the per-repeat ratios. With
``--threads 1`` and N = 2 that is two cores against one: the figure the issue gates is
``tp2_vs_tp1_case_b`` >= 1.3.

Where a TP=N step's time goes, per case (rank 0's counters, ms per engine step):
``plan_broadcast`` (pickling and broadcasting the step plan), ``all_reduce`` (the model's
collectives on rank 0, waiting for the slowest rank included), ``compute`` (rank 0's own forward
pass less its collectives), ``engine`` (scheduler, sampler, outputs: the rest of the step).

Without ``--model``: the bundled default model (SmolLM2-135M) has 9 query and 3 KV heads, which do
not split over 2 ranks, so a random stand-in of its size is written once (:func:`standin_model`:
its 30 layers, hidden 576, intermediate 1536, vocabulary 49152, tied embeddings, float32; 8 query
heads and 4 KV heads of 64 dims) unless N divides SmolLM2's heads (N = 3: the model itself).

Standalone: ``python bench/tensor_parallel.py --tensor-parallel-size 2 --threads 1 [--cases case_a,case_b]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from pagedkv.benchmark import build_workload, run_pagedkv
from pagedkv.distributed import COLLECTIVES
from pagedkv.engine import LLMEngine
from pagedkv.runner.tp_runner import TPRunner

ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_memory": "1GiB"}
SMOLLM2: dict[str, Any] = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                           "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
                           "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def standin_model(tp: int) -> str | None:
    """The model the comparison runs without ``--model``: None (the default model) when ``tp``
    divides its 9 query and 3 KV heads, else a random SmolLM2-sized Llama with 8 / 4 heads of 64
    dims, written once under the system's temp folder."""
    if 9 % tp == 0 and 3 % tp == 0:
        return None
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.gettempdir()) / "pagedkv-bench-tp-standin"
    if not (folder / "config.json").is_file():
        import torch
        import transformers

        config = transformers.LlamaConfig(**SMOLLM2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                          bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _split(engine: LLMEngine, seconds: float, steps: int) -> dict[str, float]:
    """ms per step of a TP engine's run since the counters were reset (see the module doc)."""
    runner = engine.runner
    assert isinstance(runner, TPRunner)
    s = runner.stats
    per = 1000.0 / max(steps, 1)
    return {"step_ms": round(seconds * per, 3), "plan_broadcast_ms": round(s.plan_s * per, 3),
            "all_reduce_ms": round(COLLECTIVES.seconds * per, 3),
            "compute_ms": round(max(0.0, s.apply_s - COLLECTIVES.seconds) * per, 3),
            "engine_ms": round(max(0.0, seconds - s.plan_s - s.apply_s) * per, 3),
            "collectives_per_step": round(COLLECTIVES.calls / max(steps, 1), 1)}


def compare(model: str | None, tp: int, threads: int, cases: list[str], repeat: int, seed: int = 0,
            **formats: Any) -> dict[str, Any]:
    """Run the comparison (module doc) and return its summary (the last line's JSON)."""
    single = LLMEngine.from_options(model, threads=threads, **ENGINE, **formats)
    many = LLMEngine.from_options(model, threads=threads, tensor_parallel_size=tp, **ENGINE, **formats)
    try:
        vocab = single.runner.config.vocab_size
        workloads = [build_workload(c, vocab, seed) for c in cases]
        warmup = build_workload("case_a", vocab, 99)
        run_pagedkv(single, warmup)
        run_pagedkv(many, warmup)
        one: dict[str, list[float]] = {w.name: [] for w in workloads}
        both: dict[str, list[float]] = {w.name: [] for w in workloads}
        split: dict[str, list[dict[str, float]]] = {w.name: [] for w in workloads}
        loads = []
        for rep in range(repeat):
            loads.append(round(os.getloadavg()[0], 2))
            for w in workloads:
                r1 = run_pagedkv(single, w)
                one[w.name].append(r1.tok_s)
                assert isinstance(many.runner, TPRunner)
                many.runner.stats = type(many.runner.stats)()
                COLLECTIVES.reset()
                start = time.perf_counter()
                rn = run_pagedkv(many, w)
                split[w.name].append(_split(many, time.perf_counter() - start, rn.steps))
                both[w.name].append(rn.tok_s)
                print(f"[{rep + 1}/{repeat}] {w.name:<8} TP=1 {r1.tok_s:8.1f} tok/s   TP={tp} {rn.tok_s:8.1f} tok/s  "
                      f"({rn.tok_s / r1.tok_s:.2f}x)  {split[w.name][-1]}", flush=True)
    finally:
        many.close()
        single.close()
    ratio = {k: statistics.median(b / a for a, b in zip(one[k], both[k])) for k in one}
    return {
        "model": model or "default", "tensor_parallel_size": tp, "threads_per_rank": threads, "repeats": repeat,
        "load_avgs_1m": loads,
        **{f"tp{tp}_vs_tp1_{k}": round(v, 3) for k, v in ratio.items()},
        **{f"tp1_{k}_tok_s": round(statistics.median(v), 2) for k, v in one.items()},
        **{f"tp{tp}_{k}_tok_s": round(statistics.median(v), 2) for k, v in both.items()},
        "step_split_ms": {k: {p: round(statistics.median(d[p] for d in v), 3) for p in v[0]}
                          for k, v in split.items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (and of the TP=1 engine)")
    ap.add_argument("--cases", default="case_a,case_b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tensor_parallel_size < 2:
        ap.error("--tensor-parallel-size must be >= 2 (it is compared with 1)")
    model = args.model if args.model is not None else standin_model(args.tensor_parallel_size)
    summary = compare(model, args.tensor_parallel_size, args.threads, args.cases.split(","), args.repeat,
                      args.seed)
    print(json.dumps(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
