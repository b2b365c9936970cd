"""Weights kept quantized (``quantization="auto"``, the default: a GGUF's types that the 8-bit layout
holds exactly stay 8-bit, the others are dequantized) against float32 weights (``"none"``):
whole-model decode speed at batch 1 and 32, memory, quality, and llama.cpp on the same file.

For the default model (a Q4_1 GGUF: Q4_1 weights kept exactly as int8 with a scale and an offset
per 32, the Q8_0 embedding kept and used as the tied head) and every ``--gguf`` file:

- speed: an engine per choice, both resident; B requests of ``--prompt-tokens`` random tokens,
  ``--new-tokens`` each (greedy, ignore_eos), output tokens / wall seconds, prefill included. The
  choices alternate (none, auto, auto_f32head, [llama.cpp,] none, ...) ``--repeat`` times; each
  figure is a median, each ratio the median of the per-repeat ratios;
- ``auto_f32head``: an ablation, 8-bit layers with the float32 (oneDNN-packed) head and embedding,
  to show what the 8-bit head buys;
- memory: bytes of the parameters and buffers, the converted folder on disk, and the peak RSS
  and resident set (after, and at its peak while loading) of a fresh process that loads the
  model and runs one request, minus those of the same on a tiny model (``pagedkv_testing/tiny_model.py``);
- quality: teacher forcing over ``tests/data/declaration_of_independence.txt`` (as
  ``bench/kv_quant.py``): top-1 agreement with the float32 model and the perplexity ratio (1 and 1
  when every kept type is exact);
- llama.cpp (``--llamacpp-python``, default the peer venv when present) decodes the same GGUF
  with its own kernels: the same workloads, one context, every request a sequence
  (``bench/throughput.py``'s peer script).

    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_decode.py [--threads 1] [--repeat 3]
        [--gguf other.gguf] [--llamacpp-python /path/to/python] [--skip-quality]

Last line: one JSON object; per model (``default``, then each file's stem) and choice:
``<model>_<choice>_b<B>_tok_s``, ``<model>_<choice>_vs_none_b<B>`` (speed ratio),
``<model>_llamacpp_b<B>_tok_s``, ``<model>_auto_vs_llamacpp_b<B>``, ``<model>_<choice>_weight_mb``,
``_disk_mb``, ``_rss_mb``, ``_peak_rss_mb``, ``<model>_auto_top1``, ``<model>_auto_ppl_ratio``; the
threads and the load average (before and after).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from kv_quant import TEXT, teacher_forced
from throughput import run_llamacpp

from pagedkv.benchmark import VOCAB_LOW, Workload, run_pagedkv
from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.models.default_model import default_model_path
from pagedkv.models.gguf_loader import converted_folder
from pagedkv.models.loader import load_model
from pagedkv.models.quant_linear import weight_bytes
from pagedkv.runner import ModelRunner

CHOICES = ("none", "auto", "auto_f32head")
PEER = Path.home() / ".cache" / "peers" / "llamacpp-venv" / "bin" / "python"
RSS_SCRIPT = r"""
import sys
import torch
torch.set_num_threads(int(sys.argv[3]))
from pagedkv.engine import LLMEngine
from pagedkv.sampling_params import SamplingParams
e = LLMEngine.from_options(sys.argv[1], quantization=sys.argv[2], kv_cache_memory="32MiB")
e.add_request("r", [200] * 16, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
while e.has_unfinished_requests():
    e.step()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]))  # KiB; ru_maxrss survives exec
