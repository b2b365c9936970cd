"""The Triton MLA latent kernel (``pagedkv/ops/triton/latent.py``) against a plain PyTorch
reference, in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``), or on the GPU
``PAGEDKV_TEST_DEVICE`` names (``pagedkv_testing/triton_device.py``).

Every case has ragged rows (decode-like and prefill-like lengths, rows of one sequence), a
``row_len == 0`` row whose ``out`` row must stay untouched, ``out``'s RoPE dims untouched, and a
shuffled block table with spare blocks full of noise. The reference gathers each row's latent rows
through the table in float64 (8-bit ones times their block's scale): keys the whole row, values
its first ``rank`` dims.
"""

import os

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py sets it too)

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.latent import latent_attention
from pagedkv_testing.triton_device import DEVICE

if DEVICE == "cpu" and not interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

SENTINEL = 7.0
ROWS = [(0, 70), (1, 33), (1, 34), (2, 5), (0, 0), (2, 1)]  # (sequence, row_len)


def _case(rank: int, rope: int, heads: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = 1 + max(s for s, _ in ROWS)
    need = [-(-max([n for s, n in ROWS if s == i], default=0) // block_size) for i in range(seqs)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width, used, tables = max(need) + 1, 0, []
    for k in need:
        tables.append(perm[used:used + k] + [0] * (width - k))
        used += k
    shape = (num_blocks, block_size, 1, rank + rope)
    scales = None
    if dtype == torch.int8:
        cache = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scales = 0.002 + 0.02 * torch.rand(num_blocks, 1, generator=g)
    elif dtype == torch.float8_e4m3fn:
        cache = (torch.randn(shape, generator=g) * 8).to(dtype)
        scales = 0.02 + 0.2 * torch.rand(num_blocks, 1, generator=g)
    else:
        cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(ROWS), heads, rank + rope, generator=g)
    return q, cache, scales, torch.tensor(tables, dtype=torch.int32)


def _reference(q, cache, scales, tables, rank, scale):
    out = torch.full((q.shape[0], q.shape[1], rank), SENTINEL, dtype=torch.float64)
    values = cache.to(torch.float64)
    if scales is not None:
        values = values * scales.to(torch.float64)[:, :, None, None]
    bs = cache.shape[1]
    for r, (s, n) in enumerate(ROWS):
        if n == 0:
            continue
        rows = torch.stack([values[int(tables[s, t // bs]), t % bs, 0] for t in range(n)])  # [n, d]
        p = torch.softmax(q[r].to(torch.float64) @ rows.T * scale, dim=-1)
        out[r] = p @ rows[:, :rank]
    return out


@pytest.mark.parametrize("rank,rope,heads,block_size,dtype", [
    (512, 64, 16, 16, torch.float32),   # DeepSeek-V3's latent, one head block
    (24, 8, 20, 1, torch.float32),      # odd rank, heads past one block of 16, block size 1
    (48, 16, 5, 64, torch.bfloat16),
    (64, 32, 8, 16, torch.int8),
    (32, 16, 3, 4, torch.float8_e4m3fn),
], ids=["v3_f32", "odd_bs1", "bf16_bs64", "int8", "fp8"])
def test_latent_attention_matches_the_reference(rank: int, rope: int, heads: int, block_size: int,
                                                dtype: torch.dtype) -> None:
    q, cache, scales, tables = _case(rank, rope, heads, block_size, dtype)
    scale = (rank + rope) ** -0.5 * 0.7
    want = _reference(q, cache, scales, tables, rank, scale)
    out = torch.full((q.shape[0], heads, rank + rope), SENTINEL, device=DEVICE)
    latent_attention(out, q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE),
                     torch.tensor([s for s, _ in ROWS], dtype=torch.int32, device=DEVICE),
                     torch.tensor([n for _, n in ROWS], dtype=torch.int32, device=DEVICE), scale, rank,
                     None if scales is None else scales.to(DEVICE))
    out = out.cpu()
    tol = 2e-2 if dtype == torch.bfloat16 and DEVICE != "cpu" else 1e-4
    torch.testing.assert_close(out[..., :rank].double(), want, atol=tol, rtol=tol)
    assert torch.all(out[..., rank:] == SENTINEL)  # the RoPE dims: never written


def test_bad_shapes_are_refused_by_name() -> None:
    q, cache, _, tables = _case(16, 16, 2, 4, torch.float32)
    seq, lens = torch.zeros(len(ROWS), dtype=torch.int32), torch.ones(len(ROWS), dtype=torch.int32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="one latent head"):
        latent_attention(out, q, cache.expand(-1, -1, 2, -1), tables, seq, lens, 1.0, 16)
    with pytest.raises(ValueError, match="rank must be in 1..32"):
        latent_attention(out, q, cache, tables, seq, lens, 1.0, 40)
    with pytest.raises(ValueError, match="scales"):
        latent_attention(out, q, cache.to(torch.int8), tables, seq, lens, 1.0, 16)
