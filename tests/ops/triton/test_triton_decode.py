"""The Triton paged decode kernel (``pagedkv/ops/triton/decode.py``) against a plain PyTorch
reference, in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before triton is
imported), or on the GPU ``PAGEDKV_TEST_DEVICE`` names (``pagedkv_testing/triton_device.py``;
``scripts/gpu_check.sh``): inputs are made on that device, the reference runs on the CPU.

Every case has ragged rows (1, 5, 17, 33, 203 tokens), several rows of one sequence, a
``row_len == 0`` row whose ``out`` row must stay untouched, a shuffled block table (physical
blocks in random order, spare blocks full of noise) and a padded table column. The reference
gathers each row's tokens through the table in float64, dequantizes 8-bit caches with their
scales, repeats KV heads for GQA and applies the soft-cap and the sliding window.
"""

import os

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py sets it too)

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.decode import (
    MAX_SPLITS,
    _paged_decode,
    default_num_splits,
    paged_decode_attention,
)
from pagedkv_testing.triton_device import DEVICE  # cpu: the interpreter; PAGEDKV_TEST_DEVICE on a GPU

if DEVICE == "cpu" and not interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

SENTINEL = 7.0
# (sequence, row_len) per row: rows of one sequence, a skipped row, a long and short rows
ROWS = [(0, 203), (1, 33), (2, 5), (2, 1), (0, 0), (1, 17)]
KV_HEADS = 2
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def make_case(block_size=16, group=2, head_dim=64, cache_dtype=torch.float32, q_dtype=torch.float32,
              rows=ROWS, kv_heads=KV_HEADS, seed=0, q_gain=1.0):
    """Inputs of one call: caches (random everywhere, so a wrong block shows), scales for 8-bit
    caches, shuffled block tables with one padding column, and ``out`` filled with SENTINEL."""
    g = torch.Generator().manual_seed(seed)
    seqs = 1 + max(s for s, _ in rows)
    seq_len = [max([n for s, n in rows if s == i], default=0) for i in range(seqs)]
    need = [-(-n // block_size) for n in seq_len]
    num_blocks = sum(need) + 3  # spare blocks: never referenced
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1
    tables, used = [], 0
    for k in need:
        tables.append(perm[used:used + k] + [0] * (width - k))
        used += k
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_scales = v_scales = None
    if cache_dtype == torch.int8:
        k_cache = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v_cache = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        k_scales = 0.002 + 0.02 * torch.rand(num_blocks, kv_heads, generator=g)
        v_scales = 0.002 + 0.02 * torch.rand(num_blocks, kv_heads, generator=g)
    elif cache_dtype in FP8.values():
        k_cache = (torch.randn(shape, generator=g) * 8).to(cache_dtype)
        v_cache = (torch.randn(shape, generator=g) * 8).to(cache_dtype)
        k_scales = 0.02 + 0.2 * torch.rand(num_blocks, kv_heads, generator=g)
        v_scales = 0.02 + 0.2 * torch.rand(num_blocks, kv_heads, generator=g)
    else:
        k_cache = torch.randn(shape, generator=g).to(cache_dtype)
        v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    heads = kv_heads * group
    q = (torch.randn(len(rows), heads, head_dim, generator=g) * q_gain).to(q_dtype)
    case = dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        row_seq=torch.tensor([s for s, _ in rows], dtype=torch.int32),
        row_len=torch.tensor([n for _, n in rows], dtype=torch.int32),
        k_scales=k_scales, v_scales=v_scales,
    )
    case = {k: (v.to(DEVICE) if v is not None else None) for k, v in case.items()}
    case["out"] = torch.full(q.shape, SENTINEL, dtype=q_dtype, device=DEVICE)
    return case


def reference(q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales=None, v_scales=None, scale=None,
              sliding_window=None, softcap=None, **_):
    """Plain PyTorch (float64) decode attention; rows with row_len 0 are NaN (not compared)."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    block_tables, row_seq, row_len = block_tables.cpu().long(), row_seq.cpu().long(), row_len.cpu().long()
    rows, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    scale = d ** -0.5 if scale is None else scale
    out = torch.full((rows, heads, d), float("nan"), dtype=torch.float64)
    for r in range(rows):
        n = int(row_len[r])
        if n == 0:
            continue
        lo = max(0, n - sliding_window) if sliding_window else 0
        pos = torch.arange(lo, n)
        blocks = block_tables[row_seq[r], pos // block_size]
        k = k_cache[blocks, pos % block_size].double()  # [L, kv_heads, d]
        v = v_cache[blocks, pos % block_size].double()
        if k_scales is not None:
            k = k * k_scales.cpu()[blocks].double()[:, :, None]
            v = v * v_scales.cpu()[blocks].double()[:, :, None]
        k = k.repeat_interleave(group, dim=1)  # [L, heads, d]: query head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[r].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[r] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)
    return out


def run(case, num_splits=None, **kw):
    """The kernel on a copy of the case's ``out``; returns it."""
    c = dict(case)
    c["out"] = case["out"].clone()
    args = {k: c.pop(k) for k in ("out", "q", "k_cache", "v_cache", "block_tables", "row_seq", "row_len")}
    scale = kw.pop("scale", None)
    if kw.keys() & {"use_dot", "block_n"}:
        return _paged_decode(*args.values(), scale, num_splits=num_splits, k_scales=c["k_scales"],
                             v_scales=c["v_scales"], **kw)
    return paged_decode_attention(*args.values(), scale, num_splits=num_splits, k_scales=c["k_scales"],
                                  v_scales=c["v_scales"], **kw)


def check(out, case, ref, rtol, atol):
    """Live rows match ``ref``; skipped rows still hold SENTINEL."""
    live = case["row_len"].cpu() > 0
    torch.testing.assert_close(out.cpu()[live].double(), ref[live], rtol=rtol, atol=atol)
    assert (out.cpu()[~live] == SENTINEL).all(), "a row_len 0 row was written"


def tol(kind):
    """(rtol, atol) per cache kind; on a GPU the tensor-core dots round their inputs."""
    if kind == "float32" or interpreting():
        return {"float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}.get(kind, (1e-4, 1e-5))
    # 8-bit: TF32 dots (q and p rounded to 10 mantissa bits), well inside the formats' own error
    return {"float32": (1e-4, 1e-5), "float16": (5e-3, 5e-3), "bfloat16": (3e-2, 3e-2)}.get(kind, (1e-2, 1e-2))


# every block size with every GQA ratio; each block size and ratio sees both head dims
@pytest.mark.parametrize("block_size,group,head_dim", [
    (1, 1, 16), (1, 2, 64), (1, 4, 16),
    (4, 1, 64), (4, 2, 16), (4, 4, 64),
    (16, 1, 16), (16, 2, 64), (16, 4, 16),
    (64, 1, 64), (64, 2, 16), (64, 4, 64),
])
def test_float32_one_and_several_splits(block_size, group, head_dim):
    case = make_case(block_size, group, head_dim, seed=block_size * 10 + group)
    ref = reference(**case)
    one = run(case, num_splits=1)
    several = run(case, num_splits=5)  # 203 tokens = 4 tiles of 64: split 4 (and most of row 33's) empty
    check(one, case, ref, *tol("float32"))
    check(several, case, ref, *tol("float32"))
    live = case["row_len"] > 0
    torch.testing.assert_close(one[live], several[live], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype,q_dtype,kind", [
    (torch.float16, torch.float16, "float16"),
    (torch.float16, torch.float32, "float16"),  # the native path's layout: float32 q and out
    (torch.bfloat16, torch.bfloat16, "bfloat16"),
])
def test_half_caches(cache_dtype, q_dtype, kind):
    case = make_case(16, 2, 64, cache_dtype=cache_dtype, q_dtype=q_dtype, seed=3)
    ref = reference(**case)
    check(run(case, num_splits=3), case, ref, *tol(kind))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size,group", [(16, 2), (4, 1)])
def test_8bit_caches_with_scales(kind, block_size, group):
    dtype = torch.int8 if kind == "int8" else FP8[kind]
    case = make_case(block_size, group, 64, cache_dtype=dtype, seed=4)
    ref = reference(**case)
    check(run(case, num_splits=2), case, ref, *tol(kind))


def test_8bit_scales_matter():
    """The scales are per (block, KV head): a wrong one changes the answer."""
    case = make_case(16, 2, 16, cache_dtype=torch.int8, seed=5)
    base = run(case, num_splits=1)
    blk = int(case["block_tables"][1, 1])  # holds tokens 16..31 of sequence 1 (rows of 33 and 17 tokens)
    case["v_scales"] = case["v_scales"].clone()
    case["v_scales"][blk, 1] *= 3
    changed = run(case, num_splits=1)
    check(changed, case, reference(**case), *tol("int8"))
    diff = (changed - base).abs().amax(dim=-1)  # [rows, heads]
    assert diff[1, 2:].min() > 0 and diff[1, :2].max() == 0  # row of 33 tokens: heads of KV head 1 only
    assert diff[0].max() == 0 and diff[2].max() == 0  # other sequences untouched


@pytest.mark.parametrize("block_size,window,num_splits", [(4, 50, 3), (16, 1, 1), (16, 37, 4), (64, 200, 2)])
def test_sliding_window(block_size, window, num_splits):
    case = make_case(block_size, 2, 16, seed=6)
    ref = reference(**case, sliding_window=window)
    check(run(case, num_splits=num_splits, sliding_window=window), case, ref, *tol("float32"))


@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3)])
def test_softcap(group, num_splits):
    case = make_case(16, group, 64, seed=7, q_gain=8.0)  # scores of tens: the cap bites
    ref = reference(**case, softcap=5.0)
    assert not torch.allclose(ref[0], reference(**case)[0], atol=1e-2)
    check(run(case, num_splits=num_splits, softcap=5.0), case, ref, *tol("float32"))


