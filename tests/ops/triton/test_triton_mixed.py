"""The Triton decode and prefill kernels over a mixed pool (``runner/kv_cache.py``): full-precision
blocks (ids below ``base``) beside 8-bit ones (ids from ``base``, with their scales) in one block
table, each block read in its own format, against the plain reference
(``ops/reference.py: reference_paged_attention(..., k_quant=, v_quant=, base=)``).

Run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before triton is imported),
or on the GPU ``PAGEDKV_TEST_DEVICE`` names. By default a slice in which every float format, every
8-bit format, block sizes 1 / 16 / 64 and GQA ratios 1 / 3 / 4 each appear;
``PAGEDKV_KV_FORMAT_FULL_MATRIX=1`` runs every float x 8-bit format and every block size x GQA shape.
"""

import os

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py sets it too)

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from pagedkv.ops.paged_attention import QuantBlocks
from pagedkv.ops.reference import reference_paged_attention
from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.decode import paged_decode_attention
from pagedkv.ops.triton.prefill import paged_prefill_attention
from pagedkv_testing.paged_cases import mixed_case
from pagedkv_testing.triton_device import DEVICE

if DEVICE == "cpu" and not interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
FULL = os.environ.get("PAGEDKV_KV_FORMAT_FULL_MATRIX") == "1"  # docs/environment.md
FORMATS = ([(f, k) for f in FLOATS for k in KINDS] if FULL
           else [(torch.float32, "int8"), (torch.bfloat16, "fp8_e4m3"), (torch.float16, "fp8_e5m2")])
SHAPES = [(4, 4), (6, 2), (4, 1)]  # (heads, kv_heads): MHA, GQA 3, GQA 4
LAYOUTS = ([(b, h, k) for b in (1, 16, 64) for h, k in SHAPES] if FULL
           else [(b, *SHAPES[i]) for i, b in enumerate((1, 16, 64))])
SENTINEL = 7.0


def _on_device(case):
    q, kc, vc, quant, tables, row_seq, row_len = case
    quant = QuantBlocks(*(t.to(DEVICE) for t in (quant.k_quant, quant.v_quant, quant.k_scales, quant.v_scales)),
                        quant.base, quant.k_base)
    return q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), quant


def _expected(case, **kw):
    q, kc, vc, quant, tables, row_seq, row_len = case
    return reference_paged_attention(q, kc, vc, tables, row_seq, row_len, k_scales=quant.k_scales,
                                     v_scales=quant.v_scales, k_quant=quant.k_quant, v_quant=quant.v_quant,
                                     base=quant.base, k_base=quant.k_base, **kw)


def _table_tensor(tables):
    width = max(len(t) for t in tables) + 1  # a padding column
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


def check_decode(case, num_splits=None, **kw):
    """Every row of ``case`` as a decode row (plus a row_len 0 row left untouched)."""
    q, kc, vc, quant = _on_device(case)
    _, _, _, _, tables, row_seq, row_len = case
    out = torch.full((q.shape[0] + 1, *q.shape[1:]), SENTINEL, device=DEVICE)
    qq = torch.cat([q, q[:1]])
    paged_decode_attention(out, qq, kc, vc, _table_tensor(tables),
                           torch.tensor(row_seq + [0], dtype=torch.int32, device=DEVICE),
                           torch.tensor(row_len + [0], dtype=torch.int32, device=DEVICE), kw.pop("scale", None),
                           num_splits=num_splits, quant=quant, **kw)
    torch.testing.assert_close(out[:-1].cpu(), _expected(case, **kw), atol=1e-4, rtol=1e-4)
    assert (out[-1] == SENTINEL).all(), "a row_len 0 row was written"


