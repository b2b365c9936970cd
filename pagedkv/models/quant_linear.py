"""Linear layers and the token embedding over Q8_0 weights kept quantized (weight-only: activations
stay float32).

A Q8_0 weight ``W [N, K]`` is ``qweight [N, K]`` int8, ``scales [N, K / 32]`` float32 and, optionally,
``offsets [N, K / 32]`` float32, with ``W[n, k] = scales[n, k // 32] * qweight[n, k] (+ offsets[n, k // 32])``::

    qweight row n:  | q0 .. q31 | q32 .. q63 | ...   int8, K values
    scales row n:   |    d0     |    d1     | ...   float32, one per 32 values
    offsets row n:  |    o0     |    o1     | ...   float32, one per 32 values (or no tensor: all 0)

The offsets make GGUF's Q4_1, Q5_1, Q4_K and Q5_K exact in this layout (``models/gguf_quants.py``);
without them it is GGUF's Q8_0 (and Q4_0, Q5_0) with the fp16 scales widened.

Rows are output features, so fused layers (q/k/v, gate/up) are the shards' rows concatenated, as
for float weights. ``QuantLinear`` runs ``torch.ops.pagedkv.q8_0_linear`` (``ops/csrc/quant_matmul.cpp``)
where the native kernels are built, else a plain-PyTorch path that dequantizes 256 rows at a time.
``QuantEmbedding`` dequantizes only the rows it gathers; a tied LM head is a ``QuantLinear`` over
the embedding's own tensors (no second copy).

The same modules hold the low-bit layouts (``fmt`` one of ``weight_quant.LOWBIT_FORMATS``: GGUF's
4-, 5- and 6-bit types at their own width, ``models/gguf_quants.py``)::

    qweight row n:  | 16 bytes: values 0..15 low, 16..31 high | ...   uint8, K / 2 bytes
    planes row n:   | P x 4 bytes: bit j = value j's bit 4 + p | ...   uint8, K / 8 * P bytes (None: P = 0)
    scales row n:   | one float32 per 32 (per 16 for Q6_K) ...
    offsets row n:  | one float32 per 32, or no tensor

run by ``torch.ops.pagedkv.lowbit_linear`` (``ops/csrc/lowbit_matmul.cpp``: registers, no float
copy of the weight at batch 1; dequantized tiles and the BLAS matmul for many rows), else the
plain-PyTorch path, which dequantizes 256 rows at a time exactly as ``gguf`` does.

The model code is untouched: ``build_model`` puts these modules where the checkpoint holds Q8_0
or low-bit tensors, and ``quantize_model`` swaps a float model's modules for Q8_0 ones.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.ops import native
from pagedkv.weight_quant import LOWBIT_FORMATS, Q8_0_GROUP, LowBitFormat

FORMATS = ("q8_0", *LOWBIT_FORMATS)  # the ``fmt`` of QuantLinear / QuantEmbedding

_FALLBACK_TILE = 256  # weight rows dequantized at a time by the plain-PyTorch path


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (K a multiple of 32) -> (int8 ``[N, K]``, float32 scales ``[N, K / 32]``),
    scale = absmax / 127 per 32 values along K (0 for an all-zero run)."""
    n, k = weight.shape
    if k % Q8_0_GROUP:
        raise ValueError(f"Q8_0 needs in_features to be a multiple of {Q8_0_GROUP}, got {k}")
    blocks = weight.detach().float().reshape(n, k // Q8_0_GROUP, Q8_0_GROUP)
    scales = blocks.abs().amax(-1) / 127.0  # [N, K / 32]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = (blocks * inv[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


def dequantize_q8_0(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[N, K]`` of a Q8_0 weight (any leading rows: a slice or a gather), computed
    as ``scale * q + offset`` in float32, which is bit for bit GGUF's own dequantization of the
    types kept exactly (``models/gguf_quants.py``)."""
    n, k = qweight.shape
    w = qweight.to(torch.float32).view(n, k // Q8_0_GROUP, Q8_0_GROUP) * scales[..., None]
    if offsets is not None:
        w += offsets[..., None]
    return w.view(n, k).to(dtype)


_LUTS: dict[str, torch.Tensor] = {}  # format name -> its int8 lookup table (IQ4_NL)
_BIT = torch.arange(8, dtype=torch.uint8)


def _lut(fmt: LowBitFormat) -> torch.Tensor | None:
    if fmt.lut is None:
        return None
    if fmt.name not in _LUTS:
        _LUTS[fmt.name] = torch.tensor(fmt.lut, dtype=torch.int8)
    return _LUTS[fmt.name]


def dequantize_lowbit(qweight: torch.Tensor, planes: torch.Tensor | None, scales: torch.Tensor,
                      offsets: torch.Tensor | None, fmt: str | LowBitFormat,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[N, K]`` of a low-bit weight (any leading rows): ``scale * value + offset``
    in float32, bit for bit GGUF's own dequantization of the type it holds."""
    f = LOWBIT_FORMATS[fmt] if isinstance(fmt, str) else fmt
    n, k = qweight.shape[0], qweight.shape[1] * 2
    runs = qweight.view(n, k // Q8_0_GROUP, 16)
    codes = torch.cat([runs & 0x0F, runs >> 4], dim=-1)  # [N, K / 32, 32] uint8
    if planes is not None:
        bits = ((planes.view(n, k // Q8_0_GROUP, f.planes, 4, 1) >> _BIT) & 1).view(n, k // Q8_0_GROUP, f.planes, 32)
        for p in range(f.planes):
            codes |= bits[:, :, p] << (4 + p)
    lut = _lut(f)
    values = lut.to(torch.float32)[codes.long()] if lut is not None else codes.to(torch.float32) - f.zero
    w = values.view(n, k // f.group, f.group) * scales[..., None]
    if offsets is not None:
        w = w.view(n, k // Q8_0_GROUP, Q8_0_GROUP) + offsets[..., None]
    return w.reshape(n, k).to(dtype)


def _dequantize(module: QuantLinear | QuantEmbedding | QuantExperts, rows: slice | torch.Tensor,
                dtype: torch.dtype = torch.float32, expert: int | None = None) -> torch.Tensor:
    """``module``'s float weight rows ``rows`` (a slice or a gather of row ids), in its format; of
    expert ``expert`` for a :class:`QuantExperts`."""
    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if expert is not None:
            t = t[expert]
        return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)
    q, scales = take(module.qweight), take(module.scales)
    assert q is not None and scales is not None  # buffers every module has
    if module.fmt == "q8_0":
        return dequantize_q8_0(q, scales, take(module.offsets), dtype)
    return dequantize_lowbit(q, take(module.planes), scales, take(module.offsets), module.fmt, dtype)


def q8_0_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          offsets: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` in plain PyTorch, dequantizing ``_FALLBACK_TILE`` weight rows at a time
    (a bounded temporary, never the whole float weight)."""
    n = qweight.shape[0]
    out = x.new_empty(x.shape[0], n)  # [M, N]
    for n0 in range(0, n, _FALLBACK_TILE):
        n1 = min(n, n0 + _FALLBACK_TILE)
        rows = dequantize_q8_0(qweight[n0:n1], scales[n0:n1], None if offsets is None else offsets[n0:n1])
        out[:, n0:n1] = x @ rows.t()
    return out


def _register(module: QuantLinear | QuantEmbedding | QuantExperts, rows: int, cols: int, offsets: bool,
              fmt: str = "q8_0") -> None:
    """The ``qweight``, ``planes`` (None but for 5 and 6 bits), ``scales`` and (None unless
    ``offsets``) ``offsets`` buffers of a module in format ``fmt`` (the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
    if cols % Q8_0_GROUP:
        raise ValueError(f"{fmt} needs in_features to be a multiple of {Q8_0_GROUP}, got {cols}")
    module.fmt = fmt
    if fmt == "q8_0":
        module.register_buffer("qweight", torch.zeros(rows, cols, dtype=torch.int8))
        module.register_buffer("planes", None)
        module.register_buffer("scales", torch.zeros(rows, cols // Q8_0_GROUP))
    else:
        f = LOWBIT_FORMATS[fmt]
        module.register_buffer("qweight", torch.zeros(rows, cols // 2, dtype=torch.uint8))
        module.register_buffer("planes", torch.zeros(rows, cols // 8 * f.planes, dtype=torch.uint8)
                               if f.planes else None)
        module.register_buffer("scales", torch.zeros(rows, cols // f.group))
    module.register_buffer("offsets", torch.zeros(rows, cols // Q8_0_GROUP) if offsets else None)


def _native_ok(fmt: str = "q8_0") -> bool:
    if not native.available():
        return False
    # an extension built from older sources lacks the low-bit op: the plain-PyTorch path then
    return fmt == "q8_0" or hasattr(torch.ops.pagedkv, "lowbit_linear")


def lowbit_linear_reference(x: torch.Tensor, module: QuantLinear) -> torch.Tensor:
    """``x [M, K] @ W^T`` for a low-bit ``module`` in plain PyTorch, ``_FALLBACK_TILE`` rows at a time."""
    n = module.out_features
    out = x.new_empty(x.shape[0], n)
    for n0 in range(0, n, _FALLBACK_TILE):
        n1 = min(n, n0 + _FALLBACK_TILE)
        out[:, n0:n1] = x @ _dequantize(module, slice(n0, n1)).t()
    return out


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in Q8_0 or, by ``fmt``, a low-bit layout (buffers ``qweight``,
    ``planes``, ``scales`` and ``offsets``, None unless ``offsets``; see the module docstring).

    ``x`` may be any float dtype and shape ``[..., in_features]``; it is computed in float32 and
    the result returned in ``x``'s dtype. ``native`` None (default) uses the native kernel where it
    is built; False forces the plain-PyTorch path (tests, comparisons).
    """

    # buffers (see _register), declared so that their type is not nn.Module's __getattr__'s
    qweight: torch.Tensor  # [out, in] int8 (q8_0) or [out, in // 2] uint8 (low-bit)
    planes: torch.Tensor | None
    scales: torch.Tensor  # [out, in // 32] (in // 16: i6)
    offsets: torch.Tensor | None
    fmt: str

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 bias_dtype: torch.dtype = torch.float32, offsets: bool = False, fmt: str = "q8_0") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        _register(self, out_features, in_features, offsets, fmt)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        self.native: bool | None = None
        f = LOWBIT_FORMATS.get(fmt)
        self._lowbit = None if f is None else (_lut(f), f.zero)  # the low-bit op's (lut, zero); None: q8_0

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        """Quantize ``weight [out, in]`` (the bias is kept as it is)."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None,
                    bias_dtype=bias.dtype if bias is not None else torch.float32)
        layer.qweight, layer.scales = quantize_q8_0(weight)
        if bias is not None:
            assert layer.bias is not None  # made with one just above
            layer.bias.data.copy_(bias.detach())
        return layer

    @classmethod
    def sharing(cls, embedding: QuantEmbedding) -> QuantLinear:
        """The tied LM head: a QuantLinear over ``embedding``'s own tensors (no copy)."""
        head = cls(embedding.embedding_dim, embedding.num_embeddings, fmt=embedding.fmt)
        head.qweight, head.planes = embedding.qweight, embedding.planes
        head.scales, head.offsets = embedding.scales, embedding.offsets
        return head

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight ``[out, in]``: a fresh copy, for inspection only."""
        return _dequantize(self, slice(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the model's own case (float32 rows [M, K], contiguous) skips the reshapes and casts: at one
        # row a call's Python costs as much as a small layer's kernel
        plain = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        x2 = x if plain else x.reshape(-1, self.in_features).to(torch.float32).contiguous()  # [M, K]
        if self.native is None:
            self.native = _native_ok(self.fmt)
        # the buffers straight from their dict: nn.Module's __getattr__ costs ~1.5 us a name here, as
        # much as the op's own dispatch (4 names a call, ~120 calls a decode step)
        b = self._buffers
        if self.native:
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)  # [M, N]
            if self._lowbit is None:
                torch.ops.pagedkv.q8_0_linear.default(out, x2, b["qweight"], b["scales"], b["offsets"])
            else:
                torch.ops.pagedkv.lowbit_linear.default(out, x2, b["qweight"], b["planes"], b["scales"],
                                                        b["offsets"], *self._lowbit)
        elif self.fmt == "q8_0":
            out = q8_0_linear_reference(x2, self.qweight, self.scales, self.offsets)  # plain PyTorch: no hurry
        else:
            out = lowbit_linear_reference(x2, self)
        bias = self._parameters.get("bias")  # None: no bias (a plain attribute then)
        if bias is not None:
            out += bias
        return out if plain else out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.fmt}{'+offsets' if self.offsets is not None else ''}")


class QuantEmbedding(nn.Module):
    """A token embedding ``[num_embeddings, embedding_dim]`` in Q8_0 or a low-bit ``fmt`` (with
    ``offsets`` or not, as ``QuantLinear``); a lookup dequantizes only the gathered rows, into
    ``dtype`` (the model's)."""

    qweight: torch.Tensor  # buffers, as QuantLinear's
    planes: torch.Tensor | None
    scales: torch.Tensor
    offsets: torch.Tensor | None
    fmt: str

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 offsets: bool = False, fmt: str = "q8_0") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        _register(self, num_embeddings, embedding_dim, offsets, fmt)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantEmbedding:
        num_embeddings, embedding_dim = weight.shape
        emb = cls(num_embeddings, embedding_dim, dtype=weight.dtype)
        emb.qweight, emb.scales = quantize_q8_0(weight)
        return emb

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in ``dtype``: a fresh copy, for inspection only."""
        return _dequantize(self, slice(None), self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, embedding_dim]
        rows = _dequantize(self, input_ids.reshape(-1), self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        offsets = "+offsets" if self.offsets is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt}{offsets}"


class QuantExperts(nn.Module):
    """The weights of ``num_experts`` experts, ``[E, out, in]`` (a MoE layer's ``gate_up`` or
    ``down``, ``models/moe.py``), kept quantized: the buffers of a :class:`QuantLinear` with the
    expert first (``qweight [E, out, in]``, ``scales [E, out, in / 32]``, ...), so expert ``e``'s
    slice ``qweight[e]`` is a contiguous ``[out, in]`` weight the linear kernels take in place.

    ``linear(e, x)`` runs one expert over all the rows routed to it: one kernel call per active
    expert per step. (Per-expert slices measured against a batched kernel: bench/mla.py's
    ``moe`` figures; docs/mla.md.)
    """

    qweight: torch.Tensor  # [E, out, in] int8 (q8_0) or [E, out, in // 2] uint8 (low-bit)
    planes: torch.Tensor | None
    scales: torch.Tensor  # [E, out, in // 32] (in // 16: i6)
    offsets: torch.Tensor | None
    fmt: str

    def __init__(self, num_experts: int, in_features: int, out_features: int, offsets: bool = False,
                 fmt: str = "q8_0") -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        _register(self, num_experts * out_features, in_features, offsets, fmt)
        for name in ("qweight", "planes", "scales", "offsets"):  # expert first
            if (t := getattr(self, name)) is not None:
                setattr(self, name, t.view(num_experts, out_features, -1))
        self.native: bool | None = None
        f = LOWBIT_FORMATS.get(fmt)
        self._lowbit = None if f is None else (_lut(f), f.zero)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantExperts:
        """Quantize ``weight [E, out, in]`` to Q8_0 (absmax / 127 per 32 values)."""
        e, n, k = weight.shape
        experts = cls(e, k, n)
        q, scales = quantize_q8_0(weight.reshape(e * n, k))
        experts.qweight, experts.scales = q.view(e, n, k), scales.view(e, n, -1)
        return experts

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight ``[E, out, in]``: a fresh copy, for inspection only."""
        return torch.stack([_dequantize(self, slice(None), expert=e) for e in range(self.num_experts)])

    def linear(self, expert: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, in] @ W[expert]^T`` into ``out [M, out]`` (made when None); ``x`` and ``out``
        float32 and contiguous."""
        if out is None:
            out = x.new_empty(x.shape[0], self.out_features)
        if self.native is None:
            self.native = _native_ok(self.fmt)
        offsets = None if self.offsets is None else self.offsets[expert]
        if not self.native:  # plain PyTorch: _FALLBACK_TILE rows of the expert dequantized at a time
            for n0 in range(0, self.out_features, _FALLBACK_TILE):
                n1 = min(self.out_features, n0 + _FALLBACK_TILE)
                out[:, n0:n1] = x @ _dequantize(self, slice(n0, n1), expert=expert).t()
        elif self._lowbit is None:
            torch.ops.pagedkv.q8_0_linear(out, x, self.qweight[expert], self.scales[expert], offsets)
        else:
            planes = None if self.planes is None else self.planes[expert]
            torch.ops.pagedkv.lowbit_linear(out, x, self.qweight[expert], planes, self.scales[expert], offsets,
                                            *self._lowbit)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.fmt}{'+offsets' if self.offsets is not None else ''}")


def quantize_model(model: nn.Module) -> int:
    """Swap ``model``'s float linear layers (every ``nn.Linear`` whose input is a multiple of 32),
    its MoE layers' expert weights (the 3-D parameters a module names in ``EXPERT_WEIGHTS``, as
    :class:`QuantExperts`), its token embedding and its LM head for Q8_0 ones; a tied head shares
    the embedding's tensors. Returns how many modules were swapped; idempotent. Apply it to a
    loaded model used for inference.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % Q8_0_GROUP == 0:
                setattr(parent, name, QuantLinear.from_float(child.weight, child.bias))
                swapped += 1
        for name in getattr(parent, "EXPERT_WEIGHTS", ()):
            weight = getattr(parent, name)
            if isinstance(weight, nn.Parameter) and weight.dim() == 3 and weight.shape[-1] % Q8_0_GROUP == 0:
                delattr(parent, name)  # a Parameter's name takes no module until it is gone
                setattr(parent, name, QuantExperts.from_float(weight))
                swapped += 1
    embed = getattr(model, "embed_tokens", None)
    if type(embed) is nn.Embedding and embed.embedding_dim % Q8_0_GROUP == 0:
        model.embed_tokens = QuantEmbedding.from_float(embed.weight)
        swapped += 1
    tie_quantized_head(model)
    return swapped


def tie_quantized_head(model: nn.Module) -> None:
    """A tied model (``lm_head`` None) whose embedding is Q8_0 gets a ``QuantLinear`` head over it."""
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", 0) is None and isinstance(embed, QuantEmbedding):
        model.lm_head = QuantLinear.sharing(embed)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, shared tensors counted once, and of every
    oneDNN-packed weight (a ``PackedLinear``'s ``packed``: opaque, neither parameter nor buffer)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor) and packed.is_mkldnn:
            total += packed.numel() * packed.element_size()
    return total


__all__ = ["FORMATS", "QuantEmbedding", "QuantExperts", "QuantLinear", "dequantize_lowbit", "dequantize_q8_0",
           "lowbit_linear_reference", "q8_0_linear_reference", "quantize_model",
           "quantize_q8_0", "tie_quantized_head", "weight_bytes"]
