"""Peak resident memory per tensor-parallel rank while it loads its shard: the issue's gate is
``peak <= weights / N + 300 MB`` for a model of at least 500 MB.

A random Llama of about 600 MB of float32 weights (vocabulary 32000 x hidden 1024, untied head, 6
layers of intermediate 4096, 16 query and 4 KV heads) is written to a temporary folder as
safetensors; N gloo ranks (``pagedkv_testing/tp_ranks.py``) each ``load_model(..., tp=)`` it, build a
``ModelRunner`` with a small KV pool, run one forward pass, and report their peak RSS
(``VmHWM``: the whole process, Python and torch included) and the RSS they had before loading.
Each rank loads as the engine does on a CPU (``load_model(cpu_layout=True)``: the LM head packed
and the fused projections laid out as they are read: docs/tensor_parallel.md, "Memory per rank").

``python bench/tp_memory.py [--tensor-parallel-size 2] [--keep DIR]``; the last line is JSON, per
rank where a list: ``weights_mb``, ``tp``, ``peak_rss_mb`` (the whole run's peak), ``load_peak_rss_mb``
(the peak while ``load_model`` ran), ``rss_loaded_mb`` (after it), ``rss_running_mb`` (after the
forward pass), ``rss_before_load_mb``, ``limit_mb`` (``weights / N + 300``), ``within_limit`` (the
run's peak), ``load_within_limit``. ``--no-pack-lm-head``: the head stays unpacked
(``cpu_layout=False``, ``ModelRunner(pack_lm_head=False)``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "torch_dtype": "float32",
}


def write_model(folder: Path) -> int:
    """Write the random model (one safetensors file per layer, so the writer never holds it all);
    returns its weight bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    c = CONFIG
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)
    total = 0

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    files: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(c["vocab_size"], h),
                                             "lm_head.weight": rand(c["vocab_size"], h),
                                             "model.norm.weight": torch.ones(h)}]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        files.append({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                      p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                      p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                      p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": torch.ones(h),
                      p + "post_attention_layernorm.weight": torch.ones(h)})
    for n, tensors in enumerate(files):
        save_file(tensors, str(folder / f"model-{n:05d}.safetensors"))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def rank_memory(tp: Any, folder: str, pack_lm_head: bool = True) -> dict[str, float]:
    """One rank: load the shard, one forward pass; its RSS before and its peak."""
    from pagedkv.models import load_model
    from pagedkv.runner import ModelRunner, SeqChunk

    before = _status_mb("VmRSS")
    loaded = load_model(folder, quantization="none", tp=tp, cpu_layout=pack_lm_head)  # as the engine
    # VmHWM, not getrusage's ru_maxrss: that one keeps the peak of the parent the spawned process was
    # forked from (exec does not reset it), VmHWM is this program's own
    load_peak, loaded_rss = _status_mb("VmHWM"), _status_mb("VmRSS")
    runner = ModelRunner(loaded, block_size=16, num_blocks=16, pack_lm_head=pack_lm_head)
    runner.execute([SeqChunk(list(range(3, 40)), 0, [0, 1, 2])])
    return {"before": before, "load_peak": load_peak, "loaded": loaded_rss, "peak": _status_mb("VmHWM"),
            "running": _status_mb("VmRSS")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="write (or reuse) the model in this folder")
    parser.add_argument("--no-pack-lm-head", action="store_true",
                        help="the LM head stays unpacked (cpu_layout=False, ModelRunner(pack_lm_head=False))")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pagedkv_testing.tp_ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="tp_memory_") as tmp:
        folder = args.keep or Path(tmp) / "model"
        if (folder / "config.json").exists():
            weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        else:
            weights = write_model(folder)
        n = args.tensor_parallel_size
        got = run_ranks(n, rank_memory, (str(folder), not args.no_pack_lm_head), timeout=900)
    weights_mb = weights / 2**20
    limit = weights_mb / n + 300
    peaks = [round(r["peak"], 1) for r in got]
    def each(key: str) -> list[float]:
        return [round(r[key], 1) for r in got]

    result = {"weights_mb": round(weights_mb, 1), "tp": n, "pack_lm_head": not args.no_pack_lm_head,
              "peak_rss_mb": peaks,
              "load_peak_rss_mb": each("load_peak"), "rss_loaded_mb": each("loaded"),
              "rss_running_mb": each("running"), "rss_before_load_mb": each("before"),
              "limit_mb": round(limit, 1), "within_limit": max(peaks) <= limit,
              "load_within_limit": max(each("load_peak")) <= limit}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
