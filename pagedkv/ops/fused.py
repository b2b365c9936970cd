"""Fused small per-layer ops of the decoder: RoPE over q and k, SiLU(gate) x up, and the residual
add with the RMSNorm after it (``csrc/fused_ops.cpp``), each with its plain PyTorch form.

Why: at decode batch sizes these ops are microseconds of arithmetic behind several torch
dispatches and temporaries each; over 30 layers that is milliseconds of a batch-1 step. The native
kernels do each in one dispatch and one pass over the rows. They take float32 tensors on the CPU;
every function here takes ``native`` from its caller (the runner turns it on where the native
kernels loaded) and uses the plain form otherwise, for any other dtype or device, or where the
extension lacks the op (an older build), so a caller never needs to check.

The plain forms are written as the textbook formulas (``rotate_half``, ``F.silu(g) * u``,
``F.rms_norm(x + r)``): they are the reference the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedkv.ops import native

_OPS: dict[str, Callable[..., torch.Tensor] | None] = {}


def _op(name: str) -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedkv.<name>``'s handle, or None where the native extension is unavailable or
    lacks it (an older build). Looked up once: ``torch.ops`` attribute access costs microseconds."""
    try:
        return _OPS[name]
    except KeyError:
        handle = getattr(torch.ops.pagedkv, name).default if native.available() and hasattr(
            torch.ops.pagedkv, name) else None
        _OPS[name] = handle
        return handle


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
            native_on: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of the q and k heads of a fused projection's output.

    ``qkv`` ``[T, heads + 2 * kv_heads, d]``; ``cos``, ``sin`` ``[T, 1, rd]`` (``rd <= d``: partial
    rotary leaves dims ``rd..`` as they are). Returns q ``[T, heads, d]`` (a new contiguous tensor)
    and k ``[T, kv_heads, d]``. The native kernel rotates k in place inside ``qkv`` and returns a
    view of it; the plain form returns new tensors and leaves ``qkv`` as it was.
    """
    if (native_on and qkv.dtype == torch.float32 and cos.dtype == torch.float32 and qkv.device.type == "cpu"
            and qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2] and cos.is_contiguous()
            and sin.is_contiguous()):
        op = _op("rope_qk")
        if op is not None:
            return op(qkv, cos, sin, heads, kv_heads), qkv[:, heads:heads + kv_heads]
    return (plain_rope(qkv[:, :heads], cos, sin).contiguous(),
            plain_rope(qkv[:, heads:heads + kv_heads], cos, sin))


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the first ``cos.shape[-1]`` dims of each head of
    ``x`` ``[T, heads, d]`` (the rest pass through); a new tensor."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def silu_mul(gate_up: torch.Tensor, native_on: bool) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]`` of ``gate_up`` ``[T, 2 * I]`` (gate first)."""
    if native_on and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and gate_up.is_contiguous():
        op = _op("silu_mul")
        if op is not None:
            return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 native_on: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add that closes a sublayer and the RMSNorm that opens the next.

    ``x``, ``residual`` ``[T, hidden]``; returns ``(normed, x + residual)``. The sum is written into
    ``x`` in place (native and plain alike: pass a fresh sublayer output), so no second
    ``[T, hidden]`` tensor is made for it.
    """
    if (native_on and x.dtype == residual.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
        op = _op("add_rms_norm")
        if op is not None:
            return op(x, residual, weight, eps), x
    summed = x.add_(residual)
    return F.rms_norm(summed, weight.shape, weight, eps), summed
