"""Triton kernels for the KV cache write and the block copy (the functions of ``pagedkv/ops/cache_ops.py``).

- :func:`write_kv`: new tokens' K and V into float32 / float16 / bfloat16 caches at their slots
  (one program per token; a slot < 0 skips its token).
- :func:`write_kv_scaled`: new tokens into an int8 / fp8 (e4m3fn, e5m2) cache with per-(block, KV
  head) float32 scales grown as tokens arrive, the rule of ``csrc/paged_attention.cpp``'s
  ``write_kv_scaled`` (and :mod:`pagedkv.ops.kv_format`), stored bytes bit for bit:

  * the tokens split into runs of consecutive slots within one block (a slot < 0 is dropped first,
    as if its token were not there);
  * per run and KV head: ``need = min(amax, FLT_MAX) / qmax`` (``amax`` = max |x| over the run,
    NaN ignored); a run at offset 0 opens its block (``scale = need``); a later run with
    ``need > scale`` requantizes the block's filled rows ``0 .. first-1`` by ``scale / need`` and
    takes ``scale = need``; each new value is stored as ``q(x * (1 / scale))`` (0 when the scale
    is 0), ``q`` saturating to ``±qmax`` then rounding to nearest even;
  * ``error += [sum((stored * scale - x)^2), sum(x^2)]`` over the new values whose difference is
    finite (float64; summed per program, then on the host, so not in the C++ order).

  One program per (block, KV head) walks that block's runs in write order, so several runs into
  one block in one call (a rare order of slots) apply one after another as in the C++ loop. The
  runs and their grouping by block are computed with torch ops on the device without a host
  sync (:func:`plan_scaled_write`; a caller writing K and V of every layer with one slot mapping
  can compute that plan once and pass it).
- :func:`copy_blocks`: copy-on-write of whole blocks in every layer (and their scales), as raw
  integers (fp8 included); when a destination is also a source the sources go through a
  temporary first, so every source is read before any destination is written.

Exactness (the tests compare bytes with the C++ op and with torch):

- division is ``div_rn`` (IEEE, as C++'s ``/``; Triton's plain ``/`` on fp32 is not correctly
  rounded on NVIDIA GPUs); int8 rounding is ``(y + 1.5*2^23) - 1.5*2^23`` (round half to even like
  ``std::nearbyint`` for |y| <= 127); a NaN is stored as 0 in int8 (what the C++ build does);
- fp8 values are encoded and decoded with integer bit operations (round to nearest even,
  subnormals, -0, NaN as 0x7F with its sign like c10's conversion) rather than Triton's fp8 casts,
  whose interpreter emulation neither rounds to nearest even nor keeps NaN;
- bfloat16 (caches of ``write_kv``, inputs of both writes) moves as int16 bits with the
  round-to-nearest-even done in integers: the interpreter's float32 -> bfloat16 cast truncates.
  A NaN written to a bfloat16 cache is 0x7FC0 (torch's own CPU cast gives 0x7FC0 or 0xFFFF
  depending on its code path);
- signs are set as bits: Triton's unary minus is ``0 - x`` and turns -0 into +0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# cache dtype -> (format code for the kernel, qmax)
_SCALED = {
    torch.int8: (0, 127.0),
    torch.float8_e4m3fn: (1, 448.0),
    torch.float8_e5m2: (2, 57344.0),
}
_FLOAT_CACHES = (torch.float32, torch.float16, torch.bfloat16)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# --------------------------------------------------------------------------------------------
# write_kv: float caches
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_f32(ptr, mask, BF16: tl.constexpr):
    """Load as float32; bfloat16 comes as its int16 bits (exact in the interpreter too, whose
    bfloat16 casts truncate)."""
    v = tl.load(ptr, mask=mask, other=0)
    if BF16:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _store_cast(ptr, x, mask, BF16: tl.constexpr):
    """Store float32 ``x`` in the element type of ``ptr``, round to nearest even; a bfloat16 cache
    comes as its int16 bits (NaN stored as 0x7FC0, as c10's scalar conversion)."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        tl.store(ptr, tl.where(x != x, 0x7FC0, r).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_cache, v_cache, k, v, slots,
    E, D, block_size, capacity,
    kc_b, kc_o, kc_h, kc_d,
    vc_b, vc_o, vc_h, vc_d,
    k_t, k_h, k_d,
    v_t, v_h, v_d,
    KC_BF16: tl.constexpr, VC_BF16: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    ok = (slot >= 0) & (slot < capacity)
    b = tl.where(ok, slot // block_size, 0)
    o = tl.where(ok, slot % block_size, 0)
    n = tl.where(ok, E, 0)  # nothing to do for a skipped token
    e0 = 0
    while e0 < n:  # (while, not range: the interpreter cannot range over a loaded bound)
        e = e0 + tl.arange(0, BLOCK)
        m = e < E
        h = e // D
        d = e % D
        kv_ = _load_f32(k + t * k_t + h * k_h + d * k_d, m, K_BF16)
        vv = _load_f32(v + t * v_t + h * v_h + d * v_d, m, V_BF16)
        _store_cast(k_cache + b * kc_b + o * kc_o + h * kc_h + d * kc_d, kv_, m, KC_BF16)
        _store_cast(v_cache + b * vc_b + o * vc_o + h * vc_h + d * vc_d, vv, m, VC_BF16)
        e0 += BLOCK


def _bits_if_bf16(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (t.view(torch.int16), True) if t.dtype == torch.bfloat16 else (t, False)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float32 / float16 / bfloat16
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; a slot < 0 skips its token
) -> None:
    """Store new tokens' K and V at their slots (``slot = block_id * block_size + offset``), cast to
    the caches' dtype (round to nearest even)."""
    for c in (k_cache, v_cache):
        if c.dim() != 4 or c.dtype not in _FLOAT_CACHES:
            raise ValueError(f"write_kv: caches are [num_blocks, block_size, kv_heads, head_dim] float32 / "
                             f"float16 / bfloat16, got {tuple(c.shape)} {c.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError("write_kv: k_cache and v_cache differ in shape")
    nb, bs, kvh, d = k_cache.shape
    T = slot_mapping.numel()
    for x in (k, v):
        if x.dim() != 3 or x.shape[0] != T or x.shape[1:] != (kvh, d) or not x.is_floating_point():
            raise ValueError(f"write_kv: k and v are [T={T}, {kvh}, {d}] float, got {tuple(x.shape)} {x.dtype}")
    if T == 0:
        return
    if k.dtype not in _FLOAT_CACHES:  # float64: one rounding, by torch, as the CPU function
        k = k.to(k_cache.dtype)
    if v.dtype not in _FLOAT_CACHES:
        v = v.to(v_cache.dtype)
    (kc, kc16), (vc, vc16), (k, k16), (v, v16) = map(_bits_if_bf16, (k_cache, v_cache, k, v))
    E = kvh * d
    _write_kv_kernel[(T,)](
        kc, vc, k, v, slot_mapping,
        E, d, bs, nb * bs,
        *kc.stride(), *vc.stride(), *k.stride(), *v.stride(),
        KC_BF16=kc16, VC_BF16=vc16, K_BF16=k16, V_BF16=v16,
        BLOCK=min(_pow2(E), 1024),
    )


# --------------------------------------------------------------------------------------------
# write_kv_scaled: int8 / fp8 caches with per-block scales
# --------------------------------------------------------------------------------------------


@triton.jit
def _pow2_f32(e):
    """2^e as float32 for an int32 ``e`` in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_encode(y, M: tl.constexpr, BIAS: tl.constexpr):
    """float32 ``y`` (already within ±qmax, or NaN) -> fp8 bits (int32 0..255), round to nearest
    even, subnormals included; NaN -> 0x7F with y's sign (c10's conversion)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(y)
    is_nan = a != a
    a = tl.where(is_nan, 0.0, a)
    eb = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased float32 exponent (0 for 0 / subnormal)
    e = tl.maximum(eb - 127, 1 - BIAS)  # the fp8 exponent of a's binade (its smallest for subnormals)
    t = a * _pow2_f32(M - e)  # exact: a in units of the fp8 spacing, in [0, 2^(M+1)]
    r = ((t + 12582912.0) - 12582912.0).to(tl.int32)  # round half to even
    up = r >= (1 << (M + 1))  # rounded up into the next binade
    e = tl.where(up, e + 1, e)
    r = tl.where(up, r >> 1, r)
    normal = r >= (1 << M)
    field = tl.where(normal, ((e + BIAS) << M) | (r - (1 << M)), r)
    return tl.where(is_nan, 0x7F, field) | (sign << 7)


@triton.jit
def _fp8_decode(b, M: tl.constexpr, BIAS: tl.constexpr, E4M3FN: tl.constexpr):
    """fp8 bits (int32 0..255) -> float32 (NaN and, for e5m2, infinities included)."""
    EMASK: tl.constexpr = (1 << (7 - M)) - 1
    ef = (b >> M) & EMASK
    mant = b & ((1 << M) - 1)
    sub = mant.to(tl.float32) * _pow2_f32(tl.full(b.shape, 1 - BIAS - M, tl.int32))
    nrm = (mant + (1 << M)).to(tl.float32) * _pow2_f32(tl.maximum(ef, 1) - BIAS - M)
    val = tl.where(ef == 0, sub, nrm)
    nan = tl.full(b.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    inf = tl.full(b.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    if E4M3FN:
        val = tl.where((ef == EMASK) & (mant == (1 << M) - 1), nan, val)
    else:
        val = tl.where(ef == EMASK, tl.where(mant == 0, inf, nan), val)
    # the sign as a bit: Triton's unary minus is 0 - x, which loses the sign of -0
    return (val.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(y, src, FMT: tl.constexpr, QMAX: tl.constexpr):
    """``q(y)`` in the cache's element type (int8, or fp8 bits as uint8); ``src`` (y's source, of
    which y is a positive multiple) gives a NaN its sign."""
    y = tl.where(y > QMAX, QMAX, tl.where(y < -QMAX, -QMAX, y))  # NaN stays NaN (std::clamp)
    if FMT == 0:
        r = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127)
        return tl.where(y != y, 0.0, r).to(tl.int8)
    else:
        y = tl.where(y != y, src, y)  # a NaN keeps its source's sign (x86 multiply, then c10's cast)
        if FMT == 1:
            return _fp8_encode(y, 3, 7).to(tl.uint8)
        else:
            return _fp8_encode(y, 2, 15).to(tl.uint8)


@triton.jit
def _dequantize(q, FMT: tl.constexpr):
    """Stored element -> float32."""
    if FMT == 0:
        return q.to(tl.float32)
    elif FMT == 1:
        return _fp8_decode(q.to(tl.int32), 3, 7, True)
    else:
        return _fp8_decode(q.to(tl.int32), 2, 15, False)


@triton.jit
def _run_rows(x, stok, p0, i, L, rows, cols, cmask, h, x_t, x_h, x_d, X_BF16: tl.constexpr):
    """Rows i .. i + ROWS of a run (of L rows from position p0 of the sorted tokens): their row
    indices in the run, the [ROWS, DP] mask, and head h's float32 values of x."""
    rr = i + rows
    rm = rr < L
    tok = tl.load(stok + p0 + rr, mask=rm, other=0).to(tl.int64)
    m = rm[:, None] & cmask[None, :]
    return rr, m, _load_f32(x + tok[:, None] * x_t + h * x_h + cols[None, :] * x_d, m, X_BF16)


@triton.jit
def _write_kv_scaled_kernel(
    cache, scales, x, partial,
    stok, sslot, run_pos, run_len, g_first_run, g_nruns,
    D, block_size,
    c_b, c_o, c_h, c_d,
    s_b, s_h,
    x_t, x_h, x_d,
    FMT: tl.constexpr, QMAX: tl.constexpr, X_BF16: tl.constexpr, ROWS: tl.constexpr, DP: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    nprog_h = tl.num_programs(1)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, DP)
    cmask = cols < D
    e2 = tl.zeros([ROWS, DP], tl.float64)
    r2 = tl.zeros([ROWS, DP], tl.float64)
    nr = tl.load(g_nruns + g)
    r0 = tl.load(g_first_run + g)
    k = 0
    while k < nr:  # the block's runs, in write order (while: see _write_kv_kernel)
        p0 = tl.load(run_pos + r0 + k)
        L = tl.load(run_len + r0 + k)
        slot0 = tl.load(sslot + p0).to(tl.int64)
        b = slot0 // block_size
        first = slot0 - b * block_size
        # amax over the run's rows for this head (NaN ignored)
        amax = 0.0
        i = 0
        while i < L:
            rr, m, xv = _run_rows(x, stok, p0, i, L, rows, cols, cmask, h, x_t, x_h, x_d, X_BF16)
            a = tl.abs(xv)
            a = tl.where(a == a, a, 0.0)
            amax = tl.maximum(amax, tl.max(tl.max(a, axis=1), axis=0))
            i += ROWS
        need = tl.math.div_rn(tl.minimum(amax, 3.4028234663852886e38), QMAX)
        s_ptr = scales + b * s_b + h * s_h
        s_old = tl.load(s_ptr)
        grow = (first > 0) & (need > s_old)
        s = tl.where((first == 0) | grow, need, s_old)
        # requantize the block's filled rows 0 .. first-1 to the grown scale
        ratio = tl.math.div_rn(s_old, tl.where(grow, need, 1.0))
        n_req = tl.where(grow, first, 0)
        i = 0
        while i < n_req:
            rr = i + rows
            m = (rr < n_req)[:, None] & cmask[None, :]
            ptr = cache + b * c_b + rr[:, None] * c_o + h * c_h + cols[None, :] * c_d
            old = _dequantize(tl.load(ptr, mask=m, other=0), FMT)
            tl.store(ptr, _quantize(old * ratio, old, FMT, QMAX), mask=m)
            i += ROWS
        tl.store(s_ptr, s)
        inv = tl.where(s > 0.0, tl.math.div_rn(1.0, tl.where(s > 0.0, s, 1.0)), 0.0)
        # the new rows
        i = 0
        while i < L:
            rr, m, xv = _run_rows(x, stok, p0, i, L, rows, cols, cmask, h, x_t, x_h, x_d, X_BF16)
            q = _quantize(xv * inv, xv, FMT, QMAX)
            orow = first + rr
            tl.store(cache + b * c_b + orow[:, None] * c_o + h * c_h + cols[None, :] * c_d, q, mask=m)
            diff = (_dequantize(q, FMT) * s).to(tl.float64) - xv.to(tl.float64)
            fin = m & ((diff - diff) == 0.0)  # finite
            e2 += tl.where(fin, diff * diff, 0.0)
            x64 = xv.to(tl.float64)
            r2 += tl.where(fin, x64 * x64, 0.0)
            i += ROWS
        k += 1
    out = partial + (g * nprog_h + h) * 2
    tl.store(out, tl.sum(tl.sum(e2, axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(r2, axis=1), axis=0))


class ScaledWritePlan:
    """How one ``slot_mapping`` splits into runs and blocks (device tensors, sized by T)."""

    __slots__ = ("block_size", "capacity", "numel", "stok", "sslot", "run_pos", "run_len", "g_first_run",
                 "g_nruns")

    def __init__(self, slots: torch.Tensor, block_size: int, capacity: int) -> None:
        dev = slots.device
        T = slots.numel()
        self.block_size, self.capacity, self.numel = block_size, capacity, T
        s = slots.reshape(-1).to(torch.long)
        ar = torch.arange(T, device=dev)
        valid = (s >= 0) & (s < capacity)
        # the valid tokens first, in their order (a dropped token does not split a run)
        comp = torch.sort((~valid).to(torch.int16), stable=True).indices
        cs = s[comp]
        cv = valid[comp]
        nb = capacity // block_size
        cb = torch.where(cv, cs // block_size, nb)  # block of each (nb: none)
        start = cv.clone()
        if T > 1:
            start[1:] &= (cb[1:] != cb[:-1]) | (cs[1:] != cs[:-1] + 1)
        # group the tokens by block, keeping the write order within each block
        order = torch.sort(cb, stable=True).indices
        sb = cb[order]
        sv = cv[order]
        sstart = start[order]
        self.stok = comp[order].contiguous()
        self.sslot = cs[order].contiguous()
        dump = torch.full_like(ar, T)
        rid = torch.cumsum(sstart, 0) - 1  # run of each sorted position
        self.run_pos = torch.zeros(T + 1, dtype=torch.long, device=dev).scatter_(
            0, torch.where(sstart, rid, dump), ar)
        ones = torch.ones_like(ar)
        self.run_len = torch.zeros(T + 1, dtype=torch.long, device=dev).index_add_(
            0, torch.where(sv, rid, dump), ones)
        gstart = sv.clone()
        if T > 1:
            gstart[1:] &= sb[1:] != sb[:-1]
        gid = torch.cumsum(gstart, 0) - 1
        self.g_first_run = torch.zeros(T + 1, dtype=torch.long, device=dev).scatter_(
            0, torch.where(gstart, gid, dump), rid)
        self.g_nruns = torch.zeros(T + 1, dtype=torch.long, device=dev).index_add_(
            0, torch.where(sstart, gid, dump), ones)


def plan_scaled_write(slot_mapping: torch.Tensor, block_size: int, num_blocks: int) -> ScaledWritePlan:
    """The runs and blocks of ``slot_mapping``, for :func:`write_kv_scaled`'s ``plan`` (a caller that
    writes K and V of every layer with one slot mapping computes it once)."""
    return ScaledWritePlan(slot_mapping, block_size, num_blocks * block_size)


def write_kv_scaled(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] int8 / fp8
    scales: torch.Tensor,  # [num_blocks, kv_heads] float32
    x: torch.Tensor,  # [T, kv_heads, head_dim] new tokens' K (or V), any float dtype
    slot_mapping: torch.Tensor,  # [T] int64; a slot < 0 drops its token
    error: torch.Tensor,  # [2] float64: += sum((dequantized - x)^2), sum(x^2)
    plan: ScaledWritePlan | None = None,  # plan_scaled_write(slot_mapping, ...), else computed here
) -> None:
    """Quantize new tokens into an 8-bit cache, growing their blocks' scales as needed (the rule
    of ``csrc/paged_attention.cpp``'s ``write_kv_scaled``; see the module's docstring)."""
    if cache.dim() != 4 or cache.dtype not in _SCALED:
        raise ValueError(f"write_kv_scaled: cache is [num_blocks, block_size, kv_heads, head_dim] int8 / "
                         f"float8_e4m3fn / float8_e5m2, got {tuple(cache.shape)} {cache.dtype}")
    nb, bs, kvh, d = cache.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) != (nb, kvh):
        raise ValueError(f"write_kv_scaled: scales are [{nb}, {kvh}] float32, got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    T = slot_mapping.numel()
    if x.dim() != 3 or x.shape[0] != T or x.shape[1:] != (kvh, d) or not x.is_floating_point():
        raise ValueError(f"write_kv_scaled: x is [T={T}, {kvh}, {d}] float, got {tuple(x.shape)} {x.dtype}")
    if error.dtype != torch.float64 or error.numel() != 2:
        raise ValueError("write_kv_scaled: error is [2] float64")
    if T == 0:
        return
    fmt, qmax = _SCALED[cache.dtype]
    if plan is None:
        plan = ScaledWritePlan(slot_mapping, bs, nb * bs)
    elif (plan.block_size, plan.capacity, plan.numel) != (bs, nb * bs, T):
        raise ValueError("write_kv_scaled: the plan was made for another slot mapping or cache shape")
    store = cache if fmt == 0 else cache.view(torch.uint8)
    x, x16 = _bits_if_bf16(x)
    dp = _pow2(d)
    rows = max(1, min(_pow2(bs), 2048 // dp))
    groups = min(T, nb)
    partial = torch.empty(groups * kvh * 2, dtype=torch.float64, device=cache.device)
    _write_kv_scaled_kernel[(groups, kvh)](
        store, scales, x, partial,
        plan.stok, plan.sslot, plan.run_pos, plan.run_len, plan.g_first_run, plan.g_nruns,
        d, bs,
        *store.stride(), *scales.stride(), *x.stride(),
        FMT=fmt, QMAX=qmax, X_BF16=x16, ROWS=rows, DP=dp,
    )
    error += partial.view(-1, 2).sum(0).to(error.device).view(error.shape)


# --------------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------------


@triton.jit
def _copy_blocks_kernel(src, dst, src_ids, dst_ids, n, src_outer, src_block, dst_outer, dst_block,
                        BLOCK: tl.constexpr):
    p = tl.program_id(0)
    o = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    sb = tl.load(src_ids + p).to(tl.int64)
    db = tl.load(dst_ids + p).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    val = tl.load(src + o * src_outer + sb * src_block + offs, mask=m)
    tl.store(dst + o * dst_outer + db * dst_block + offs, val, mask=m)


def _as_ints(t: torch.Tensor, outer: int, blocks: int) -> torch.Tensor | None:
    """``t`` as ``[outer, blocks, n]`` of an integer type (its bytes, widened to int32 where the
    block allows), or None when its layout does not allow the view."""
    try:
        flat = t.view(outer, blocks, -1)
        if flat.stride(-1) != 1:
            return None
        raw = flat.view(_INT_OF_SIZE[t.element_size()])
    except (RuntimeError, KeyError):
        return None
    if (raw.shape[-1] * raw.element_size()) % 4 == 0 and raw.element_size() < 4:
        try:
            return raw.view(torch.int32)
        except RuntimeError:  # storage offset not 4-byte aligned
            pass
    return raw


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    n = src.shape[-1]
    block = min(_pow2(n), 4096)
    grid = (src_ids.numel(), src.shape[0], triton.cdiv(n, block))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, n, src.stride(0), src.stride(1),
                              dst.stride(0), dst.stride(1), BLOCK=block)


def copy_blocks(kv: torch.Tensor, pairs: Sequence[tuple[int, int]], scales: torch.Tensor | None = None) -> None:
    """Copy-on-write: block ``src`` -> block ``dst`` for every (src, dst) pair, in every layer.

    ``kv`` is ``[num_layers, 2, num_blocks, ...]``, ``scales`` (8-bit formats) ``[num_layers, 2,
    num_blocks, kv_heads]``: a block's scales go with it. All sources are read before any
    destination is written. Raises ValueError when a destination repeats or a block id is out of
    range. A layout the kernel cannot address (blocks not contiguous inside) falls back to the
    plain PyTorch copy.
    """
    pairs = [(int(a), int(b)) for a, b in pairs]
    if not pairs:
        return
    src_list = [a for a, _ in pairs]
    dst_list = [b for _, b in pairs]
    if len(set(dst_list)) != len(dst_list):
        raise ValueError("copy_blocks: a destination block appears twice")
    if kv.dim() < 3:
        raise ValueError(f"copy_blocks: kv is [num_layers, 2, num_blocks, ...], got {tuple(kv.shape)}")
    nl, two, nb = kv.shape[:3]
    if not all(0 <= i < nb for i in src_list + dst_list):
        raise ValueError(f"copy_blocks: a block id is outside 0 .. {nb - 1}")
    if scales is not None and tuple(scales.shape[:3]) != (nl, two, nb):
        raise ValueError(f"copy_blocks: scales are [{nl}, {two}, {nb}, kv_heads], got {tuple(scales.shape)}")
    tensors = [kv] if scales is None else [kv, scales]
    views = [_as_ints(t, nl * two, nb) for t in tensors]
    if any(v is None for v in views):
        from pagedkv.ops.cache_ops import copy_blocks as torch_copy_blocks
        torch_copy_blocks(kv, pairs, scales)
        return
    dev = kv.device
    src = torch.tensor(src_list, dtype=torch.long, device=dev)
    dst = torch.tensor(dst_list, dtype=torch.long, device=dev)
    overlap = not set(src_list).isdisjoint(dst_list)
    for raw in views:
        assert raw is not None
        if overlap:  # a destination is also a source: read every source first
            tmp = torch.empty(raw.shape[0], len(pairs), raw.shape[2], dtype=raw.dtype, device=dev)
            idx = torch.arange(len(pairs), dtype=torch.long, device=dev)
            _launch_copy(raw, tmp, src, idx)
            _launch_copy(tmp, raw, idx, dst)
        else:
            _launch_copy(raw, raw, src, dst)
