"""The Triton cache kernels (``pagedkv/ops/triton/cache_ops.py``) against the CPU functions.

Run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before triton is
imported), or on the GPU ``PAGEDKV_TEST_DEVICE`` names (``scripts/gpu_check.sh`` sets ``cuda``): the
kernels then get tensors on that device, the references stay on the CPU.

- ``write_kv``: float32 / float16 / bfloat16 caches equal ``index_copy_`` of the cast values bit
  for bit; a slot < 0 skips its token.
- ``write_kv_scaled``: the stored bytes and scales equal, bit for bit, a plain-PyTorch statement of
  the rule written here (:func:`ref_write_kv_scaled`) and, when the native build is present, the
  C++ op of ``csrc/paged_attention.cpp``; the error sums agree to float64 rounding (summed in
  another order). Runs at offset 0 and mid-block, scales that grow (requantizing earlier rows) or
  not, several blocks and several runs into one block per call, NaN / inf inputs, every fp8 byte
  decoded, fp8 rounding (ties, subnormals) against torch's casts.
- ``copy_blocks``: equals the plain-PyTorch copy, chains and swaps included (every source read
  before any destination is written), scales carried, repeated destinations refused.
"""

from __future__ import annotations

import os

DEV = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")  # as pagedkv_testing/triton_device.py
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py sets it too)

import numpy as np  # noqa: E402 - after TRITON_INTERPRET is set: triton reads it when it is imported
import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed")

import torch  # noqa: E402 - after importorskip found triton

from pagedkv.ops import cache_ops as torch_ops  # noqa: E402 - as torch above
from pagedkv.ops import native  # noqa: E402
from pagedkv.ops.triton import cache_ops as tri  # noqa: E402
from pagedkv.ops.triton import usable_on  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not usable_on(torch.device(DEV).type) or (DEV != "cpu" and not torch.cuda.is_available()),
                       reason=f"Triton kernels cannot run on {DEV} here (CPU tensors need TRITON_INTERPRET=1 "
                              "set before triton is imported)"),
    # the interpreter's numpy warns on inf * x and inf - inf, which the NaN / inf cases do on purpose
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

SCALED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MAX = float(np.finfo(np.float32).max)
NAN, INF = float("nan"), float("inf")


def _native() -> bool:
    return native.available()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str, any_nan: bool = False) -> None:
    """Bitwise equality; with ``any_nan`` a NaN matches any NaN (torch's own float32 -> bfloat16
    gives 0xFFFF in its vectorized loop and 0x7FC0 in its scalar one)."""
    ba, bb = _bytes(a), _bytes(b)
    if any_nan:
        na, nb = torch.isnan(a.detach().cpu().float()), torch.isnan(b.detach().cpu().float())
        assert torch.equal(na, nb), f"{what}: NaNs at other places"
        ba, bb = torch.where(na, 0, ba), torch.where(nb, 0, bb)
    if not torch.equal(ba, bb):
        where = (ba != bb).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((ba != bb).sum())} elements differ, first at {where}: "
                             f"{[ba[tuple(i)].item() for i in where]} vs {[bb[tuple(i)].item() for i in where]}")


# ------------------------------------------------------------------------------------------------
# The plain-PyTorch statement of the scaled write (the C++ loop, scalar math in numpy float32)
# ------------------------------------------------------------------------------------------------