def check_prefill(case, lens, new, **kw):
    """Each sequence's new rows as one prefill chunk over its cached prefix."""
    q, kc, vc, quant = _on_device(case)
    tables = case[4]
    starts = [sum(new[:i]) for i in range(len(new))]
    out = torch.full(q.shape, SENTINEL, device=DEVICE)
    scale = q.shape[-1] ** -0.5

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    paged_prefill_attention(out, q, kc, vc, _table_tensor(tables), ints(list(range(len(new)))), ints(starts),
                            ints(new), ints([n - m for n, m in zip(lens, new)]), scale, quant=quant, **kw)
    torch.testing.assert_close(out.cpu(), _expected(case, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("full_dtype,kind", FORMATS)
def test_decode_every_float_and_8bit_format_in_one_table(full_dtype, kind):
    lens, new = [1, 37, 90], [1, 1, 3]
    check_decode(mixed_case(kind, full_dtype, len(kind), 16, 4, 2, 64, lens, new), num_splits=2)


@pytest.mark.parametrize("block_size,heads,kvh", LAYOUTS)
def test_decode_block_sizes_and_gqa(block_size, heads, kvh):
    lens, new = [2, 40, 130], [1, 2, 1]
    check_decode(mixed_case("int8", torch.float32, block_size + heads, block_size, heads, kvh, 32, lens, new))


def test_decode_window_softcap_and_odd_shapes():
    case = mixed_case("fp8_e4m3", torch.bfloat16, 7, 3, 6, 2, 24, [70, 20], [1, 2])
    check_decode(case, num_splits=3, sliding_window=17)
    q, *rest = case
    check_decode((q * 4, *rest), softcap=2.0)


@pytest.mark.parametrize("full_dtype,kind", FORMATS)
def test_prefill_every_float_and_8bit_format_in_one_table(full_dtype, kind):
    lens, new = [20, 70], [20, 9]
    check_prefill(mixed_case(kind, full_dtype, 3 + len(kind), 16, 4, 2, 32, lens, new), lens, new)


@pytest.mark.parametrize("block_size,heads,kvh", LAYOUTS)
def test_prefill_block_sizes_and_gqa(block_size, heads, kvh):
    lens, new = [9, 75], [9, 6]
    check_prefill(mixed_case("int8", torch.float32, block_size * 3 + heads, block_size, heads, kvh, 16, lens, new),
                  lens, new)


def test_prefill_window_and_softcap():
    lens, new = [40, 66], [7, 12]
    case = mixed_case("fp8_e5m2", torch.float16, 11, 4, 4, 2, 16, lens, new)
    check_prefill(case, lens, new, sliding_window=9)
    q, *rest = case
    check_prefill((q * 4, *rest), lens, new, softcap=2.0)


@pytest.mark.parametrize("parts", [pytest.param("v", marks=pytest.mark.slow), "three"])  # ~5 s each
def test_k_at_full_precision_beside_8bit_v(parts):
    """K and V with a base each (``kv_quant_parts`` "v": every K full precision; "three": full,
    K-full/V-8-bit and 8-bit blocks in one table): decode and prefill."""
    lens, new = [20, 70], [1, 9]
    check_decode(mixed_case("int8", torch.float32, 13, 16, 6, 2, 32, lens, new, parts), num_splits=2)
    check_prefill(mixed_case("fp8_e4m3", torch.bfloat16, 14, 4, 4, 2, 16, lens, new, parts), lens, new)


def test_the_format_is_read_per_block():
    """The same tokens through full-precision ids and through 8-bit ids (the float blocks set to the
    8-bit blocks' dequantized values): both give the float attention of those values."""
    q, kc, vc, quant, _, _, _ = mixed_case("int8", torch.float32, 5, 4, 4, 2, 32, [40], [1])
    full_ids = list(range(min(3, quant.base)))
    n = 4 * len(full_ids)
    for cache, stored, scales in ((kc, quant.k_quant, quant.k_scales), (vc, quant.v_quant, quant.v_scales)):
        cache[full_ids] = stored[full_ids].float() * scales[full_ids][:, None, :, None]
    float_case = (q[:1], kc, vc, quant, [full_ids], [0], [n])
    quant_case = (q[:1], kc, vc, quant, [[quant.base + i for i in full_ids]], [0], [n])
    check_decode(float_case)
    check_decode(quant_case)
    exact = reference_paged_attention(q[:1], kc, vc, [full_ids], [0], [n])
    torch.testing.assert_close(_expected(quant_case), exact, atol=1e-5, rtol=1e-5)


def test_refuses_a_wrong_split():
    q, kc, vc, quant = _on_device(mixed_case("int8", torch.float32, 1, 16, 4, 2, 32, [20], [1]))
    tables = _table_tensor([[0, quant.base]])
    ints = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    wrong = QuantBlocks(quant.k_quant, quant.v_quant, quant.k_scales, quant.v_scales, quant.base + 1)
    with pytest.raises(ValueError, match="base"):
        paged_decode_attention(out, q, kc, vc, tables, ints, lens, None, quant=wrong)
    with pytest.raises(ValueError, match="8-bit"):
        paged_decode_attention(out, q, kc, vc, tables, ints, lens, None,
                               quant=QuantBlocks(kc, vc, quant.k_scales, quant.v_scales, quant.base))