def test_gemma_style_softcap_window_int8_custom_scale():
    case = make_case(4, 2, 64, cache_dtype=torch.int8, seed=8, q_gain=4.0)
    kw = dict(softcap=10.0, sliding_window=24, scale=0.3)
    ref = reference(**case, **kw)
    check(run(case, num_splits=4, **kw), case, ref, *tol("int8"))


@pytest.mark.parametrize("group", [1, 2])
def test_dot_and_broadcast_paths_and_tile_sizes_agree(group):
    case = make_case(16, group, 64, seed=9)
    ref = reference(**case)
    outs = [run(case, num_splits=s, use_dot=dot, block_n=bn)
            for dot, bn, s in [(True, 64, 1), (False, 64, 2), (True, 16, 3), (False, 128, 1)]]
    live = case["row_len"] > 0
    for out in outs:
        check(out, case, ref, *tol("float32"))
        torch.testing.assert_close(out[live], outs[0][live], rtol=1e-5, atol=1e-6)


def test_odd_block_size_head_dim_group_and_strided_tensors():
    """block_size 5, head_dim 24, 3 query heads per KV head; q and out are strided views."""
    case = make_case(5, 3, 24, seed=10)
    ref = reference(**case)
    rows, heads, d = case["q"].shape
    wide_q = torch.zeros(rows, heads, 2 * d, device=DEVICE)
    wide_q[:, :, d:] = case["q"]
    wide_out = torch.full((heads, rows, d), SENTINEL, device=DEVICE)
    q, out = wide_q[:, :, d:], wide_out.transpose(0, 1)
    paged_decode_attention(out, q, case["k_cache"], case["v_cache"], case["block_tables"], case["row_seq"],
                           case["row_len"], None, num_splits=2)
    check(out, case, ref, *tol("float32"))


