"""What an 8-bit KV cache costs in quality, and what it buys in blocks and decode speed.

On the default model (or ``--model``) and the public-domain English text shipped with the tests
(``tests/data/declaration_of_independence.txt``, ~2k tokens), for each KV dtype against the
model-dtype cache:

- teacher forcing: the text is fed in chunks of ``--chunk`` tokens through the runner, every
  token attending to the K/V as stored (quantized blocks included); reported: top-1 agreement of
  each position's argmax with the model-dtype cache's, and the perplexity ratio (quantized /
  model dtype);
- greedy continuations: 16 prompts (64-token windows of the text) continued greedily by an engine
  with each KV dtype; reported: the mean length of the prefix equal to the model-dtype engine's
  output, and how many of the 16 are equal in full;
- capacity: blocks at equal ``kv_cache_memory`` (scales included);
- decode speed at long contexts: ``--decode-seqs`` sequences at ``--decode-context`` tokens
  (random K/V written through each format's write path), decode steps of the whole model timed
  A B A B ... (float32 vs each 8-bit kind), median step time; plus the attention kernel alone.
- mixed pools (``--sink-kind``, default int8; ``--sinks``, default 1,2): the first s blocks of the
  sequence at the model dtype, the rest 8-bit, in one mixed pool read by the real kernels
  (``kv_sink_blocks``): teacher forcing as above; greedy continuations by an engine with
  ``kv_sink_blocks`` (``--sink-prompts`` prompts of ``--sink-prompt-len`` tokens, ``--sink-new-tokens``
  new, against the model-dtype engine on the same prompts); and the tokens such a pool holds at
  ``--sink-context`` tokens of context against model-dtype blocks at equal memory (the engine's own
  split, ``ops/kv_format.full_block_fraction``). Beside them, not gated: the engine's
  ``kv_quant_parts`` "v" pools (K at the model dtype, V 8-bit; ``--v-only-sinks``, default 0,1 sink
  blocks), measured the same way by the real kernels (``<sink-kind>_v_only_*`` without sinks,
  ``<sink-kind>_v_only_sink<s>_*``); the K/V split emulated on a model-dtype pool: only K (or only
  V) rounded to 8 bits per block and KV head, in the Hadamard basis, as the write kernel stores it
  (``<sink-kind>_k_only_emulated_*``, ``<sink-kind>_v_only_emulated_*``); and the one-sink pool
  emulated the same way, K and V, with a scale per block
  (``<sink-kind>_sink1_emulated_*``) and per token (``<sink-kind>_sink1_token_scale_*``: the finest
  granularity a format could take), which bound what a finer 8-bit format could add; and the
  "recent block" policy emulated (the block being filled at the model dtype until it fills,
  ``<sink-kind>_sink1_recent_emulated_*``, against the same block-by-block feeding without it,
  ``<sink-kind>_sink1_blockwise_emulated_*``), and built: the engine's ``kv_recent_block``
  (``<sink-kind>_sink1_recent_*``: the runner's shadow blocks, fed as the emulation is; greedy
  continuations by an engine with it).

    .venv/bin/python bench/kv_quant.py [--threads 1] [--kinds int8,fp8_e4m3,fp8_e5m2,bfloat16,float16]

Last line: one JSON object with ``<kind>_top1``, ``<kind>_ppl_ratio``, ``<kind>_greedy_match_len``,
``<kind>_greedy_full_matches``, ``<kind>_blocks_ratio`` and ``<kind>_decode_speed_ratio`` (8-bit
kinds: float32 step time / kind step time) per kind; ``<sink-kind>_sink_top1``,
``<sink-kind>_sink_ppl_ratio``, ``<sink-kind>_sink_greedy_equal``, ``<sink-kind>_sink_blocks_ratio``
(one sink block; ``..._sink<s>_...`` for each s of ``--sinks``), the K/V splits, and the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from pagedkv.engine import LLMEngine
from pagedkv.model_shape import kv_groups
from pagedkv.models.loader import load_model
from pagedkv.ops.kv_format import dequantize, full_block_fraction, hadamard, kv_format, quantize
from pagedkv.ops.paged_attention import NativeMetadata, native_paged_attention
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv.runner import model_runner as model_runner_module
from pagedkv.runner.kv_cache import mixed_split, num_blocks_for_memory
from pagedkv.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "declaration_of_independence.txt"


def teacher_forced(loaded, tokens: list[int], kind: str, chunk: int, block_size: int) -> torch.Tensor:
    """Log-probabilities ``[len(tokens) - 1, vocab]`` of every next token, the text fed in chunks."""
    blocks = -(-len(tokens) // block_size)
    groups = len(kv_groups(loaded.config))  # a hybrid model's KV groups each have a table
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=groups * blocks + 1, kv_cache_dtype=kind)
    tables = [list(range(g * blocks, (g + 1) * blocks)) for g in range(groups)]
    out = []
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start:min(start + chunk, len(tokens) - 1)]
        logits = runner.execute([SeqChunk(piece, start, tables[0], all_logits=True, group_tables=tuple(tables[1:]))])
        out.append(torch.log_softmax(logits.double(), dim=-1))
    return torch.cat(out)


def teacher_forced_sinks(loaded, tokens: list[int], kind: str, sinks: int, chunk: int,
                         block_size: int, parts: str = "kv", recent: bool = False) -> torch.Tensor:
    """``teacher_forced`` over a mixed pool: the sequence's first ``sinks`` blocks at the model
    dtype (ids below the pool's split), the rest ``kind`` (the ids above it; ``parts`` "v": their
    V alone, K at the model dtype). ``recent``: the runner's ``kv_recent_block`` shadow (one
    block: the block being written read at the model dtype until it fills)."""
    blocks = -(-len(tokens) // block_size)
    if len(kv_groups(loaded.config)) > 1:
        raise SystemExit("the mixed-pool figures take a model with one KV group")
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=sinks + blocks + 1, kv_cache_dtype=kind,
                         kv_full_blocks=sinks + 1, kv_quant_parts=parts, kv_recent_blocks=int(recent))
    table = list(range(sinks)) + list(range(sinks + 1, sinks + 1 + blocks - sinks))
    out = []
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start:min(start + chunk, len(tokens) - 1)]
        logits = runner.execute([SeqChunk(piece, start, table, all_logits=True)])
        out.append(torch.log_softmax(logits.double(), dim=-1))
    return torch.cat(out)


def teacher_forced_one_part(loaded, tokens: list[int], kind: str, part: int | None, chunk: int,
                            block_size: int, sinks: int = 0, per_token: bool = False) -> torch.Tensor:
    """``teacher_forced`` on a model-dtype pool where only K (``part`` 0) or only V (1), or both
    (None), are rounded to ``kind`` as the write kernel stores them: per block and KV head, absmax
    scale, in the Hadamard basis; the written blocks re-rounded at each write (a block's scale
    follows its contents), so every read, the chunk's own tokens included, sees the rounded
    values. The first ``sinks`` blocks stay unrounded; ``per_token``: a scale per token and KV
    head instead of per block (what a finer-grained format would store). An emulation: the real
    pools round both (or, mixed, whole blocks)."""
    fmt = kv_format(kind)
    rotation = hadamard(loaded.config.head_dim)
    plain_write = model_runner_module.write_kv

    def rounding_write(k_cache, v_cache, k, v, slot_mapping):
        plain_write(k_cache, v_cache, k, v, slot_mapping)
        for cache in (k_cache, v_cache) if part is None else ((k_cache, v_cache)[part],):
            touched = torch.unique(slot_mapping // cache.shape[1])
            round_blocks(cache, touched[touched >= sinks], fmt, rotation, per_token)

    runner = ModelRunner(loaded, block_size=block_size, num_blocks=-(-len(tokens) // block_size) + 1,
                         kv_cache_dtype="auto", attention_backend="native")
    table = list(range(-(-len(tokens) // block_size)))
    model_runner_module.write_kv = rounding_write  # this runner's writes only (restored below)
    try:
        out = [torch.log_softmax(runner.execute([SeqChunk(tokens[:1], 0, table, all_logits=True)]).double(), -1)]
        for start in range(1, len(tokens) - 1, chunk):  # from position 1: every chunk reads the cache
            piece = tokens[start:min(start + chunk, len(tokens) - 1)]
            logits = runner.execute([SeqChunk(piece, start, table, all_logits=True)])
            out.append(torch.log_softmax(logits.double(), dim=-1))
    finally:
        model_runner_module.write_kv = plain_write
    return torch.cat(out)


def round_blocks(cache: torch.Tensor, blocks: torch.Tensor, fmt, rotation: torch.Tensor | None,
                 per_token: bool = False) -> None:
    """Blocks ``blocks`` of one layer's float ``cache`` ``[blocks, block_size, kv_heads, d]`` rounded
    in place as the write kernel stores them: absmax scale per block and KV head (``per_token``:
    per token and KV head), in the Hadamard basis ``rotation`` (None: as they are)."""
    x = cache.index_select(0, blocks)
    if rotation is not None:
        x = x @ rotation
    scale = x.abs().amax(dim=3 if per_token else (1, 3), keepdim=True) / fmt.qmax
    y = dequantize(quantize(x, fmt, scale), fmt, scale)
    cache.index_copy_(0, blocks, (y @ rotation if rotation is not None else y).to(cache.dtype))


def teacher_forced_recent(loaded, tokens: list[int], kind: str, block_size: int, sinks: int,
                          recent: bool) -> torch.Tensor:
    """``teacher_forced`` on a model-dtype pool, one block per chunk (aligned to the blocks, so a
    chunk is one block's tokens, as decode fills them), K and V rounded to ``kind`` per block and
    KV head in the Hadamard basis, the first ``sinks`` blocks never. ``recent``: the block being
    filled stays unrounded while its own tokens read it and is rounded once full, when the next
    block's tokens are written (the issue's "recent blocks at model precision"); else it is rounded
    as it is written. An emulation (the engine's ``kv_recent_block``: ``teacher_forced_sinks(recent=True)``)."""
    fmt = kv_format(kind)
    rotation = hadamard(loaded.config.head_dim)
    plain_write = model_runner_module.write_kv

    def rounding_write(k_cache, v_cache, k, v, slot_mapping):
        plain_write(k_cache, v_cache, k, v, slot_mapping)
        block = int(slot_mapping[0]) // block_size - (1 if recent else 0)  # the block to round now
        if block >= sinks:
            for cache in (k_cache, v_cache):
                round_blocks(cache, torch.tensor([block]), fmt, rotation)

    blocks = -(-len(tokens) // block_size)
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=blocks + 1, kv_cache_dtype="auto",
                         attention_backend="native")
    model_runner_module.write_kv = rounding_write  # this runner's writes only (restored below)
    try:
        out = []
        for start in range(0, len(tokens) - 1, block_size):
            piece = tokens[start:min(start + block_size, len(tokens) - 1)]
            logits = runner.execute([SeqChunk(piece, start, list(range(blocks)), all_logits=True)])
            out.append(torch.log_softmax(logits.double(), dim=-1))
    finally:
        model_runner_module.write_kv = plain_write
    return torch.cat(out)


def greedy(model: str | None, prompts: list[list[int]], kind: str, new_tokens: int,
           **options: object) -> list[list[int]]:
    engine = LLMEngine.from_options(model, kv_cache_dtype=kind, kv_cache_memory="512MiB", block_size=16, **options)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(only_finished=True):
            done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def decode_runner(loaded, kind: str, seqs: int, context: int, block_size: int) -> tuple[ModelRunner, list]:
    """A runner whose cache holds ``seqs`` sequences of ``context`` random tokens' K/V (written
    through the format's own write path), and the decode chunks of one step over them."""
    per_seq = -(-(context + 1) // block_size)
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=seqs * per_seq + 1, kv_cache_dtype=kind)
    cfg = runner.config
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(seqs * per_seq * block_size).view(seqs, -1)[:, :context].reshape(-1)
    for layer in range(cfg.num_hidden_layers):
        k_cache, v_cache = runner.cache.layer(layer)
        ks, vs = runner.cache.layer_scales(layer)
        for cache, scales in ((k_cache, ks), (v_cache, vs)):
            x = torch.randn(len(slots), cfg.num_key_value_heads, cfg.head_dim, generator=gen)
            if scales is None:
                cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
            else:
                torch.ops.pagedkv.write_kv_scaled(cache, scales, x, slots, torch.zeros(2, dtype=torch.float64))
    chunks = [SeqChunk([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(seqs)]
    return runner, chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kinds", default="int8,fp8_e4m3,fp8_e5m2,bfloat16,float16")
    ap.add_argument("--chunk", type=int, default=128, help="teacher-forcing chunk (tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-seqs", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5, help="timed decode steps per kind (alternating)")
    ap.add_argument("--sink-kind", default="int8", help="the 8-bit kind of the mixed-pool figures ('' skips them)")
    ap.add_argument("--sinks", default="1,2", help="sink blocks at the model dtype (the first is gated)")
    ap.add_argument("--sink-prompts", type=int, default=16)
    ap.add_argument("--sink-prompt-len", type=int, default=32)
    ap.add_argument("--sink-new-tokens", type=int, default=32)
    ap.add_argument("--sink-context", type=int, default=2048, help="context of the capacity figure (tokens)")
    ap.add_argument("--v-only-sinks", default="0,1",
                    help="sink blocks of the kv_quant_parts v pools measured beside them ('' skips them)")
    ap.add_argument("--skip-speed", action="store_true", help="no decode-speed figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    loaded = load_model(args.model)
    base_kind = kv_format("auto", next(loaded.model.parameters()).dtype).name
    assert loaded.tokenizer is not None  # a model with its tokenizer: the text is tokenized
    tokens = loaded.tokenizer.encode(TEXT.read_text())
    targets = torch.tensor(tokens[1:])
    print(f"text: {len(tokens)} tokens; model dtype KV: {base_kind}; kinds: {', '.join(kinds)}", flush=True)
    result: dict[str, float | int | str] = {"text_tokens": len(tokens), "base_kv_dtype": base_kind}

    # -- teacher forcing
    t0 = time.perf_counter()
    base = teacher_forced(loaded, tokens, base_kind, args.chunk, args.block_size)
    base_nll = -base.gather(1, targets.view(-1, 1)).mean().item()
    base_top = base.argmax(-1)
    result["base_ppl"] = round(math.exp(base_nll), 4)
    print(f"teacher forcing {base_kind}: ppl {math.exp(base_nll):.3f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    for kind in kinds:
        lp = teacher_forced(loaded, tokens, kind, args.chunk, args.block_size)
        nll = -lp.gather(1, targets.view(-1, 1)).mean().item()
        top1 = (lp.argmax(-1) == base_top).double().mean().item()
        result[f"{kind}_top1"] = round(top1, 5)
        result[f"{kind}_ppl_ratio"] = round(math.exp(nll - base_nll), 5)
        print(f"teacher forcing {kind:9s}: top-1 agreement {top1:.4f}  ppl {math.exp(nll):.3f} "
              f"(ratio {math.exp(nll - base_nll):.4f})", flush=True)

    # -- greedy continuations
    stride = max(1, (len(tokens) - 64) // args.prompts)
    prompts = [tokens[i * stride:i * stride + 64] for i in range(args.prompts)]
    base_out = greedy(args.model, prompts, base_kind, args.new_tokens)
    for kind in kinds:
        outs = greedy(args.model, prompts, kind, args.new_tokens)
        lens = [common_prefix(a, b) for a, b in zip(outs, base_out)]
        result[f"{kind}_greedy_match_len"] = round(statistics.mean(lens), 2)
        result[f"{kind}_greedy_full_matches"] = sum(n == args.new_tokens for n in lens)
        print(f"greedy {kind:9s}: equal prefix {statistics.mean(lens):.1f} / {args.new_tokens} tokens on "
              f"average; {sum(n == args.new_tokens for n in lens)} of {len(prompts)} equal in full", flush=True)

    # -- capacity at equal memory
    base_blocks = num_blocks_for_memory(loaded.config, args.block_size, "1GiB", base_kind)
    for kind in kinds:
        result[f"{kind}_blocks_ratio"] = round(num_blocks_for_memory(loaded.config, args.block_size, "1GiB",
                                                                     kind) / base_blocks, 4)

    if args.sink_kind:
        mixed_figures(args, loaded, tokens, targets, base_kind, base_nll, base_top, result)

    # -- decode speed at long contexts, A B A B
    quant = [] if args.skip_speed else [k for k in kinds if kv_format(k).scaled]
    runners = {k: decode_runner(loaded, k, args.decode_seqs, args.decode_context, args.block_size)
               for k in ([base_kind, *quant] if quant else [])}
    steps: dict[str, list[float]] = {k: [] for k in runners}
    attn: dict[str, list[float]] = {k: [] for k in runners}
    cfg = loaded.config
    q = torch.randn(args.decode_seqs, cfg.num_attention_heads, cfg.head_dim)
    for _ in range(args.repeat):
        for kind, (runner, chunks) in runners.items():
            runner.execute(chunks)  # rewrites the same slot each time: the context stays put
            t = time.perf_counter()
            runner.execute(chunks)
            steps[kind].append(time.perf_counter() - t)
            meta = NativeMetadata.build([c.block_table for c in chunks], list(range(len(chunks))),
                                        [args.decode_context + 1] * len(chunks))
            k_cache, v_cache = runner.cache.layer(0)
            ks, vs = runner.cache.layer_scales(0)
            out = torch.empty_like(q)
            t = time.perf_counter()
            for _ in range(cfg.num_hidden_layers):
                native_paged_attention(out, q, k_cache, v_cache, meta, k_scales=ks, v_scales=vs)
            attn[kind].append(time.perf_counter() - t)
    if quant:
        base_step, base_attn = statistics.median(steps[base_kind]), statistics.median(attn[base_kind])
        print(f"decode, {args.decode_seqs} seqs x {args.decode_context} tokens: {base_kind} step "
              f"{base_step * 1000:.1f} ms (attention {base_attn * 1000:.1f} ms)", flush=True)
    for kind in quant:
        step, at = statistics.median(steps[kind]), statistics.median(attn[kind])
        result[f"{kind}_decode_speed_ratio"] = round(base_step / step, 3)
        result[f"{kind}_attention_speed_ratio"] = round(base_attn / at, 3)
        print(f"decode {kind:9s}: step {step * 1000:.1f} ms ({base_step / step:.2f}x), attention "
              f"{at * 1000:.1f} ms ({base_attn / at:.2f}x)", flush=True)
    result["decode_seqs"], result["decode_context"] = args.decode_seqs, args.decode_context
    result["threads"] = args.threads
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


def mixed_figures(args, loaded, tokens: list[int], targets: torch.Tensor, base_kind: str, base_nll: float,
                  base_top: torch.Tensor, result: dict[str, float | int | str]) -> None:
    """The mixed-pool figures (module docstring) into ``result``."""
    kind, bs = args.sink_kind, args.block_size
    sinks = [int(s) for s in args.sinks.split(",") if s]

    def quality(lp: torch.Tensor, key: str) -> None:
        nll = -lp.gather(1, targets.view(-1, 1)).mean().item()
        top1 = (lp.argmax(-1) == base_top).double().mean().item()
        result[f"{key}_top1"], result[f"{key}_ppl_ratio"] = round(top1, 5), round(math.exp(nll - base_nll), 5)
        print(f"teacher forcing {key:16s}: top-1 agreement {top1:.4f}  ppl ratio {math.exp(nll - base_nll):.5f}",
              flush=True)

    for s in sinks:
        quality(teacher_forced_sinks(loaded, tokens, kind, s, args.chunk, bs), f"{kind}_sink{s}")
    v_sinks = [int(s) for s in args.v_only_sinks.split(",") if s]
    v_key = {s: f"{kind}_v_only" + (f"_sink{s}" if s else "") for s in v_sinks}  # measured: kv_quant_parts v
    for s in v_sinks:
        quality(teacher_forced_sinks(loaded, tokens, kind, s, args.chunk, bs, parts="v"), v_key[s])
    for part, name in ((0, "k_only_emulated"), (1, "v_only_emulated")):
        quality(teacher_forced_one_part(loaded, tokens, kind, part, args.chunk, bs), f"{kind}_{name}")
    # emulated beside them: the same pool (first block unrounded) with the real per-block scales,
    # and with a scale per token (the finest granularity a format could take): how far a finer
    # format could lift the gated figure
    for per_token, name in ((False, "sink1_emulated"), (True, "sink1_token_scale")):
        quality(teacher_forced_one_part(loaded, tokens, kind, None, args.chunk, bs, sinks=1, per_token=per_token),
                f"{kind}_{name}")
    # and the "recent block" policy: the block being filled at the model dtype until it fills,
    # against the same block-by-block feeding without it
    for recent, name in ((False, "sink1_blockwise_emulated"), (True, "sink1_recent_emulated")):
        quality(teacher_forced_recent(loaded, tokens, kind, bs, 1, recent), f"{kind}_{name}")
    # the engine's kv_recent_block (the runner's shadow blocks), fed as the emulation is
    quality(teacher_forced_sinks(loaded, tokens, kind, 1, bs, bs, recent=True), f"{kind}_sink1_recent")
    stride = max(1, (len(tokens) - args.sink_prompt_len) // args.sink_prompts)
    prompts = [tokens[i * stride:i * stride + args.sink_prompt_len] for i in range(args.sink_prompts)]
    base_out = greedy(args.model, prompts, base_kind, args.sink_new_tokens)
    for s in sinks:
        outs = greedy(args.model, prompts, kind, args.sink_new_tokens, kv_sink_blocks=s, kv_offloading_size=0)
        equal = sum(a == b for a, b in zip(outs, base_out))
        result[f"{kind}_sink{s}_greedy_equal"] = equal
        print(f"greedy {kind} sink {s}: {equal} of {len(prompts)} equal to {base_kind} in full "
              f"({args.sink_prompt_len} + {args.sink_new_tokens} tokens)", flush=True)
    outs = greedy(args.model, prompts, kind, args.sink_new_tokens, kv_sink_blocks=1, kv_offloading_size=0,
                  kv_recent_block=True)
    result[f"{kind}_sink1_recent_greedy_equal"] = sum(a == b for a, b in zip(outs, base_out))
    print(f"greedy {kind} sink 1 + recent block: {result[f'{kind}_sink1_recent_greedy_equal']} of {len(prompts)} "
          f"equal to {base_kind} in full", flush=True)
    for s in v_sinks:
        outs = greedy(args.model, prompts, kind, args.sink_new_tokens, kv_sink_blocks=s, kv_offloading_size=0,
                      kv_quant_parts="v")
        result[f"{v_key[s]}_greedy_equal"] = sum(a == b for a, b in zip(outs, base_out))
        print(f"greedy {v_key[s]}: {result[f'{v_key[s]}_greedy_equal']} of {len(prompts)} equal to {base_kind} "
              f"in full", flush=True)
    plain = greedy(args.model, prompts, kind, args.sink_new_tokens)
    result[f"{kind}_greedy_equal"] = sum(a == b for a, b in zip(plain, base_out))
    base_blocks = num_blocks_for_memory(loaded.config, bs, "1GiB", base_kind)
    for s in sinks:
        full, quant = mixed_split(loaded.config, bs, "1GiB", kind, base_kind,
                                  full_block_fraction(s, args.sink_context, bs))
        result[f"{kind}_sink{s}_blocks_ratio"] = round((full + quant) / base_blocks, 4)
    for s in v_sinks:  # K at the model dtype: the engine's sizing (kv_quant_parts v)
        blocks = (sum(mixed_split(loaded.config, bs, "1GiB", kind, base_kind,
                                  full_block_fraction(s, args.sink_context, bs), base_kind)) if s
                  else num_blocks_for_memory(loaded.config, bs, "1GiB", kind, base_kind))
        result[f"{v_key[s]}_blocks_ratio"] = round(blocks / base_blocks, 4)
    first = f"{kind}_sink{sinks[0]}"
    for key in ("top1", "ppl_ratio", "greedy_equal", "blocks_ratio"):
        result[f"{kind}_sink_{key}"] = result[f"{first}_{key}"]
    print(f"mixed {first}: {result[f'{first}_blocks_ratio']}x the {base_kind} blocks at {args.sink_context} tokens",
          flush=True)


if __name__ == "__main__":
    main()