"""


def workload(batch: int, prompt_tokens: int, new_tokens: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_LOW, vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
    return Workload(f"b{batch}", prompts, [new_tokens] * batch)


def engine_for(path: Path, choice: str, max_seqs: int) -> LLMEngine:
    config = EngineConfig(model=str(path), quantization=choice.removesuffix("_f32head"), kv_cache_memory="256MiB",
                          max_num_seqs=max_seqs)
    loaded = load_model(str(path), quantization=config.quantization)
    if choice.endswith("_f32head"):  # float32 embedding, tied head packed by the runner as for "none"
        embed = loaded.model.embed_tokens
        loaded.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed.weight, freeze=True)
        loaded.model.lm_head = None
    runner = ModelRunner(loaded, block_size=16, kv_cache_memory="256MiB")
    return LLMEngine(config, runner=runner, tokenizer=loaded.tokenizer, model_name=loaded.name,
                     max_position_embeddings=loaded.config.max_position_embeddings)


def rss_mb(path: Path, choice: str, threads: int) -> tuple[float, float]:
    """(resident, peak) MiB of a fresh process holding an engine for ``path``, minus those of the
    same engine on a tiny model (libraries, thread pools, the KV cache: about 230 MiB)."""
    def rss(model: Path, arg: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model), arg, str(threads)], check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        return [int(x) for x in out.stdout.split()[-2:]]  # KiB
    from pagedkv_testing.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        (now0, peak0) = rss(write_tiny_model(Path(tmp) / "tiny"), "none")
    (now, peak) = rss(path, choice)
    return round((now - now0) / 1024, 1), round((peak - peak0) / 1024, 1)


def disk_mb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6, 1)


def quality(path: Path, chunk: int = 128) -> tuple[float, float]:
    """(top-1 agreement, perplexity ratio) of the "auto" model against the float32 one."""
    base = load_model(str(path), quantization="none")
    assert base.tokenizer is not None  # a model with its tokenizer: the text is tokenized
    tokens = base.tokenizer.encode(TEXT.read_text())
    want = teacher_forced(base, tokens, "auto", chunk, 16)
    got = teacher_forced(load_model(str(path), quantization="auto"), tokens, "auto", chunk, 16)
    target = torch.tensor(tokens[1:])
    top1 = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    nll = [-lp.gather(1, target[:, None]).mean().item() for lp in (want, got)]
    return round(top1, 4), round(math.exp(nll[1] - nll[0]), 4)


def measure(key: str, path: Path, args: argparse.Namespace, result: dict) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    for choice in ("none", "auto"):
        loaded = load_model(str(path), quantization=choice)
        result[f"{key}_{choice}_weight_mb"] = round(weight_bytes(loaded.model) / 1e6, 1)
        result[f"{key}_{choice}_disk_mb"] = disk_mb(converted_folder(path, loaded.quantization))
        result[f"{key}_{choice}_rss_mb"], result[f"{key}_{choice}_peak_rss_mb"] = rss_mb(path, choice, args.threads)
        del loaded
    result[f"{key}_gguf_mb"] = round(path.stat().st_size / 1e6, 1)
    print(key, {k: v for k, v in result.items() if k.startswith(key)}, flush=True)
    engines = {c: engine_for(path, c, max(batches)) for c in CHOICES}
    vocab = engines["none"].runner.config.vocab_size
    loads = [workload(b, args.prompt_tokens, args.new_tokens, vocab, seed=b) for b in batches]
    warm = workload(4, args.prompt_tokens, 8, vocab, seed=99)
    for engine in engines.values():
        run_pagedkv(engine, warm)
    peer = args.llamacpp_python if args.llamacpp_python and Path(args.llamacpp_python).exists() else None
    tok_s: dict[str, list[float]] = {f"{c}_{w.name}": [] for c in (*CHOICES, "llamacpp") for w in loads}
    for rep in range(args.repeat):
        for w in loads:
            for choice, engine in engines.items():
                tok_s[f"{choice}_{w.name}"].append(run_pagedkv(engine, w).tok_s)
        if peer is not None:
            for name, value in run_llamacpp(peer, path, loads, warm, args.threads).items():
                tok_s[f"llamacpp_{name}"].append(value)
        print(f"{key} repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tok_s.items() if v)
              + f" tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    for name, values in tok_s.items():
        if values:
            result[f"{key}_{name}_tok_s"] = round(statistics.median(values), 2)
    for w in loads:
        for choice in CHOICES[1:]:
            ratios = [a / b for a, b in zip(tok_s[f"{choice}_{w.name}"], tok_s[f"none_{w.name}"])]
            result[f"{key}_{choice}_vs_none_{w.name}"] = round(statistics.median(ratios), 3)
        if tok_s[f"llamacpp_{w.name}"]:
            ratios = [a / b for a, b in zip(tok_s[f"auto_{w.name}"], tok_s[f"llamacpp_{w.name}"])]
            result[f"{key}_auto_vs_llamacpp_{w.name}"] = round(statistics.median(ratios), 3)
    for engine in engines.values():
        engine.close()
    if not args.skip_quality:
        result[f"{key}_auto_top1"], result[f"{key}_auto_ppl_ratio"] = quality(path)
    print(key, {k: v for k, v in result.items() if k.startswith(key)}, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gguf", action="append", default=[], help="another GGUF file to measure (repeatable)")
    ap.add_argument("--llamacpp-python", default=str(PEER) if PEER.exists() else None,
                    help="a Python with llama-cpp-python (default: the peer venv when present)")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
    for key, path in [("default", default_model_path()), *((Path(g).stem, Path(g)) for g in args.gguf)]:
        measure(key, path, args, result)
    result["threads"] = args.threads
    result["llamacpp"] = args.llamacpp_python is not None
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