def test_all_rows_skipped_and_no_rows():
    case = make_case(16, 2, 16, rows=[(0, 0), (1, 0)], seed=11)
    case["block_tables"] = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    out = run(case, num_splits=2)
    assert (out == SENTINEL).all()
    empty = torch.empty(0, 4, 16, device=DEVICE)
    none = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert paged_decode_attention(empty, empty, case["k_cache"], case["v_cache"], case["block_tables"], none,
                                  none, None) is empty


def test_default_num_splits():
    assert default_num_splits(0) == 1
    assert default_num_splits(1) == 1
    assert default_num_splits(256) == 1
    assert default_num_splits(257) == 2
    assert default_num_splits(1000) == 4
    assert default_num_splits(10 ** 6) == MAX_SPLITS


def test_default_splits_match_explicit():
    case = make_case(16, 2, 16, rows=[(0, 600), (1, 40), (0, 300)], seed=12)
    ref = reference(**case)
    default = run(case)  # 600 tokens: 3 splits
    check(default, case, ref, *tol("float32"))
    torch.testing.assert_close(default, run(case, num_splits=3), rtol=0, atol=0)


def test_rejects_what_it_does_not_take():
    case = make_case(16, 2, 16, cache_dtype=torch.int8, rows=[(0, 3)])
    base = {k: case[k] for k in ("out", "q", "k_cache", "v_cache", "block_tables", "row_seq", "row_len")}

    def call(**over):
        a = {k: over.get(k, v) for k, v in base.items()}
        scales = {k: over.get(k, case[k]) for k in ("k_scales", "v_scales")}
        paged_decode_attention(*a.values(), None, num_splits=over.get("num_splits"), **scales)

    with pytest.raises(ValueError, match="k_scales"):
        call(k_scales=None)
    with pytest.raises(ValueError, match="v_scales"):
        call(v_scales=case["v_scales"][:-1])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        call(q=case["q"][:, :3], out=case["out"][:, :3])
    with pytest.raises(ValueError, match="head_dim"):
        call(q=case["q"][..., :8], out=case["out"][..., :8])
    with pytest.raises(ValueError, match="block_tables"):
        call(block_tables=case["block_tables"].long())
    with pytest.raises(ValueError, match="row_len"):
        call(row_len=case["row_len"].long())
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="cache dtype"):
        call(k_cache=case["k_cache"].to(torch.int16), v_cache=case["v_cache"].to(torch.int16))
