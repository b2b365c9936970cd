"""GGUF weights kept at their own width (``quantization="auto"``: Q4_* packed at 4 bits, Q5_* at 5,
Q6_K at 6, Q8_0 at 8) against the 8-bit layout (``"q8_0"``) and llama.cpp on the same files:
resident memory over the file's size, and whole-model decode speed at batch 1 and 32.

Two files:

- ``q4_1``: the default model's GGUF (SmolLM2-135M, Q4_1 layers, a Q8_0 embedding that is also the
  tied LM head);
- ``mix``: a GGUF this bench writes (random blocks, in a temporary folder) with the shape of
  Qwen2.5-Coder-0.5B (qwen2: 24 layers, hidden 896, 14 / 2 heads, FFN 4864, vocabulary 151936,
  tied) and the mix of its Q4_K_M file: a Q8_0 embedding, Q5_0 q/k/o/gate/up (896 is no multiple
  of 256, so llama.cpp's K-quants fall back to Q5_0), Q8_0 v, and ffn_down in Q6_K on every other
  layer, Q4_K on the others; a vocabulary of placeholder tokens, so llama.cpp loads it too.

Memory: a fresh process loads the model (``load_model``), drops its tokenizer (vocabulary tables,
not weights: about 50 MiB for SmolLM2's 49k tokens), builds a runner with a 32 MiB KV pool and runs
a prompt and a few decode steps; its resident set minus that of the same on a tiny model
(``pagedkv_testing/tiny_model.py``), over the GGUF's size, is ``rss_over_gguf_<file>``.

Speed: an engine per layout ("auto", "q8_0"), both resident; B requests of ``--prompt-tokens``
random tokens, ``--new-tokens`` each (greedy, ignore_eos), output tokens / wall seconds, prefill
included. The layouts alternate (auto, q8_0, [llama.cpp,] auto, ...) ``--repeat`` times; each figure
is a median, each ratio the median of the per-repeat ratios. llama.cpp (``--llamacpp-python``, default
the peer venv when present) decodes the same GGUF with its own kernels (``bench/throughput.py``'s
peer script: one context, every request a sequence), with ``--threads`` threads.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/quant_decode.py [--threads 1] [--repeat 3]
        [--files q4_1,mix] [--llamacpp-python /path/to/python] [--profile]

Where a batch-1 step's time goes (``--profile``): one decode step of the ``auto`` layout split into its
linear layers (per kind: the weight bytes it reads and the time), the rest, and this core's streaming
read bandwidth (a float32 sum over a tensor of the step's weight bytes), with the layers run as
modules (their linears timed one by one), and the same step with each layer one native call
(``models/native_layer.py``; the default), ``<file>_b1_native_step_ms``: ``<file>_b1_step_ms``,
``<file>_b1_linear_ms``, ``<file>_b1_weight_mb`` (read per token), ``<file>_b1_linear_gb_s`` and
``<file>_read_gb_s``. At batch 1 the weights are read once per token, so ``weight_mb / read_gb_s`` is
the floor of a step's linear time, whatever the kernel.

Last line: one JSON object: ``rss_over_gguf_<file>``, ``<file>_rss_mb``, ``<file>_gguf_mb``,
``<file>_<layout>_b<B>_tok_s`` (layout auto, q8_0, llamacpp), ``<file>_b<B>_vs_llamacpp`` and
``<file>_b<B>_vs_8bit`` (auto's speed ratios; ``q4_1_b1_vs_llamacpp`` is the issue's gate), the
threads and the load average (before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from throughput import run_llamacpp

from pagedkv.benchmark import VOCAB_LOW, Workload, run_pagedkv
from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.models.default_model import default_model_path
from pagedkv.models.gguf_loader import converted_folder
from pagedkv.models.loader import load_model
from pagedkv.paths import cache_root
from pagedkv.runner import ModelRunner

LAYOUTS = ("auto", "q8_0")
PEER = Path.home() / ".cache" / "peers" / "llamacpp-venv" / "bin" / "python"
RSS_SCRIPT = r"""
import gc, sys
import torch
torch.set_num_threads(int(sys.argv[3]))
from pagedkv.models.loader import load_model, release_freed_memory
from pagedkv.runner import ModelRunner, SeqChunk
loaded = load_model(sys.argv[1], quantization=sys.argv[2])
loaded.tokenizer = None  # vocabulary tables, not weights
gc.collect()
release_freed_memory()
runner = ModelRunner(loaded, block_size=16, kv_cache_memory="32MiB")
table = list(range(8))
logits = runner.execute([SeqChunk([200] * 16, 0, table)])
for pos in range(16, 20):
    logits = runner.execute([SeqChunk([int(logits[0].argmax())], pos, table)])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]))  # KiB
