"""Inference transforms of linear layers: the LM head pre-packed for oneDNN (CPU, float32), and
the wide fused layer projections stored input-major.

At decode batch sizes (7..100 rows) a prepacked oneDNN matmul runs the 49152-wide LM head of
SmolLM2 about 2x faster than ``F.linear`` over MKL, which re-packs the 113 MB weight on every
call; for the (much smaller) layer matmuls the gain is under 10%, not worth a second copy of
every weight. Those instead run from an ``[in, out]`` copy that replaces the checkpoint's
``[out, in]`` weight (``InputMajorLinear``), where MKL is faster for the wide q/k/v and gate/up
projections. The model code is untouched: the transforms swap modules, and ``pack_lm_head`` does
nothing where oneDNN is unavailable or disagrees with ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count still works


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN prepacked linear works here (and matches ``F.linear``)."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=gen)
        b = torch.randn(40, generator=gen)
        x = torch.randn(5, 24, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError):
        return False


def padded_rows(rows: int) -> int:
    """The row bucket for ``rows``: ``rows`` rounded up to three significant bits (1..8, 10, 12,
    14, 16, 20, 24, 28, 32, 40, ...), so at most 25% padding, and 4 buckets per doubling."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # the unpacked tensor (shared, not copied), for inspection only; dropped (None) where
        # nothing else holds it (an untied head): a second copy of the head's weights otherwise
        self.weight: torch.Tensor | None = weight if keep_weight else None
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in_features]
        # oneDNN builds (and caches, up to 1024 entries) one primitive per distinct row count, a few
        # hundred KiB each: a server seeing every batch size from 1 to max_num_seqs would grow by
        # tens of MiB over its first hours. Padding to a few row buckets bounds that at once.
        rows = x.shape[0]
        bucket = padded_rows(rows)
        if bucket != rows:
            x = F.pad(x, (0, 0, 0, bucket - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if bucket == rows else out[:rows]

    def warm_up(self, max_rows: int) -> list[int]:
        """Run every row bucket up to ``padded_rows(max_rows)`` once, so that oneDNN builds their
        primitives now rather than one by one as batch sizes first appear (a server's RSS then
        stays flat from its first requests); returns the buckets run."""
        buckets = sorted({padded_rows(n) for n in range(1, max_rows + 1)})
        with torch.no_grad():
            for rows in buckets:
                self(torch.zeros(rows, self.in_features, dtype=self.packed.dtype))
        return buckets

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_lm_head(model: nn.Module) -> bool:
    """Replace ``model``'s float32 LM head (``lm_head``, or the tied embedding) with a PackedLinear.

    Returns whether the head is packed (False where packing is unavailable). Idempotent. The packed
    copy does not follow later edits of the weight: apply it to a loaded model used for inference.
    """
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear):
        return True
    if head is None:  # tied: the embedding matrix is the head
        # nn.Module's __getattr__ types a submodule as Tensor | Module: the embedding is a Module
        weight, bias = model.embed_tokens.weight, None  # type: ignore[union-attr]
    elif isinstance(head, nn.Linear):
        weight, bias = head.weight, head.bias
    else:
        return False
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or not packing_available():
        return False
    model.lm_head = PackedLinear(weight, bias, keep_weight=head is None)
    return True


class InputMajorLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored transposed, ``[in_features, out_features]`` contiguous.

    For the wide fused projections (q/k/v, gate/up) MKL runs ``x @ W^T`` from this layout faster
    than ``F.linear`` from the checkpoint's ``[out, in]``: measured on this AVX2 machine, one
    thread, SmolLM2's shapes, 20-35% at one row (memory-bound decode), 3-5% at 32..128 rows. The
    weight is moved, not copied; ``weight`` is the ``[out, in]`` view of it, for inspection.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in_features]
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout=[in, out]"


def transpose_wide_linears(model: nn.Module) -> int:
    """Store every layer's fused q/k/v and gate/up weight input-major (``InputMajorLinear``).
    Returns how many were converted; idempotent. Apply it to a loaded model used for inference."""
    converted = 0
    for layer in getattr(model, "layers", ()):
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
            converted += input_major(parent, name)
    return converted


def input_major(parent: nn.Module, name: str) -> bool:
    """Replace ``parent``'s float linear ``name`` with an :class:`InputMajorLinear` (True), or leave
    anything else (a quantized layer; None: a mixture-of-experts layer, models/moe.py) as it is."""
    lin = getattr(parent, name, None)
    if type(lin) is not nn.Linear:
        return False
    setattr(parent, name, InputMajorLinear(lin.weight, lin.bias))
    return True
