"""ModelRunner: runs one step of many sequences (prefill chunks and decodes) on the paged KV cache.

    chunks ──build_step_inputs──> token ids, positions, slot mapping, decode gather index + mask
                                   (built once, shared by every layer)
           ──model.forward──────> per layer: write new K/V to slots, paged attention
           ──────────────────────> logits of each chunk's last token  [len(chunks), vocab]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch

from pagedkv import envs
from pagedkv.lora.adapter import LoRAWeights
from pagedkv.lora.layers import LoRAStack, apply_lora
from pagedkv.model_shape import KVGroup, kv_groups
from pagedkv.models.config import ModelConfig
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from pagedkv.models.loader import LoadedModel
from pagedkv.models.packed_linear import pack_lm_head as pack_head
from pagedkv.models.packed_linear import transpose_wide_linears
from pagedkv.models.quant_linear import QuantLinear
from pagedkv.models.quant_linear import weight_bytes as model_weight_bytes
from pagedkv.ops import cascade, native
from pagedkv.ops.cache_ops import (
    block_payloads,
    copy_blocks,
    load_block_payloads,
    swap_blocks,
    write_kv,
    write_kv_scaled,
)
from pagedkv.ops.kv_format import KVFormat, hadamard, kv_format
from pagedkv.ops.paged_attention import (
    QuantBlocks,
    blocks_as_float,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedkv.runner.batch import SeqChunk
from pagedkv.runner.kv_cache import KVCache, RecentShadows, num_blocks_for_memory
from pagedkv.runner.step_inputs import BatchError, StepInputs, TritonMetadata, build_step_inputs

ATTENTION_BACKENDS = ("native", "plain", "triton")


class _StepAttention:
    """The model's AttentionFn for one step: cache write + paged attention, per layer."""

    def __init__(self, cache: KVCache, inputs: StepInputs, config: ModelConfig,
                 write_error: torch.Tensor | None, rotation: torch.Tensor | None = None,
                 native_layers: bool = False) -> None:
        self.cache = cache
        self.native_layers = native_layers  # the runner's switch (the model's packs may be another runner's)
        self.inputs = inputs
        self.write_error = write_error  # [layers, 2 (K, V), 2] float64 (8-bit formats)
        self.rotation = rotation  # [d, d] orthonormal Hadamard, or None
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.config = config
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping  # Gemma 2: a tanh cap on the scores
        # a mixed pool's new rows per storage, per KV group's inputs (built by its first layer)
        self._splits: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._latent_len: dict[int, torch.Tensor] = {}  # MLA on Triton: each row's visible length (position + 1)
        self._slot_splits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the same for Triton (-1: skip)
        self._stage_ids: dict[int, torch.Tensor] = {}  # the plain path: the blocks a group's step reads
        self._native_step: dict[int, tuple | None] = {}  # per KV group: native_layer_args' step part

    def native_layer_args(self, layer_idx: int) -> tuple | None:
        """What the native decoder layer (``models/native_layer.py``) takes of this layer's cache
        and this step, or None where the step cannot run the layer so: a row attended outside the
        native kernel (a fresh prefill), a mixed pool, the Triton backend, a float cache of
        another dtype than float32. Its attention is then this object's ``__call__``."""
        if not self.native_layers:
            return None
        cache = self.cache
        group = cache.group_of[layer_idx]
        try:
            step = self._native_step[group]
        except KeyError:
            step = self._native_step[group] = self._native_step_args(self.inputs.group(group))
        if step is None:
            return None
        k_cache, v_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        if k_scales is None and k_cache.dtype != torch.float32:
            return None
        err = self.write_error[layer_idx] if self.write_error is not None and k_scales is not None else None
        window = self.config.layer_window(layer_idx) or 0
        return (k_cache, v_cache, k_scales, v_scales, err, *step[:-1], window, self.softcap or 0.0, step[-1],
                self.rotation)

    def _native_step_args(self, inp: StepInputs) -> tuple | None:
        meta = inp.native
        if (meta is None or inp.triton is not None or self.cache.quant_kv is not None or meta.num_rows == 0
                or meta.num_rows != inp.slot_mapping.shape[0]):
            return None
        plan = inp.cascade
        nodes = [] if plan is None else [plan.node_seq, plan.node_start, plan.node_end, plan.node_row_ptr,
                                         plan.node_rows, plan.row_own_start]
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        return inp.slot_mapping, meta.block_tables, meta.row_seq, meta.row_len, scale, nodes

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        inp = self.inputs.group(cache.group_of[layer_idx])
        window, scale, softcap = self.config.layer_window(layer_idx), self.scale, self.softcap
        rotation = self.rotation
        if rotation is not None:  # q.k and p.v are unchanged by an orthonormal H; outliers are spread
            q, k, v = q @ rotation, k @ rotation, v @ rotation
        if cache.quant_kv is not None:  # a mixed pool: each block's format is its id's range
            out = self._mixed(layer_idx, q, k, v, inp, window)
            return out @ rotation if rotation is not None else out
        k_cache, v_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        if inp.triton is not None:
            out = self._triton(layer_idx, q, k, v, k_cache, v_cache, k_scales, v_scales, inp, window)
            return out @ rotation if rotation is not None else out
        if k_scales is not None:  # 8-bit blocks: quantized on write, scales kept per block and head
            assert v_scales is not None and self.write_error is not None
            err = self.write_error[layer_idx]
            write_kv_scaled(k_cache, k_scales, k, inp.slot_mapping, err[0])
            write_kv_scaled(v_cache, v_scales, v, inp.slot_mapping, err[1])
        else:
            write_kv(k_cache, v_cache, k, v, inp.slot_mapping)
        if inp.native is not None:
            out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype)
            if inp.native.num_rows:  # shared runs (inp.cascade) attended once for all their rows
                cascade.cascade_attention(out, q, k_cache, v_cache, inp.native, inp.cascade, scale,
                                          sliding_window=window, k_scales=k_scales, v_scales=v_scales,
                                          softcap=softcap)
            if rotation is not None:
                assert not inp.prefills  # 8-bit blocks: every row goes through the kernel
                return out @ rotation  # H H = I: back from the rotated V basis
        elif k_cache.dtype != q.dtype:  # the plain path over another storage (8-bit, another float dtype)
            base = 0 if k_scales is not None else cache.num_blocks
            full, quant = ((k_cache, v_cache), None) if k_scales is None or v_scales is None \
                else (None, QuantBlocks(k_cache, v_cache, k_scales, v_scales, 0))
            out = self._plain_staged(q, k, v, inp, window, full, quant, base)
            return out @ rotation if rotation is not None else out
        elif inp.identity_decode:
            return paged_decode_attention(q, k_cache, v_cache, inp.decode_groups[0].meta, scale, softcap)
        else:
            out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype)  # [T, H, d]
        return self._plain_rows(out, q, k, v, k_cache, v_cache, inp, window)

    def _plain_staged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: StepInputs, window: int | None,
                      full: tuple[torch.Tensor, torch.Tensor] | None, quant: QuantBlocks | None,
                      base: int) -> torch.Tensor:
        """The plain path over blocks not stored in q's dtype: the blocks the step reads, each in its
        format (ids below ``base`` float ``full``, the others 8-bit ``quant``), into q's dtype
        (``ops/paged_attention.blocks_as_float``), then the plain kernels. With 8-bit blocks a fresh
        prefill attends to its rows as stored, as the native kernels do."""
        ids = self._stage_ids.get(id(inp))
        if ids is None:
            ids = _step_block_ids(inp, self.cache.block_size, self.config.num_key_value_heads)
            self._stage_ids[id(inp)] = ids
        caches = [blocks_as_float(ids, full[i] if full is not None else None,
                                  None if quant is None else (quant.k_quant, quant.v_quant)[i],
                                  None if quant is None else (quant.k_scales, quant.v_scales)[i],
                                  quant.key_base if quant is not None and i == 0 else base, q.dtype)
                  for i in (0, 1)]
        if quant is not None:
            kvh, d = caches[0].shape[-2:]
            k, v = (c.view(-1, kvh, d).index_select(0, inp.slot_mapping) for c in caches)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype)
        return self._plain_rows(out, q, k, v, caches[0], caches[1], inp, window)

    def _plain_rows(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, inp: StepInputs, window: int | None) -> torch.Tensor:
        """The plain path's decode groups and prefill chunks into ``out`` (``k``/``v``: the step's
        own rows, which a fresh prefill attends directly)."""
        scale, softcap = self.scale, self.softcap
        for group in inp.decode_groups:
            q_dec = q.index_select(0, group.rows)
            out.index_copy_(0, group.rows, paged_decode_attention(q_dec, k_cache, v_cache, group.meta, scale, softcap))
        for p in inp.prefills:
            out[p.start:p.end] = paged_prefill_attention(
                q[p.start:p.end], k[p.start:p.end], v[p.start:p.end], k_cache, v_cache, p.block_table,
                p.start_pos, scale, sliding_window=window, softcap=softcap,
            )
        return out

    def _mixed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: StepInputs,
               window: int | None) -> torch.Tensor:
        """Cache write and attention over a mixed pool: new rows whose slot lies in a full-precision
        block are stored as they are, the others quantized into their 8-bit block; the kernel reads
        each block in its own format (every row goes through it). ``kv_quant_parts`` "v": every
        row's K is stored as it is (``blocks.k`` holds every block's), V as above."""
        blocks = self.cache.layer_blocks(layer_idx)
        assert blocks.k_quant is not None and blocks.v_quant is not None and self.write_error is not None
        assert blocks.k_scales is not None and blocks.v_scales is not None
        quant = QuantBlocks(blocks.k_quant, blocks.v_quant, blocks.k_scales, blocks.v_scales, blocks.base,
                            blocks.k_base)
        k_full = blocks.k_base is not None  # (K of every block at full precision)
        if inp.triton is not None:
            return self._triton(layer_idx, q, k, v, blocks.k, blocks.v, None, None, inp, window, quant)
        split = self._splits.get(id(inp))
        if split is None:  # once per step and KV group: which new rows go to which storage
            slots = inp.slot_mapping
            full = slots < blocks.base * self.cache.block_size
            full_rows, quant_rows = full.nonzero().view(-1), (~full).nonzero().view(-1)
            split = (full_rows, slots.index_select(0, full_rows), quant_rows,
                     slots.index_select(0, quant_rows) - blocks.base * self.cache.block_size)
            self._splits[id(inp)] = split
        full_rows, full_slots, quant_rows, quant_slots = split
        if k_full:
            kvh, d = blocks.k.shape[-2:]
            blocks.k.view(-1, kvh, d).index_copy_(0, inp.slot_mapping, k.to(blocks.k.dtype))
            if len(full_rows):
                blocks.v.view(-1, kvh, d).index_copy_(0, full_slots, v.index_select(0, full_rows).to(blocks.v.dtype))
        elif len(full_rows):
            write_kv(blocks.k, blocks.v, k.index_select(0, full_rows), v.index_select(0, full_rows), full_slots)
        if len(quant_rows):
            err = self.write_error[layer_idx]
            if not k_full:
                write_kv_scaled(blocks.k_quant, blocks.k_scales, k.index_select(0, quant_rows), quant_slots, err[0])
            write_kv_scaled(blocks.v_quant, blocks.v_scales, v.index_select(0, quant_rows), quant_slots, err[1])
        if inp.native is None:  # the plain path: the step's blocks read in their formats
            return self._plain_staged(q, k, v, inp, window, (blocks.k, blocks.v), quant, quant.base)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype)
        if inp.native.num_rows:  # (shared-block attention reads K and V by one base: not for kv_quant_parts v)
            cascade.cascade_attention(out, q, blocks.k, blocks.v, inp.native, None if k_full else inp.cascade,
                                      self.scale, sliding_window=window, softcap=self.softcap, quant=quant)
        return out

    def _triton(self, layer_idx: int, q, k, v, k_cache, v_cache, k_scales, v_scales, inp: StepInputs,
                window: int | None, quant: QuantBlocks | None = None) -> torch.Tensor:
        """Cache write and attention with the Triton kernels (``ops/triton``): decode rows in one
        call, prefill chunks in another, each reading K/V blocks in place. ``quant``: a mixed pool
        (``k_cache``/``v_cache`` its full-precision blocks), each row written into its block's
        storage and each block read in its format (shared-block attention is off there)."""
        from pagedkv.ops.triton import cache_ops as tc
        from pagedkv.ops.triton.cascade import cascade_decode_attention
        from pagedkv.ops.triton.decode import paged_decode_attention as triton_decode
        from pagedkv.ops.triton.prefill import paged_prefill_attention as triton_prefill

        meta: TritonMetadata = inp.triton  # type: ignore[assignment]  # set: the Triton path was chosen for it
        if quant is not None:  # no host sync: a row's slot in the other storage is -1 (skipped)
            assert self.write_error is not None
            err = self.write_error[layer_idx]
            split = self._slot_splits.get(id(inp))
            if split is None:
                edge = quant.base * self.cache.block_size
                full = inp.slot_mapping < edge
                split = self._slot_splits[id(inp)] = (torch.where(full, inp.slot_mapping, -1),
                                                      torch.where(full, -1, inp.slot_mapping - edge))
            if quant.k_base is not None:  # kv_quant_parts "v": every row's K as it is (one cache: given twice)
                tc.write_kv(k_cache, k_cache, k, k, inp.slot_mapping)
                tc.write_kv(v_cache, v_cache, v, v, split[0])
            else:
                tc.write_kv(k_cache, v_cache, k, v, split[0])
                tc.write_kv_scaled(quant.k_quant, quant.k_scales, k, split[1], err[0])
            tc.write_kv_scaled(quant.v_quant, quant.v_scales, v, split[1], err[1])
        elif k_scales is not None:
            assert self.write_error is not None
            err = self.write_error[layer_idx]
            tc.write_kv_scaled(k_cache, k_scales, k, inp.slot_mapping, err[0])
            tc.write_kv_scaled(v_cache, v_scales, v, inp.slot_mapping, err[1])
        else:
            tc.write_kv(k_cache, v_cache, k, v, inp.slot_mapping)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        if self.config.is_mla:  # one latent head, K and V its rows: every row, decode or prefill, in one launch
            from pagedkv.ops.triton.latent import latent_attention

            lengths = self._latent_len.get(id(inp))
            if lengths is None:
                lengths = self._latent_len[id(inp)] = (inp.positions + 1).to(torch.int32)
            return latent_attention(out, q, k_cache, meta.block_tables, meta.row_seq, lengths, scale,
                                    int(self.config.kv_lora_rank or 0), k_scales)
        if meta.num_decode and quant is not None:
            triton_decode(out, q, k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_len, scale,
                          sliding_window=window, softcap=self.softcap, quant=quant)
        elif meta.num_decode:
            # shared runs (inp.cascade) attended once for all their rows; None: the decode kernel alone
            cascade_decode_attention(out, q, k_cache, v_cache, meta.block_tables, meta.row_seq, meta.row_len,
                                     inp.cascade, scale, sliding_window=window, k_scales=k_scales,
                                     v_scales=v_scales, softcap=self.softcap)
        if meta.num_prefill:
            triton_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.chunk_seq, meta.chunk_row_start,
                           meta.chunk_num_rows, meta.chunk_start_pos, scale, sliding_window=window,
                           k_scales=k_scales, v_scales=v_scales, softcap=self.softcap, quant=quant)
        return out


