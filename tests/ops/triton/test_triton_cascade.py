"""The Triton shared-block (cascade) decode kernel (``pagedkv/ops/triton/cascade.py``) against the
plain reference, in Triton's interpreter on CPU tensors (or on the GPU ``PAGEDKV_TEST_DEVICE``
names), over random sharing trees: forks of forks, partly shared runs, block sizes 1, 16, 64,
GQA, sliding windows that leave shared blocks behind, soft-cap, float and 8-bit blocks. Decode
rows only (the Triton path's prefill chunks have a kernel of their own); a row of length 0 must
stay untouched. ``PAGEDKV_CASCADE_FULL_MATRIX=1`` runs every combination.
"""

import itertools
import os

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py sets it too)

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from pagedkv.ops.cascade import find_shared_runs
from pagedkv.ops.reference import reference_paged_attention
from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.cascade import cascade_decode_attention
from pagedkv_testing.sharing_cases import sharing_case
from pagedkv_testing.triton_device import DEVICE

if DEVICE == "cpu" and not interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

FULL = os.environ.get("PAGEDKV_CASCADE_FULL_MATRIX") == "1"  # docs/environment.md
SENTINEL = 7.0
_8BIT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _check(seed, block_size, fmt, heads, kvh, d, window, softcap, num_seqs=4):
    case = sharing_case(seed, block_size, heads, kvh, d, num_seqs=num_seqs, extend=False)
    row_seq, row_len = list(case.row_seq) + [0], list(case.row_len) + [0]  # a row attended elsewhere
    q = torch.cat([case.q, torch.randn(1, heads, d)]) * (3 if softcap else 1)
    plan = find_shared_runs(case.tables, row_seq, row_len, block_size, min_saved_tokens=0)  # every run
    assert plan is not None
    k, v, ks, vs = case.k_cache, case.v_cache, None, None
    if fmt in _8BIT:
        gen = torch.Generator().manual_seed(seed)
        ks = torch.rand(k.shape[0], kvh, generator=gen) * 0.05 + 0.01
        vs = torch.rand(k.shape[0], kvh, generator=gen) * 0.05 + 0.01
        k = (k / ks[:, None, :, None]).clamp(-127, 127)
        v = (v / vs[:, None, :, None]).clamp(-127, 127)
        k, v = (k.round(), v.round()) if fmt == "int8" else (k, v)
        k, v = k.to(_8BIT[fmt]), v.to(_8BIT[fmt])
    elif fmt != "float32":
        k, v = k.to(getattr(torch, fmt)), v.to(getattr(torch, fmt))
    width = max(len(t) for t in case.tables) + 1
    tables = torch.tensor([t + [0] * (width - len(t)) for t in case.tables], dtype=torch.int32)

    def dev(t):
        return None if t is None else t.to(DEVICE)

    out = torch.full_like(q, SENTINEL)
    got = cascade_decode_attention(
        dev(out), dev(q), dev(k), dev(v), dev(tables), dev(torch.tensor(row_seq, dtype=torch.int32)),
        dev(torch.tensor(row_len, dtype=torch.int32)), plan.to(DEVICE), None, sliding_window=window,
        k_scales=dev(ks), v_scales=dev(vs), softcap=softcap).cpu()
    expected = reference_paged_attention(q, k, v, case.tables, row_seq, row_len, sliding_window=window,
                                         k_scales=ks, v_scales=vs, softcap=softcap)
    assert torch.all(got[-1] == SENTINEL), "a row of length 0 was written"
    # the interpreter computes in float32 as the CPU kernels; a GPU's tl.dot on 16-bit caches and
    # TF32 on 8-bit ones round q and p: 5e-3 there (the decode kernel's tests' bound)
    atol = 2e-5 if DEVICE == "cpu" or fmt == "float32" else 5e-3
    err = (got[:-1] - expected[:-1]).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} ({fmt}, block {block_size}, window {window}, cap {softcap})"


SHAPES = [(4, 2, 64), (4, 4, 32), (6, 2, 40)]  # GQA 2, no GQA (group 1), an odd head_dim
FORMATS = ["float32", "bfloat16", "int8", "fp8_e4m3"]
ALL = list(itertools.product(FORMATS, [1, 16, 64], SHAPES, [None, 6], [None, 4.0]))
SLICE = [("float32", 16, SHAPES[0], None, None), ("int8", 1, SHAPES[1], 6, None),
         ("bfloat16", 64, SHAPES[2], None, 4.0), ("fp8_e4m3", 16, SHAPES[0], 6, 4.0)]


@pytest.mark.parametrize("fmt,block_size,shape,window,softcap", ALL if FULL else SLICE)
def test_cascade_decode_equals_reference(fmt, block_size, shape, window, softcap):
    heads, kvh, d = shape
    _check(block_size * 7 + d, block_size, fmt, heads, kvh, d, window, softcap)


def test_no_plan_is_the_decode_kernel():
    case = sharing_case(5, 16, 4, 2, 32, extend=False)
    width = max(len(t) for t in case.tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in case.tables], dtype=torch.int32)
    row_seq = torch.tensor(case.row_seq, dtype=torch.int32)
    row_len = torch.tensor(case.row_len, dtype=torch.int32)
    got = cascade_decode_attention(torch.zeros_like(case.q).to(DEVICE), case.q.to(DEVICE), case.k_cache.to(DEVICE),
                                   case.v_cache.to(DEVICE), tables.to(DEVICE), row_seq.to(DEVICE),
                                   row_len.to(DEVICE), None, None).cpu()
    expected = reference_paged_attention(case.q, case.k_cache, case.v_cache, case.tables, case.row_seq,
                                         case.row_len)
    assert (got - expected).abs().max().item() <= 2e-5