"""

# Qwen2.5-Coder-0.5B's shape and its Q4_K_M file's types (the module docstring)
MIX_SHAPE = dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, context=32768)
# fp16 fields (byte offset -> multiple of the scale) of the random blocks: d, and dmin balancing the mean
_FIELDS = {"Q8_0": {0: 1 / 64}, "Q5_0": {0: 1 / 8}, "Q4_K": {0: 1 / 16, 2: 0.25}, "Q6_K": {208: 1 / 16}}


def write_mix_gguf(path: Path, seed: int = 0) -> Path:
    """The ``mix`` file (the module docstring): random blocks of each tensor's type, values of about
    1 / sqrt(inputs), and a vocabulary of placeholder tokens (a SentencePiece-style list)."""
    import gguf

    s = MIX_SHAPE
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_vocab_size(s["vocab"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(s["vocab"])])
    w.add_token_scores([0.0] * s["vocab"])
    w.add_token_types([3, 3, 3] + [1] * (s["vocab"] - 3))  # <unk>, <s>, </s> control
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    h, f, kv = s["hidden"], s["ffn"], s["hidden"] // s["heads"] * s["kv_heads"]
    tensors: list[tuple[str, tuple[int, int], str]] = [("token_embd.weight", (s["vocab"], h), "Q8_0")]
    for i in range(s["layers"]):
        tensors += [(f"blk.{i}.attn_q.weight", (h, h), "Q5_0"), (f"blk.{i}.attn_k.weight", (kv, h), "Q5_0"),
                    (f"blk.{i}.attn_v.weight", (kv, h), "Q8_0"), (f"blk.{i}.attn_output.weight", (h, h), "Q5_0"),
                    (f"blk.{i}.ffn_gate.weight", (f, h), "Q5_0"), (f"blk.{i}.ffn_up.weight", (f, h), "Q5_0"),
                    (f"blk.{i}.ffn_down.weight", (h, f), "Q6_K" if i % 2 == 0 else "Q4_K")]
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for name, shape, type_name in tensors:
        qtype = gguf.GGMLQuantizationType[type_name]
        block, width = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (shape[0] * shape[1] // block, width), dtype=np.uint8)
        scale = 1.0 if name.startswith("token_embd") else 1 / np.sqrt(shape[1])
        for at, mult in _FIELDS[type_name].items():
            raw[:, at:at + 2] = np.full(len(raw), scale * mult, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=qtype)
        if name.endswith("output.weight") or not name.startswith("blk."):
            continue
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):  # qwen2's q/k/v biases
            w.add_tensor(name.replace(".weight", ".bias"), (0.01 * rng.standard_normal(shape[0])).astype(np.float32))
        if name.endswith("attn_q.weight"):
            layer = name.split(".")[1]
            w.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(h, dtype=np.float32))
            w.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def workload(batch: int, prompt_tokens: int, new_tokens: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_LOW, vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
    return Workload(f"b{batch}", prompts, [new_tokens] * batch)


def engine_for(path: Path, layout: str, max_seqs: int) -> LLMEngine:
    config = EngineConfig(model=str(path), quantization=layout, kv_cache_memory="256MiB", max_num_seqs=max_seqs,
                          kv_offloading_size=0)
    loaded = load_model(str(path), quantization=layout)
    runner = ModelRunner(loaded, block_size=16, kv_cache_memory="256MiB")
    return LLMEngine(config, runner=runner, tokenizer=loaded.tokenizer, model_name=loaded.name,
                     max_position_embeddings=loaded.config.max_position_embeddings)


def rss_mb(path: Path, layout: str, threads: int) -> tuple[float, float]:
    """(resident, peak) MiB of a fresh process holding ``path``'s model (the module docstring),
    minus those of the same on a tiny model."""
    def rss(model: Path, arg: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model), arg, str(threads)], check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        return [int(x) for x in out.stdout.split()[-2:]]  # KiB
    from pagedkv_testing.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        (now0, peak0) = rss(write_tiny_model(Path(tmp) / "tiny"), "none")
    (now, peak) = rss(path, layout)
    return round((now - now0) / 1024, 1), round((peak - peak0) / 1024, 1)


def profile_step(key: str, path: Path, result: dict, steps: int = 24) -> None:
    """``--profile``: one batch-1 decode step of the ``auto`` layout split into its linear layers (the
    module docstring); the fastest of ``steps`` steps after a warm-up."""
    import time

    from pagedkv.models.quant_linear import QuantLinear
    from pagedkv.runner import SeqChunk

    loaded = load_model(str(path), quantization="auto")
    runner = ModelRunner(loaded, block_size=16, kv_cache_memory="64MiB")
    spent: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    for name, mod in loaded.model.named_modules():
        if not isinstance(mod, (QuantLinear, torch.nn.Linear)):
            continue
        kind = f"{name.rsplit('.', 1)[-1]}:{getattr(mod, 'fmt', 'float')}"
        nbytes[kind] = nbytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in mod.buffers()) + sum(
            t.numel() * t.element_size() for t in mod.parameters())

        def timed(x: torch.Tensor, forward=mod.forward, kind: str = kind) -> torch.Tensor:
            t0 = time.perf_counter()
            out = forward(x)
            spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - t0
            return out
        mod.forward = timed  # type: ignore[method-assign]  # this process's model only
    table = list(range(8))
    logits = runner.execute([SeqChunk([200 + i for i in range(16)], 0, table)])
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    native_best = float("inf")
    packed = runner.model.native_layers
    for pos in range(16, 16 + 2 * steps):  # alternating: layers as modules (timed linears), native layers
        native = pos % 2 == 1
        runner.model.native_layers = packed if native else [None] * len(packed)
        spent.clear()
        t0 = time.perf_counter()
        logits = runner.execute([SeqChunk([int(logits[0].argmax())], pos, table)])
        step = time.perf_counter() - t0
        if native:
            native_best = min(native_best, step)
        elif step < best[0]:
            best = (step, dict(spent))
    runner.model.native_layers = packed
    step, linears = best
    weights = sum(nbytes.values())
    block = torch.ones(weights // 4)
    block.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        block.sum()
    read_gb_s = weights * 5 / (time.perf_counter() - t0) / 1e9
    linear_s = sum(linears.values())
    result[f"{key}_b1_step_ms"] = round(step * 1e3, 2)
    result[f"{key}_b1_native_step_ms"] = round(native_best * 1e3, 2)
    result[f"{key}_b1_linear_ms"] = round(linear_s * 1e3, 2)
    result[f"{key}_b1_weight_mb"] = round(weights / 2**20, 1)
    result[f"{key}_b1_linear_gb_s"] = round(weights / linear_s / 1e9, 2)
    result[f"{key}_read_gb_s"] = round(read_gb_s, 2)
    for kind in sorted(linears):
        print(f"{key} b1 {kind}: {linears[kind] * 1e3:.2f} ms, {nbytes[kind] / 2**20:.1f} MiB, "
              f"{nbytes[kind] / linears[kind] / 1e9:.2f} GB/s", flush=True)
    print(key, {k: v for k, v in result.items() if k.startswith(f"{key}_b1_") or k == f"{key}_read_gb_s"}, flush=True)


def measure(key: str, path: Path, args: argparse.Namespace, result: dict) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    gguf_mb = path.stat().st_size / 2**20
    for layout in LAYOUTS:
        converted_folder(path, layout)  # converted here, once: the measured process only loads
    rss, peak = rss_mb(path, "auto", args.threads)
    result[f"{key}_gguf_mb"] = round(gguf_mb, 1)
    result[f"{key}_rss_mb"], result[f"{key}_peak_rss_mb"] = rss, peak
    result[f"rss_over_gguf_{key}"] = round(rss / gguf_mb, 3)
    print(key, {k: v for k, v in result.items() if key in k}, flush=True)
    if args.profile:
        profile_step(key, path, result)
    engines = {layout: engine_for(path, layout, max(batches)) for layout in LAYOUTS}
    vocab = engines["auto"].runner.config.vocab_size
    loads = [workload(b, args.prompt_tokens, args.new_tokens, vocab, seed=b) for b in batches]
    warm = workload(4, args.prompt_tokens, 8, vocab, seed=99)
    for engine in engines.values():
        run_pagedkv(engine, warm)
    peer = args.llamacpp_python if args.llamacpp_python and Path(args.llamacpp_python).exists() else None
    tok_s: dict[str, list[float]] = {f"{c}_{w.name}": [] for c in (*LAYOUTS, "llamacpp") for w in loads}
    for rep in range(args.repeat):
        for w in loads:
            for layout, engine in engines.items():
                tok_s[f"{layout}_{w.name}"].append(run_pagedkv(engine, w).tok_s)
        if peer is not None:
            for name, value in run_llamacpp(peer, path, loads, warm, args.threads).items():
                tok_s[f"llamacpp_{name}"].append(value)
        print(f"{key} repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tok_s.items() if v)
              + f" tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    for name, values in tok_s.items():
        if values:
            result[f"{key}_{name}_tok_s"] = round(statistics.median(values), 2)
    def ratio(name: str, other: str) -> float:
        return round(statistics.median(a / b for a, b in zip(tok_s[f"auto_{name}"], tok_s[f"{other}_{name}"])), 3)
    for w in loads:
        result[f"{key}_{w.name}_vs_8bit"] = ratio(w.name, "q8_0")
        if tok_s[f"llamacpp_{w.name}"]:
            result[f"{key}_{w.name}_vs_llamacpp"] = ratio(w.name, "llamacpp")
    for engine in engines.values():
        engine.close()
    print(key, {k: v for k, v in result.items() if key in k}, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--files", default="q4_1,mix", help="which files to measure: q4_1, mix (comma-separated)")
    ap.add_argument("--profile", action="store_true",
                    help="also split a batch-1 step into its linear layers and the read bandwidth (docstring)")
    ap.add_argument("--llamacpp-python", default=str(PEER) if PEER.exists() else None,
                    help="a Python with llama-cpp-python (default: the peer venv when present)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
    for key in args.files.split(","):
        if key == "q4_1":
            measure(key, default_model_path(), args, result)
        elif key == "mix":
            with tempfile.TemporaryDirectory() as tmp:
                path = write_mix_gguf(Path(tmp) / "qwen2.5-coder-0.5b-mix.gguf")
                try:
                    measure(key, path, args, result)
                finally:  # its converted folders (keyed by this temporary file) are of no further use
                    for layout in LAYOUTS:
                        shutil.rmtree(converted_folder(path, layout), ignore_errors=True)
                    for stamp in (cache_root() / "gguf").glob(f"{path.stem}-*.json"):  # its types, remembered
                        stamp.unlink(missing_ok=True)
        else:
            ap.error(f"--files: expected q4_1 and/or mix, got {key!r}")
    result["threads"] = args.threads
    result["llamacpp"] = bool(args.llamacpp_python and Path(args.llamacpp_python).exists())
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