def _check_recent(count: int, fmt: KVFormat, config: ModelConfig) -> None:
    """Refuse ``kv_recent_blocks`` where the recent block cannot be kept (ValueError naming what to do)."""
    if count < 0:
        raise ValueError(f"kv_recent_blocks must be >= 0, got {count}")
    if not fmt.scaled:
        raise ValueError(f"kv_recent_block keeps the tail block at the model dtype beside 8-bit blocks: it needs an "
                         f"8-bit kv_cache_dtype (int8, fp8, fp8_e5m2), got {fmt.name}")
    if config.is_mla:
        raise ValueError("kv_recent_block on an MLA model: its latent kernels read one block format; turn "
                         "kv_recent_block off")
    if len(kv_groups(config)) > 1:
        raise ValueError("kv_recent_block on a model with several KV groups (sliding-window layers): not supported; "
                         "turn kv_recent_block off")


def _step_block_ids(inp: StepInputs, block_size: int, kv_heads: int) -> torch.Tensor:
    """The blocks the plain path reads in one step of one KV group (block 0 too: padding points at
    it), sorted, int64."""
    parts = [torch.zeros(1, dtype=torch.long)]
    parts += [g.meta.k_rows // (kv_heads * block_size) for g in inp.decode_groups]
    parts += [p.block_table[:-(-(p.start_pos + p.end - p.start) // block_size)] for p in inp.prefills]
    return torch.unique(torch.cat([t.long().cpu() for t in parts]))


def _unsort_rows(chunks: list[SeqChunk], order: list[int], all_tokens: bool) -> torch.Tensor:
    """Row indices putting logits of ``chunks`` (original chunk ``order[j]`` at position j) back in
    the original chunk order."""
    sizes = [c.num_tokens if all_tokens else c.num_logits for c in chunks]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    where = [0] * len(order)
    for j, i in enumerate(order):
        where[i] = j
    rows = [r for i in range(len(order)) for r in range(starts[where[i]], starts[where[i]] + sizes[where[i]])]
    return torch.tensor(rows, dtype=torch.long)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` (``"cuda:N"``) or ``"auto"`` (CUDA when a device is visible) as a
    torch device; ValueError for CUDA without one."""
    text = str(device)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ValueError(f"device must be cpu, cuda (cuda:N) or auto, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda (cuda:N) or auto, got {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use device cpu")
    return dev


def choose_backend(device: torch.device, requested: str | None) -> str:
    """The attention backend: ``requested`` (or env ``PAGEDKV_ATTENTION``), else Triton on CUDA and
    the native kernels on CPU where they build, else plain PyTorch. Triton on CPU tensors runs in
    its interpreter only (``TRITON_INTERPRET=1``: the tests' way of running the GPU kernels here)."""
    from pagedkv.ops import triton as triton_ops

    backend = requested or envs.ATTENTION.get() or (
        "triton" if device.type == "cuda" else ("native" if native.available() else "plain"))
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if device.type == "cuda" and backend != "triton":
        raise ValueError(f"on CUDA the attention backend is triton, not {backend!r}")
    if backend == "triton" and not triton_ops.usable_on(device.type):
        why = ("triton is not installed" if not triton_ops.installed()
               else "Triton kernels run on CPU tensors only in its interpreter (set TRITON_INTERPRET=1)")
        raise ValueError(f"the triton attention backend is unusable on {device.type}: {why}")
    if backend == "native" and not native.available():
        raise ValueError(f"the native CPU kernels are unavailable: {native.why_unavailable()}")
    return backend


class ModelRunner:
    """Owns the KV cache of one model and executes steps described by ``SeqChunk`` lists (the
    engine's ``Runner``, ``runner/protocol.py``).

    Size the device pool with ``num_blocks`` or ``kv_cache_memory`` (bytes or "2GiB"; exactly one);
    ``num_host_blocks`` sizes the host pool used by swap_out/swap_in. ``kv_cache_dtype`` is the
    block format (:func:`pagedkv.ops.kv_format.kv_format`: "auto" is the model dtype; "int8",
    "fp8_e4m3", "fp8_e5m2" store 8-bit blocks with per-block scales; every backend reads every kind,
    the plain one by converting the step's blocks first).
    ``pack_lm_head`` replaces the model's LM head with a oneDNN-packed copy (float32 CPU only; the
    model is for inference). ``max_loras`` > 0 wraps the model's linears with that many LoRA slots
    of rank ``max_lora_rank`` (``pagedkv/lora/layers.py``; ``set_lora_slot`` fills one, a chunk's
    ``lora_slot`` picks one). ``cascade_attention`` (default on) attends the blocks several rows
    of a step share once for all of them (``pagedkv/ops/cascade.py``; the native kernel and the
    Triton decode kernel). ``kv_recent_blocks`` > 0 (an 8-bit ``kv_cache_dtype``; not MLA, not a
    hybrid model): that many shadow blocks at the model dtype hold the tail block of sequences
    while it fills (``kv_recent_block``, :class:`~pagedkv.runner.kv_cache.RecentShadows`), read in
    place of its 8-bit bytes; they lie after the ``kv_full_blocks`` full-precision ids of the pool,
    so the 8-bit ids callers give are shifted by it inside (callers see ``num_blocks`` blocks).
    ``native_layers`` (default on; native backend) runs each plain decoder layer in one native
    call on steps whose rows all attend through the native kernel (``models/native_layer.py``;
    the same kernels and results as the modules, without the Python between them).
    """

    def __init__(
        self,
        model: LoadedModel | LlamaForCausalLM,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: str | int | None = None,
        num_host_blocks: int = 0,
        kv_cache_dtype: str | torch.dtype | None = None,
        pack_lm_head: bool = True,
        native_attention: bool | None = None,
        device: str | torch.device = "cpu",
        attention_backend: str | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        kv_full_blocks: int = 0,
        cascade_attention: bool = True,
        kv_quant_parts: str = "kv",
        kv_recent_blocks: int = 0,
        native_layers: bool = True,
    ) -> None:
        net = model.model if isinstance(model, LoadedModel) else model
        self.device = resolve_device(device)
        if native_attention is not None and attention_backend is None:  # the older switch
            attention_backend = "native" if native_attention else "plain"
        self.backend = choose_backend(self.device, attention_backend)
        if self.device.type == "cpu":
            if pack_lm_head:  # ~2x faster LM head at decode batch sizes; see models/packed_linear.py
                pack_head(net)
            transpose_wide_linears(net)  # faster q/k/v and gate/up matmuls (models/packed_linear.py)
        else:
            net.to(self.device)
        self.model: LlamaForCausalLM = net
        self.config: ModelConfig = net.config
        d = self.config.head_dim
        # MLA's latent head (576 dims for V3) has its own Triton kernel (ops/triton/latent.py)
        if self.backend == "triton" and not self.config.is_mla and (d < 16 or d > 256 or d & (d - 1)):
            raise ValueError(f"the triton attention backend takes heads of a power of two in 16..256; this model's "
                             f"KV head has {d} dims: use device cpu with attention_backend native or plain")
        if self.backend == "triton" and self.config.is_mla and kv_full_blocks:
            raise ValueError("kv_full_blocks (a mixed KV pool) on an MLA model: the Triton latent kernel reads "
                             "one block format; use kv_full_blocks 0, or attention_backend native or plain")
        model_dtype = next(net.parameters()).dtype
        fmt = kv_format(kv_cache_dtype, model_dtype)
        # The native kernels read blocks in place and fuse RMSNorm.
        self.native_attention = self.backend == "native"
        # Shared-block attention: runs of blocks several rows hold are attended once for all of
        # them (ops/cascade.py; native and Triton decode kernels). Off: each row alone, as the plain path.
        self.cascade_attention = cascade_attention
        if (num_blocks is None) == (kv_cache_memory is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_memory")
        if num_blocks is None:
            assert kv_cache_memory is not None
            num_blocks = num_blocks_for_memory(self.config, block_size, kv_cache_memory, fmt.name,
                                               model_dtype if kv_quant_parts == "v" else None)
        if kv_recent_blocks:
            _check_recent(kv_recent_blocks, fmt, self.config)
        self.cache = KVCache(self.config, block_size=block_size, num_blocks=num_blocks + kv_recent_blocks,
                             num_host_blocks=num_host_blocks, dtype=fmt.name, device=self.device,
                             full_blocks=kv_full_blocks + kv_recent_blocks, full_dtype=model_dtype,
                             quant_parts=kv_quant_parts, host_full=kv_full_blocks > 0 or not kv_recent_blocks)
        # kv_recent_block: shadows at ids [F, F + S) of the pool; callers' 8-bit ids from F shift by S
        self._full_ids = kv_full_blocks if kv_recent_blocks else num_blocks + 1
        self._recent = RecentShadows(kv_full_blocks, kv_recent_blocks) if kv_recent_blocks else None
        # Quantization error of what the 8-bit formats store: sum((dequantized - x)^2), sum(x^2)
        # per layer and K/V, accumulated by the write kernel (kv_quant_error reads it).
        self.write_error = (torch.zeros(self.config.num_hidden_layers, 2, 2, dtype=torch.float64,
                                        device=self.device) if fmt.scaled else None)
        # 8-bit blocks store K and V rotated by a Hadamard matrix (queries rotated alike, outputs
        # rotated back): it spreads the few outlier channels of K over all channels, so a block's
        # absmax scale wastes less of the 8 bits (docs/kv_quantization.md has the measurements).
        self.rotation = hadamard(self.config.head_dim, model_dtype) if fmt.rotated else None
        if self.rotation is not None:
            self.rotation = self.rotation.to(self.device)
        if self.native_attention:
            for module in net.modules():
                if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):  # fused ops (ops/fused.py)
                    module.native = True
        self.lora: LoRAStack | None = apply_lora(net, max_loras, max_lora_rank) if max_loras else None
        # Each plain layer in one native call on the steps every row of which the native kernel
        # attends (models/native_layer.py): the same kernels, without the Python between them.
        self.native_layers = native_layers and self.native_attention and self.device.type == "cpu"
        net.enable_native_layers(self.native_layers)

    def set_lora_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Copy an adapter's weights into LoRA slot ``slot`` (None: empty it)."""
        if self.lora is None:
            raise ValueError("this runner has no LoRA slots (build it with max_loras > 0)")
        self.lora.set_slot(slot, weights)

    def close(self) -> None:
        """Nothing to release on one device (the Runner protocol's last call)."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Never called: one device fails only inside a call, which raises."""

    @property
    def kv_format(self) -> KVFormat:
        return self.cache.format

    @property
    def kv_full_blocks(self) -> int:
        """A mixed pool's full-precision blocks (ids below it); 0 for a single-format pool."""
        if self._recent is not None:
            return self._full_ids
        return self.cache.quant_base if self.cache.is_mixed else 0

    @property
    def kv_recent_blocks(self) -> int:
        """The shadow blocks of ``kv_recent_block`` (0: off)."""
        return 0 if self._recent is None else self._recent.count

    @property
    def kv_quant_parts(self) -> str:
        """Which parts an 8-bit pool's blocks hold 8-bit: "kv", or "v" (K at the model dtype)."""
        return self.cache.quant_parts

    def kv_quant_error(self) -> list[tuple[float, float]] | None:
        """Relative RMS error (K, V) per layer of every row stored so far in an 8-bit format
        (``sqrt(sum((dequantized - x)^2) / sum(x^2))``; 0 before any write), or None."""
        if self.write_error is None:
            return None
        def rel(err: float, ref: float) -> float:
            return (err / ref) ** 0.5 if ref > 0 else 0.0

        return [(rel(*k), rel(*v)) for k, v in self.write_error.tolist()]  # per layer: (K, V) of (err, ref) sums

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def bytes_per_block(self) -> int:
        """One block's bytes as the callers count blocks: ``kv_recent_block``'s shadows spread over
        them (so that ``num_blocks`` times it is the device pool's bytes)."""
        if self._recent is not None:
            return -(-self.cache.device_bytes // self.num_blocks)
        return self.cache.bytes_per_block

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self.cache.groups

    @property
    def payload_bytes(self) -> int:
        """One block's payload size, measured on block 0 (what ``block_payloads`` writes)."""
        return len(self.block_payloads([0])[0]) if self.num_blocks else 0

    @property
    def model_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def weight_bytes(self) -> int:
        return model_weight_bytes(self.model)

    @property
    def weights_quantization(self) -> str | None:
        return "q8_0" if any(isinstance(m, QuantLinear) for m in self.model.modules()) else None

    def set_context_length(self, context: int) -> None:
        self.model.set_context_length(context)

    @property
    def num_blocks(self) -> int:
        """The block ids callers use (the pool's, less ``kv_recent_block``'s shadows)."""
        return self.cache.num_blocks - self.kv_recent_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.cache.num_host_blocks

    def prepare(self, chunks: Sequence[SeqChunk]) -> StepInputs:
        """Validate chunks and build the step's shared indices (raises BatchError)."""
        cfg = self.config
        chunks = list(chunks)
        groups = self.cache.groups
        if len(groups) > 1 and any(len(c.group_tables) != len(groups) - 1 for c in chunks):
            raise BatchError(f"this model's KV cache has {len(groups)} groups: every chunk needs "
                             f"{len(groups) - 1} group_tables")
        # the plain path's buffers: blocks of another storage are read into the model dtype
        plain_dtype = self.cache.full_format.storage
        per_group = [build_step_inputs([c.in_group(g) for c in chunks], block_size=self.block_size,
                                       num_blocks=self.cache.num_blocks, num_heads=cfg.num_attention_heads,
                                       kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                       sliding_window=cfg.layer_window(group.layers[0]), dtype=plain_dtype,
                                       native=self.native_attention, fresh_from_cache=self.cache.format.scaled,
                                       triton=self.backend == "triton", device=self.device,
                                       cascade=self.cascade_attention)
                     for g, group in enumerate(groups)]
        per_group[0].other_groups = per_group[1:]
        return per_group[0]

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk], return_all_logits: bool = False) -> torch.Tensor:
        """Compute every chunk in one forward pass and write their K/V into the cache.

        Returns float32 logits ``[len(chunks), vocab]`` of each chunk's last token (every token of
        a chunk with ``all_logits``, in chunk order: ``sum(c.num_logits)`` rows), or
        ``[total_tokens, vocab]`` (chunk order) with ``return_all_logits``. Raises BatchError.
        """
        chunks = list(chunks)
        order = None
        if self.lora is not None and any(c.lora_slot >= 0 for c in chunks):
            # each adapter's rows as one run (layers.py): chunks ordered by slot, logits put back
            order = sorted(range(len(chunks)), key=lambda i: chunks[i].lora_slot)
            if order == list(range(len(chunks))):
                order = None
            else:
                chunks = [chunks[i] for i in order]
        through: list[int] = []
        if self._recent is not None:  # the pool's ids, tail blocks read (and written) through their shadows
            chunks, through = self._through_shadows(chunks)
        try:
            inputs = self.prepare(chunks)
            attention = _StepAttention(self.cache, inputs, self.config, self.write_error, self.rotation,
                                       self.native_layers)
            wanted = None if return_all_logits else inputs.logits_indices
            if order is not None and wanted is not None:  # the rows picked in the chunks' own order
                wanted = wanted.index_select(0, _unsort_rows(chunks, order, False).to(wanted.device))
            with self.lora.step(inputs.lora_ranges) if self.lora is not None else nullcontext():
                logits = self.model(inputs.input_ids, inputs.positions, attention, logits_indices=wanted,
                                    max_position=inputs.max_position)
        except BaseException:
            if self._recent is not None:  # (rows of a failed step: past the sequence's end)
                self._store_shadows(through, all_of_them=True)
            raise
        if through:
            self._store_shadows(through)
        if order is not None and return_all_logits:
            logits = logits.index_select(0, _unsort_rows(chunks, order, True).to(logits.device))
        return logits.float().cpu()  # the sampler works on the host (a no-op on CPU)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst, all layers."""
        self._check(pairs, self.num_blocks, self.num_blocks, "copy_blocks")
        if self._recent is not None:
            own = [(self._id(s), self._id(d)) for s, d in pairs]
            self._store_shadows([s for s, _ in own], keep=True)  # the sources' 8-bit blocks complete
            own = self._copy_shadows(own)
            self._store_shadows([])  # (shadows reclaimed for the copies')
            self.cache.copy(own)
        elif self.cache.is_mixed:
            self.cache.copy(pairs)
        elif self.backend == "triton":
            from pagedkv.ops.triton.cache_ops import copy_blocks as triton_copy_blocks
            triton_copy_blocks(self.cache.kv, pairs, self.cache.scales)
        else:
            copy_blocks(self.cache.kv, pairs, self.cache.scales)

    @torch.inference_mode()
    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device block -> host block for each (device_id, host_id) pair."""
        self._check(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
        if self._recent is not None:  # the 8-bit block made complete, its shadow freed with it
            pairs = [(self._id(d), h) for d, h in pairs]
            self._store_shadows([d for d, _ in pairs], all_of_them=True)
        if self.cache.is_mixed:  # each block keeps its format on the host
            self.cache.swap(pairs, to_host=True)
            return
        swap_blocks(self.cache.kv, self.cache.host_kv, pairs, self.cache.scales, self.cache.host_scales)

    @torch.inference_mode()
    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host block -> device block for each (host_id, device_id) pair."""
        self._check(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
        if self._recent is not None:  # a block id given data another way loses its shadow
            pairs = [(h, self._id(d)) for h, d in pairs]
            for _, d in pairs:
                self._recent.drop(d)
        if self.cache.is_mixed:  # into the device block's format (converted where it differs)
            self.cache.swap(pairs, to_host=False)
            return
        swap_blocks(self.cache.host_kv, self.cache.kv, pairs, self.cache.host_scales, self.cache.scales)

    @torch.inference_mode()
    def block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        """Device blocks' K/V (and scales) as bytes, one ``bytes`` per block (the disk tier's payload)."""
        self._check([(b, 0) for b in block_ids], self.num_blocks, 1, "block_payloads")
        if self.cache.is_mixed:  # a format byte, then that format's bytes (KVCache.payloads)
            own = [self._id(b) for b in block_ids]
            if self._recent is not None:
                self._store_shadows(own, keep=True)
            return self.cache.payloads(own)
        return block_payloads(self.cache.kv, block_ids, self.cache.scales)

    @torch.inference_mode()
    def host_block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        """Host blocks' K/V (and scales) as bytes (see :meth:`block_payloads`)."""
        self._check([(b, 0) for b in block_ids], self.num_host_blocks, 1, "host_block_payloads")
        if self.cache.is_mixed:
            return self.cache.payloads(block_ids, host=True)
        return block_payloads(self.cache.host_kv, block_ids, self.cache.host_scales)

    @torch.inference_mode()
    def load_host_blocks(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        """Write ``(host block, payload)`` pairs read from the disk tier into the host pool."""
        self._check([(0, b) for b, _ in pairs], 1, self.num_host_blocks, "load_host_blocks")
        if self.cache.is_mixed:  # each block back in the format its payload names
            self.cache.load_host_payloads(pairs)
            return
        load_block_payloads(self.cache.host_kv, pairs, self.cache.host_scales)

    def _id(self, block: int) -> int:
        """The pool's id of a caller's block id (``kv_recent_block``: 8-bit ids after the shadows)."""
        return block + self.kv_recent_blocks if block >= self._full_ids else block

    def _through_shadows(self, chunks: list[SeqChunk]) -> tuple[list[SeqChunk], list[int]]:
        """``kv_recent_block``: the chunks with the pool's block ids, each 8-bit block they write
        read and written through its shadow where it has a valid one (:meth:`RecentShadows.plan_writes`;
        fresh shadows zeroed), and the blocks written through one (stored into their 8-bit blocks
        when they fill, or before anything else reads those: :meth:`_store_shadows`)."""
        recent, bs = self._recent, self.block_size
        assert recent is not None
        writes = []
        for c in chunks:
            start, end = c.start_pos, c.start_pos + len(c.token_ids)
            for i in range(start // bs, -(-end // bs)):
                block = self._id(c.block_table[i]) if i < len(c.block_table) else -1
                if block >= recent.first:  # (a full-precision block, a sink's, needs none)
                    writes.append((block, max(start - i * bs, 0), min(end - i * bs, bs)))
        fresh, through = recent.plan_writes(writes, bs)
        self._store_shadows([])  # the reclaimed shadows' rows into their blocks before the shadows are reused
        if fresh:
            self._zero_blocks(fresh)
        shadowed = []
        for c in chunks:
            last = -(-(c.start_pos + len(c.token_ids)) // bs)  # (blocks past the chunk's end: not read)
            table = [recent.read_id(self._id(b)) if i < last and b >= 0 else self._id(b) if b >= 0 else b
                     for i, b in enumerate(c.block_table)]
            shadowed.append(replace(c, block_table=table))
        return shadowed, through

    def _zero_blocks(self, ids: list[int]) -> None:
        """Zero full-precision blocks ``ids`` of the pool (K and V, every layer)."""
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.cache.kv.index_fill_(2, index, 0)
        if self.cache.keys is not None:
            self.cache.keys.index_fill_(2, index, 0)

    def _store_shadows(self, blocks: list[int], all_of_them: bool = False, keep: bool = False) -> None:
        """Shadows' rows into their 8-bit blocks (a converting copy: fresh absmax scales over the
        rows so far, ``ops/cache_ops``), and the shadows given back: the reclaimed ones
        (:attr:`RecentShadows.evicted`) always; of ``blocks`` (those with a shadow), the full ones
        (after a step), every one (``all_of_them``: a swap-out, a failed step), or none given back
        (``keep``: a block move is about to read the 8-bit blocks)."""
        recent = self._recent
        assert recent is not None
        pairs = recent.take_evicted()
        held = [b for b in dict.fromkeys(blocks) if b in recent.of]
        if not (all_of_them or keep):
            held = [b for b in held if recent.of[b].filled >= self.block_size]
        pairs += [(recent.of[b].slot, b) for b in held]
        if pairs:
            self.cache.copy(pairs)
        if not keep:
            for b in held:
                recent.drop(b)

    def _copy_shadows(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``kv_recent_block``'s copy-on-write (the pool's ids): a destination loses its shadow; one
        whose source has a shadow gets a copy of it (where one is free, or reclaimed). The pairs to
        copy: the given ones and the shadows'."""
        recent = self._recent
        assert recent is not None
        for _, d in pairs:
            recent.drop(d)
        busy = {s for s, _ in pairs} | {d for _, d in pairs}
        shadows = []
        for s, d in pairs:
            source = recent.of.get(s)
            if source is not None:
                filled = source.filled
                slot = recent.assign(d, busy, reclaim=True)
                if slot is not None:
                    recent.of[d].filled = filled
                    shadows.append((source.slot, slot))
        return pairs + shadows

    @staticmethod
    def _check(pairs: Sequence[tuple[int, int]], n_src: int, n_dst: int, what: str) -> None:
        for s, d in pairs:
            if not (0 <= s < n_src and 0 <= d < n_dst):
                raise BatchError(f"{what}: pair ({s}, {d}) out of range (src < {n_src}, dst < {n_dst})")