def _q(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturate to ±qmax (NaN stays NaN, as std::clamp), then round to nearest even."""
    qmax = QMAX[dtype]
    y = torch.where(y > qmax, torch.full_like(y, qmax), torch.where(y < -qmax, torch.full_like(y, -qmax), y))
    if dtype == torch.int8:  # std::nearbyint; NaN -> 0 (what the C++ build stores)
        return torch.where(torch.isnan(y), torch.zeros_like(y), torch.round(y)).to(torch.int8)
    return y.to(dtype)


def ref_write_kv_scaled(cache, scales, x, slot_mapping, error) -> None:
    """The rule of ``write_kv_scaled_impl`` in ``csrc/paged_attention.cpp``, token runs in a Python
    loop (tokens with a slot < 0 dropped first)."""
    dtype, qmax = cache.dtype, np.float32(QMAX[cache.dtype])
    keep = slot_mapping >= 0
    x, slots = x.float()[keep], slot_mapping[keep].tolist()
    bs, kvh = cache.shape[1], cache.shape[2]
    i, T = 0, len(slots)
    while i < T:
        b = slots[i] // bs
        j = i + 1
        while j < T and slots[j] // bs == b and slots[j] == slots[j - 1] + 1:
            j += 1
        first = slots[i] % bs
        for h in range(kvh):
            xs = x[i:j, h]
            a = xs.abs()
            amax = np.float32(torch.where(torch.isnan(a), torch.zeros_like(a), a).max().item())
            need = np.float32(min(amax, np.float32(FLT_MAX))) / qmax
            s = np.float32(scales[b, h].item())
            if first == 0:
                s = need
            elif need > s:
                ratio = s / need
                old = cache[b, :first, h].float()
                cache[b, :first, h] = _q(old * torch.tensor(ratio), dtype)
                s = need
            scales[b, h] = torch.tensor(s)
            inv = np.float32(1) / s if s > 0 else np.float32(0)
            v = _q(xs * torch.tensor(inv), dtype)
            cache[b, first:first + (j - i), h] = v
            diff = (v.float() * torch.tensor(s)).double() - xs.double()
            fin = torch.isfinite(diff)
            error[0] += (diff[fin] ** 2).sum()
            error[1] += (xs.double()[fin] ** 2).sum()
        i = j


class Three:
    """One cache written by the Triton kernel, the plain-PyTorch reference and (when built) the
    native op, compared after every write."""

    def __init__(self, dtype: torch.dtype, num_blocks: int, block_size: int, kvh: int, d: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        # stale contents, as a reused block holds: the write rule must not depend on them
        base = (torch.randn(num_blocks, block_size, kvh, d, generator=gen) * 50).clamp(-127, 127)
        if dtype == torch.int8:
            base = base.round()
        cache = base.to(dtype)
        scales = torch.rand(num_blocks, kvh, generator=gen)
        self.ref = [cache.clone(), scales.clone(), torch.zeros(2, dtype=torch.float64)]
        self.tri = [cache.clone().to(DEV), scales.clone().to(DEV), torch.zeros(2, dtype=torch.float64, device=DEV)]
        self.nat = [cache.clone(), scales.clone(), torch.zeros(2, dtype=torch.float64)] if _native() else None
        self.writes = 0

    def write(self, x: torch.Tensor, slots: list[int] | torch.Tensor) -> None:
        slots = torch.as_tensor(slots, dtype=torch.long)
        ref_write_kv_scaled(self.ref[0], self.ref[1], x, slots, self.ref[2])
        tri.write_kv_scaled(self.tri[0], self.tri[1], x.to(DEV), slots.to(DEV), self.tri[2])
        if self.nat is not None:
            keep = slots >= 0
            torch_ops.write_kv_scaled(self.nat[0], self.nat[1], x[keep], slots[keep].contiguous(), self.nat[2])
        self.writes += 1
        self.check()

    def check(self) -> None:
        what = f"after write {self.writes}"
        _assert_same_bits(self.tri[0], self.ref[0], f"cache (triton vs reference) {what}")
        _assert_same_bits(self.tri[1], self.ref[1], f"scales (triton vs reference) {what}")
        torch.testing.assert_close(self.tri[2].cpu(), self.ref[2], rtol=1e-9, atol=1e-12)
        if self.nat is not None:
            _assert_same_bits(self.nat[0], self.ref[0], f"cache (native vs reference) {what}")
            _assert_same_bits(self.nat[1], self.ref[1], f"scales (native vs reference) {what}")
            torch.testing.assert_close(self.nat[2], self.ref[2], rtol=1e-9, atol=1e-12)


def _x(gen: torch.Generator, T: int, kvh: int, d: int, mag: float = 1.0) -> torch.Tensor:
    return torch.randn(T, kvh, d, generator=gen) * mag


# ------------------------------------------------------------------------------------------------
# write_kv
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_index_copy(cache_dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    nb, kvh, d = 5, 2, 12  # head_dim not a power of two: masked columns
    kc = torch.randn(nb, block_size, kvh, d, generator=gen).to(cache_dtype)
    vc = torch.randn(nb, block_size, kvh, d, generator=gen).to(cache_dtype)
    cap = nb * block_size
    slots = torch.randperm(cap, generator=gen)[: min(cap, 7)]
    slots[1] = -1  # skipped
    T = slots.numel()
    for in_dtype in (torch.float32, torch.bfloat16, torch.float16):
        # k a strided view (a slice of a fused qkv projection), v contiguous
        qkv = torch.randn(T, 3, kvh, d, generator=gen).mul(300)
        qkv[0, 1, 0, :4] = torch.tensor([1e6, -7e4, 65520.0, 1e-8])  # fp16 overflow / rounding edge, tiny
        qkv[2, 2, 1, :3] = torch.tensor([NAN, INF, -INF])
        qkv = qkv.to(in_dtype)
        k, v = qkv[:, 1], qkv[:, 2].contiguous()
        kr, vr = kc.clone(), vc.clone()
        keep = slots >= 0
        torch_ops.write_kv(kr, vr, k[keep], v[keep], slots[keep])
        kt, vt = kc.clone().to(DEV), vc.clone().to(DEV)
        tri.write_kv(kt, vt, k.to(DEV), v.to(DEV), slots.to(DEV))
        bf16 = cache_dtype == torch.bfloat16
        _assert_same_bits(kt, kr, f"k cache {in_dtype}", any_nan=bf16)
        _assert_same_bits(vt, vr, f"v cache {in_dtype}", any_nan=bf16)


def test_write_kv_refuses_8bit_caches_and_bad_shapes():
    c = torch.zeros(2, 4, 1, 8, dtype=torch.int8, device=DEV)
    x = torch.zeros(1, 1, 8, device=DEV)
    s = torch.zeros(1, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError):
        tri.write_kv(c, c, x, x, s)
    f = torch.zeros(2, 4, 1, 8, device=DEV)
    with pytest.raises(ValueError):
        tri.write_kv(f, f, torch.zeros(1, 2, 8, device=DEV), x, s)
    tri.write_kv(f, f, x[:0], x[:0], s[:0])  # no tokens: nothing to do


# ------------------------------------------------------------------------------------------------
# write_kv_scaled
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(SCALED))
def test_write_kv_scaled_sequence(kind, block_size):
    """A scripted sequence of prefills and appends: blocks opened at offset 0, runs mid-block that
    grow the scale (requantizing the block's earlier rows) and that do not, several blocks and
    sequences in one call, two runs into one block in one call, dropped tokens, NaN / inf."""
    bs, kvh, d = block_size, 2, 8
    per_seq = -(-24 // bs) + 1  # blocks for 24 positions (more than this script writes)
    nb = 2 * per_seq + 1
    c = Three(SCALED[kind], nb, bs, kvh, d, seed=block_size)
    gen = torch.Generator().manual_seed(100 + block_size)
    perm = torch.randperm(nb - 1, generator=gen).tolist()  # block tables in no particular order
    a_blocks, b_blocks = perm[:per_seq], perm[per_seq:]

    def slots_of(blocks: list[int], start: int, n: int) -> list[int]:  # a sequence's positions start..
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    # 1. prefill of two sequences in one call: A spans its first blocks, B a few tokens
    na, nb_ = bs + 2 if bs > 1 else 2, min(3, bs + 1)
    c.write(_x(gen, na + nb_, kvh, d), slots_of(a_blocks, 0, na) + slots_of(b_blocks, 0, nb_))
    pos_a, pos_b = na, nb_
    # 2. appends that do not grow the scale (small values), mid-block when bs > 1
    c.write(_x(gen, 2, kvh, d, 0.01), slots_of(a_blocks, pos_a, 1) + slots_of(b_blocks, pos_b, 1))
    pos_a, pos_b = pos_a + 1, pos_b + 1
    # 3. appends that grow it (large values): the blocks' earlier rows are requantized
    big = _x(gen, 2, kvh, d, 40.0)
    big[1, 0] *= 0.001  # on B, head 0 does not grow while head 1 does
    c.write(big, slots_of(a_blocks, pos_a, 1) + slots_of(b_blocks, pos_b, 1))
    pos_a, pos_b = pos_a + 1, pos_b + 1
    # 4. a chunk of A then one of B, with a dropped token between
    xa = _x(gen, 3, kvh, d, 3.0)
    xb = _x(gen, 2, kvh, d, 0.5)
    c.write(torch.cat([xa, xb[:1], xb]), slots_of(a_blocks, pos_a, 3) + [-1] + slots_of(b_blocks, pos_b, 2))
    pos_a, pos_b = pos_a + 3, pos_b + 2
    # 5. two runs into one block in one call (B's next token written after A's, then B's following
    #    token before it): the block's runs apply in write order
    s = slots_of(b_blocks, pos_b, 2)
    if s[0] // bs == s[1] // bs:
        c.write(_x(gen, 3, kvh, d, 1.0) * torch.tensor([1.0, 1.0, 20.0])[:, None, None],
                [s[0], slots_of(a_blocks, pos_a, 1)[0], s[1]])
        pos_a, pos_b = pos_a + 1, pos_b + 2
    # 6. NaN and inf: ignored by amax / the error sums where they make the difference non-finite
    x = _x(gen, 3, kvh, d)
    x[0, 0, 1], x[1, 1, 2], x[2, 0, 0], x[2, 1, 3] = NAN, INF, -INF, -NAN
    c.write(x, slots_of(a_blocks, pos_a, 2) + slots_of(b_blocks, pos_b, 1))
    pos_a, pos_b = pos_a + 2, pos_b + 1
    # 7. a head whose values are all zero or NaN (scale 0: zeros stored) opening a block
    x = torch.zeros(1, kvh, d)
    x[0, 1, :2] = NAN
    c.write(x, [(nb - 1) * bs])


@pytest.mark.parametrize("kind", list(SCALED))
def test_write_kv_scaled_random_layouts(kind):
    """Random calls: sequences of several tokens at random positions of random blocks, shuffled so
    that one block gets several runs in a call, dropped slots, magnitudes over 1e-3 .. 1e3."""
    gen = torch.Generator().manual_seed(7)
    for bs in (4, 16):
        nb, kvh, d = 6, 3, 16
        c = Three(SCALED[kind], nb, bs, kvh, d, seed=bs)
        for call in range(4):
            slots: list[int] = []
            for _seq in range(3):
                b = int(torch.randint(nb, (1,), generator=gen))
                o = int(torch.randint(bs, (1,), generator=gen))
                n = int(torch.randint(1, bs - o + 1, (1,), generator=gen))
                slots += [b * bs + o + t for t in range(n)]
            # split some runs and interleave them, drop a token
            perm = torch.randperm(len(slots), generator=gen).tolist()[: max(1, len(slots) // 3)]
            for p in sorted(perm):
                slots.append(slots.pop(p))
            slots.insert(int(torch.randint(len(slots), (1,), generator=gen)), -1)
            mag = 10.0 ** torch.randint(-3, 4, (len(slots), kvh, 1), generator=gen).float()
            x = torch.randn(len(slots), kvh, d, generator=gen) * mag
            c.write(x.to([torch.float32, torch.bfloat16, torch.float16][call % 3]), slots)  # x of any float dtype


@pytest.mark.parametrize("kind", list(SCALED))
def test_write_kv_scaled_rounds_like_torch_casts(kind):
    """With a scale of exactly 1 (amax = qmax) the stored value is ``q(x)``: every representable
    value, every midpoint between neighbours (ties round to even), values around the subnormals
    and random ones equal torch's cast (and ``round`` for int8)."""
    dtype = SCALED[kind]
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[torch.isfinite(grid) & (grid.abs() <= qmax)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(3)
    rnd = (torch.rand(512, generator=gen) * 2 - 1) * qmax
    tiny = (torch.rand(128, generator=gen) * 2 - 1) * (2.0 ** -5 if dtype == torch.float8_e4m3fn else 2.0 ** -13)
    vals = torch.cat([torch.tensor([qmax]), grid, mids, rnd, tiny])  # first value sets amax = qmax
    d = 16
    n = (vals.numel() + d - 1) // d
    vals = torch.cat([vals, torch.zeros(n * d - vals.numel())])
    rows = vals.view(n, 1, d)
    c = Three(dtype, 1, 1 << (n - 1).bit_length(), 1, d)  # one block holds all rows
    c.write(rows, list(range(n)))
    expect = _q(rows, dtype)
    _assert_same_bits(c.tri[0][0, :n].cpu(), expect, "stored values vs torch's cast")
    assert float(c.tri[1][0, 0]) == 1.0


@pytest.mark.parametrize("kind", list(SCALED))
def test_requantization_decodes_every_stored_byte(kind):
    """A block holding every byte pattern (NaN, e5m2 infinities, subnormals, int8 -128 included)
    is requantized by a run mid-block whose amax grows the scale."""
    dtype = SCALED[kind]
    d = 16
    c = Three(dtype, 2, 32, 1, d)
    patterns = torch.arange(256, dtype=torch.uint8).view(16, 1, d)
    for state in (c.ref, c.tri) + ((c.nat,) if c.nat is not None else ()):
        state[0][0, :16] = patterns.view(dtype).to(state[0].device)
        state[1][0, 0] = 0.75
    c.check()
    x = torch.randn(2, 1, d, generator=torch.Generator().manual_seed(1)) * 500.0 * QMAX[dtype] / 127
    c.write(x, [16, 17])  # need > 0.75: every one of the 16 rows is requantized
    assert float(c.tri[1][0, 0]) > 0.75


def test_write_kv_scaled_error_sums_and_nan_storage():
    """The error sums only cover values whose difference is finite; NaN is stored as 0 (int8) or
    NaN with its sign (fp8); inf saturates to ±qmax."""
    x = torch.tensor([[[1.0, NAN, -NAN, INF, -INF, 0.5, -2.0, 0.0]]])
    for dtype in SCALED.values():
        cache = torch.zeros(1, 4, 1, 8, dtype=dtype, device=DEV)
        scales = torch.zeros(1, 1, device=DEV)
        err = torch.zeros(2, dtype=torch.float64, device=DEV)
        tri.write_kv_scaled(cache, scales, x.to(DEV), torch.tensor([0], device=DEV), err)
        s = float(scales[0, 0])
        assert s == np.float32(FLT_MAX) / np.float32(QMAX[dtype])
        stored = cache[0, 0, 0].cpu().float()
        if dtype == torch.int8:
            assert stored[1:3].tolist() == [0.0, 0.0]
        else:
            raw = cache[0, 0, 0].cpu().view(torch.uint8)
            assert raw[1:3].tolist() == [0x7F, 0xFF]
        assert stored[3:5].tolist() == [QMAX[dtype], -QMAX[dtype]]
        # finite values are all far below the scale: stored 0, error = their squares
        finite = torch.tensor([1.0, 0.5, -2.0, 0.0], dtype=torch.float64)
        assert err.cpu().tolist() == pytest.approx([float((finite ** 2).sum())] * 2, rel=1e-12)


def test_write_kv_scaled_plan_reuse_and_checks():
    gen = torch.Generator().manual_seed(5)
    nb, bs, kvh, d = 4, 4, 2, 8
    slots = torch.tensor([4, 5, 6, 13, 14], device=DEV)
    plan = tri.plan_scaled_write(slots, bs, nb)
    k, v = _x(gen, 5, kvh, d).to(DEV), _x(gen, 5, kvh, d, 3.0).to(DEV)
    out = []
    for p in (plan, None):
        kc = torch.zeros(nb, bs, kvh, d, dtype=torch.int8, device=DEV)
        vc = torch.zeros_like(kc)
        ks, vs = torch.zeros(nb, kvh, device=DEV), torch.zeros(nb, kvh, device=DEV)
        err = torch.zeros(2, 2, dtype=torch.float64, device=DEV)
        tri.write_kv_scaled(kc, ks, k, slots, err[0], plan=p)
        tri.write_kv_scaled(vc, vs, v, slots, err[1], plan=p)
        out.append((kc, vc, ks, vs, err))
    for a, b in zip(*out):
        _assert_same_bits(a, b, "with and without a plan")
    cache = torch.zeros(nb + 1, bs, kvh, d, dtype=torch.int8, device=DEV)
    with pytest.raises(ValueError):  # a plan for another cache shape
        tri.write_kv_scaled(cache, torch.zeros(nb + 1, kvh, device=DEV), k, slots,
                            torch.zeros(2, dtype=torch.float64, device=DEV), plan=plan)
    with pytest.raises(ValueError):  # not an 8-bit cache
        tri.write_kv_scaled(cache.float(), torch.zeros(nb + 1, kvh, device=DEV), k, slots,
                            torch.zeros(2, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError):  # scales of the wrong shape
        tri.write_kv_scaled(cache, torch.zeros(nb, kvh, device=DEV), k, slots,
                            torch.zeros(2, dtype=torch.float64, device=DEV))


# ------------------------------------------------------------------------------------------------
# copy_blocks
# ------------------------------------------------------------------------------------------------

COPY_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _pool(dtype: torch.dtype, layers=2, nb=6, bs=4, kvh=2, d=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layers, 2, nb, bs, kvh, d * torch.empty(0, dtype=dtype).element_size()),
                        generator=gen, dtype=torch.uint8)
    kv = raw.view(dtype)  # every bit pattern (NaNs included): the copy moves bytes
    scales = torch.rand(layers, 2, nb, kvh, generator=gen)
    return kv, scales


@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("pairs", [
    [(0, 3)],
    [(1, 4), (2, 5), (0, 2)],  # chain: 0 -> 2 while 2 -> 5 (2 read before it is written)
    [(0, 1), (1, 2)],  # a -> b, b -> c
    [(3, 4), (4, 3)],  # swap
    [(2, 2)],  # onto itself
], ids=["one", "chain3", "a_b_c", "swap", "self"])
def test_copy_blocks_matches_torch(dtype, pairs):
    with_scales = dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
    kv, scales = _pool(dtype, seed=len(pairs))
    kr, sr = kv.clone(), scales.clone()
    torch_ops.copy_blocks(kr, pairs, sr if with_scales else None)
    kt, st = kv.clone().to(DEV), scales.clone().to(DEV)
    tri.copy_blocks(kt, pairs, st if with_scales else None)
    _assert_same_bits(kt, kr, "kv")
    if with_scales:
        _assert_same_bits(st, sr, "scales")
    else:
        _assert_same_bits(st, scales, "scales untouched")
    # the chain reads sources first: block c now holds a's old contents, not b's
    if pairs == [(0, 1), (1, 2)]:
        _assert_same_bits(kt[:, :, 2], kv[:, :, 1], "c holds b's old contents")
        _assert_same_bits(kt[:, :, 1], kv[:, :, 0], "b holds a's contents")


def test_copy_blocks_checks_and_fallback():
    kv, _ = _pool(torch.float16)
    kt = kv.clone().to(DEV)
    with pytest.raises(ValueError):
        tri.copy_blocks(kt, [(0, 1), (2, 1)])
    with pytest.raises(ValueError):
        tri.copy_blocks(kt, [(0, 6)])
    with pytest.raises(ValueError):
        tri.copy_blocks(kt, [(0, 1)], torch.zeros(2, 2, 5, 2, device=DEV))
    tri.copy_blocks(kt, [])
    _assert_same_bits(kt, kv, "nothing copied")
    # a layout the kernel cannot view ([layers, 2] not mergeable): the plain PyTorch copy
    big = torch.zeros(2, 3, 6, 4, 2, 6, dtype=torch.float16, device=DEV)
    big[:, :2] = kv.to(DEV)
    nc = big[:, :2]
    tri.copy_blocks(nc, [(0, 1), (1, 2)])
    kr = kv.clone()
    torch_ops.copy_blocks(kr, [(0, 1), (1, 2)])
    _assert_same_bits(nc, kr, "non-contiguous pool")
