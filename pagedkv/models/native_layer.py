"""A decoder layer in one native call (``ops/csrc/decoder_layer.cpp``): its weights packed once, its
step run from C++.

Why: at batch 1 the kernels of a layer are done in about half a millisecond, and the Python around
them (eight module calls, a dozen torch dispatches, their temporaries) adds about a tenth of a
millisecond a layer: 3-4 ms of a 20 ms token for the default model (``docs/weight_quantization.md``).
The native layer calls the same kernels as the module path (``torch.ops.pagedkv.*`` through the
dispatcher, ``at::linear`` / ``at::mm`` for float weights), in the same order, so its output is bit
for bit the module path's; only the interpreter between them is gone.

Two sides decide whether a layer takes it, each about what it owns:

- the model: :func:`pack_linear` says whether each of a layer's linears is one the op knows (float
  ``nn.Linear``, the runner's input-major ``InputMajorLinear``, Q8_0 or low-bit ``QuantLinear``;
  not a LoRA wrapper, not a tensor-parallel shard), and each layer's ``native_layer``
  (``models/llama.py``) whether the layer is a pre-norm SwiGLU one or Gemma's (q/k norms or not;
  no mixture of experts, no latent attention) on the native fused ops;
- the step: the runner's attention function offers ``native_layer_args(layer_idx)``: the layer's
  cache and the step's indices when every row of the step attends through the native paged kernel
  over float32 or 8-bit blocks (not a mixed pool, not the Triton backend), else None.

Where either says no, the layer runs as modules (the reference the tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedkv.models.packed_linear import InputMajorLinear
from pagedkv.models.quant_linear import QuantLinear
from pagedkv.ops import native

FLOAT, INPUT_MAJOR, Q8_0, LOWBIT = range(4)  # a linear's kind, as csrc/decoder_layer.cpp numbers them


def op_available() -> bool:
    """Whether the native kernels are loaded and hold ``decoder_layer`` (an older build does not)."""
    return native.available() and hasattr(torch.ops.pagedkv, "decoder_layer")


def pack_linear(module: nn.Module) -> tuple[int, int, list[torch.Tensor | None]] | None:
    """``(kind, zero, [a, b, c, d, e, bias])`` of a float32 CPU linear the native layer computes as
    its module does (the slots: ``csrc/decoder_layer.cpp``), or None for any other module."""
    bias = module._parameters.get("bias")
    if type(module) is nn.Linear:
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        return FLOAT, 0, [weight, None, None, None, None, bias]
    if type(module) is InputMajorLinear:
        if module.weight_t.dtype != torch.float32 or module.weight_t.device.type != "cpu":
            return None
        return INPUT_MAJOR, 0, [module.weight_t, None, None, None, None, bias]
    if type(module) is QuantLinear:
        b = module._buffers
        qweight = b["qweight"]
        if qweight is None or qweight.device.type != "cpu" or module.native is False:  # (False: the plain path)
            return None
        if module.fmt == "q8_0":
            return Q8_0, 0, [qweight, None, b["scales"], b["offsets"], None, bias]
        assert module._lowbit is not None
        lut, zero = module._lowbit
        return LOWBIT, int(zero), [qweight, b["planes"], b["scales"], b["offsets"], lut, bias]
    return None


@dataclass
class NativeLayer:
    """One layer's weights as the op takes them: two norm weights, four linears (q/k/v, o,
    gate/up, down) of six slots each, the q and k norm weights and Gemma's feed-forward norms
    (or Nones); ``kinds`` the linears' (kind, zero) pairs, then the layer's form."""

    weights: list[torch.Tensor | None]
    kinds: list[int]
    eps: float
    heads: int
    kv_heads: int

    @classmethod
    def pack(cls, norms: tuple[torch.Tensor, torch.Tensor], linears: tuple[nn.Module, ...], eps: float,
             heads: int, kv_heads: int, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
             ff_norms: tuple[torch.Tensor, torch.Tensor] | None = None) -> NativeLayer | None:
        """The layer of these two RMSNorm weights and four linears (and the q and k heads' norm
        weights, qwen3's and Gemma 3's; with ``ff_norms``, Gemma's layer: its feed-forward
        sublayer's pre and post norms, GeGLU), or None where a linear is not one the op knows."""
        weights: list[torch.Tensor | None] = [norms[0], norms[1]]
        kinds: list[int] = []
        for module in linears:
            packed = pack_linear(module)
            if packed is None:
                return None
            kind, zero, slots = packed
            kinds += [kind, zero]
            weights += slots
        weights += qk_norms if qk_norms is not None else (None, None)
        weights += ff_norms if ff_norms is not None else (None, None)
        kinds.append(0 if ff_norms is None else 1)  # the layer's form: Llama's or Gemma's
        if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in (*norms, *(qk_norms or ()),
                                                                               *(ff_norms or ()))):
            return None
        return cls(weights, kinds, eps, heads, kv_heads)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, args: tuple) -> torch.Tensor:
        """The layer's output for the residual stream ``x [T, hidden]``; ``args``: the step's
        ``native_layer_args`` for this layer (the cache, the indices, the attention's scalars)."""
        return torch.ops.pagedkv.decoder_layer.default(x, self.weights, self.kinds, self.eps, self.heads,
                                                       self.kv_heads, cos, sin, *args)
