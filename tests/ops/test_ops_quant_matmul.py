"""The Q8_0 linear kernel (``torch.ops.pagedkv.q8_0_linear``) against plain PyTorch on the
dequantized weights: both paths (a few rows streamed, many rows through BLAS tiles), odd shapes,
with and without per-block offsets (Q4_1-like weights: q in 0..15, offset about -8 scales)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0: int8 values and one scale per 32 along each row (scales as fp16, like the file)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, blocks / d[..., None], torch.zeros_like(blocks))
    return q.round().clamp(-127, 127).to(torch.int8).view(n, k).contiguous(), d.contiguous()


def _q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 as the kernel takes it: q in 0..15, scale (max - min) / 15 and offset min per 32."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    lo, hi = blocks.amin(-1).half().float(), blocks.amax(-1)
    d = ((hi - lo) / 15).half().float()
    q = torch.where(d[..., None] > 0, (blocks - lo[..., None]) / d[..., None], torch.zeros_like(blocks))
    return q.round().clamp(0, 15).to(torch.int8).view(n, k).contiguous(), d.contiguous(), lo.contiguous()


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17, 32, 33, 40])
@pytest.mark.parametrize("n,k", [(7, 32), (96, 64), (300, 576), (1, 128), (20, 1536)])
def test_matches_plain_pytorch_on_the_dequantized_weights(m: int, n: int, k: int, offsets: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    w[0, :32] = 0.0  # an all-zero block: scale 0
    q, d, o = _q4_1(w) if offsets else (*_q8_0(w), None)
    x = torch.randn(m, k, generator=gen)
    out = torch.full((m, n), float("nan"))
    torch.ops.pagedkv.q8_0_linear(out, x, q, d, o)
    dequantized = q.float().view(n, k // 32, 32) * d[..., None] + (0 if o is None else o[..., None])
    torch.testing.assert_close(out, x @ dequantized.view(n, k).t(), atol=1e-4, rtol=1e-5)


def test_bad_shapes_are_refused() -> None:
    q, d = _q8_0(torch.randn(8, 64))
    out = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pagedkv.q8_0_linear(torch.empty(2, 8), torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8),
                                      torch.ones(8, 1))
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.pagedkv.q8_0_linear(out, torch.randn(2, 64), q, d[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="out"):
        torch.ops.pagedkv.q8_0_linear(torch.empty(2, 9), torch.randn(2, 64), q, d)
    with pytest.raises(RuntimeError, match="offsets"):
        torch.ops.pagedkv.q8_0_linear(out, torch.randn(2, 64), q, d, d[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="offsets"):
        torch.ops.pagedkv.q8_0_linear(out, torch.randn(2, 64), q, d, d.double())
