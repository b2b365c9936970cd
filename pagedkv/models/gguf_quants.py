"""GGUF block types that pagedkv's 8-bit weight layout holds exactly: int8 ``q`` with one float32
scale and, optionally, one float32 offset per 32 values, ``value = scale * q + offset``
(``models/quant_linear.py``). :func:`unpack` turns a tensor's raw blocks into that layout::

    type   block (values: bytes)                          q (int8)            scale       offset
    Q8_0   32: fp16 d, 32 int8                            q                   d           -
    Q4_0   32: fp16 d, 16 bytes of nibbles                nibble - 8          d           -
    Q5_0   32: fp16 d, 32 high bits, nibbles              (nibble|h<<4) - 16  d           -
    Q4_1   32: fp16 d, fp16 m, nibbles                    nibble              d           m
    Q5_1   32: fp16 d, fp16 m, 32 high bits, nibbles      nibble|h<<4         d           m
    Q4_K   256: fp16 d, fp16 dmin, 8 x (6-bit sc, m),     nibble              d * sc_j    -(dmin * m_j)
           128 bytes of nibbles: 8 sub-blocks of 32
    Q5_K   256: as Q4_K plus 32 bytes of high bits        nibble|h<<4         d * sc_j    -(dmin * m_j)

Bit for bit, not merely close: ``gguf.quants.dequantize`` computes ``d * q (+ m)`` and, for the
K-quants, ``(d * sc) * q - dmin * m`` in float32. Every product there is exact in float32 (an fp16
significand has 11 bits, a 6-bit sub-block scale and a 5-bit q make at most 22), so its only
rounding is the final addition, which ``scale * q + offset`` repeats (``a - b`` is ``a + (-b)`` in
IEEE arithmetic). ``tests/models/test_gguf_quants.py`` checks it on random blocks of every type.

Other types have no such form: Q6_K, Q2_K and Q3_K have 16-value sub-blocks with their own scales,
the IQ types look values up in non-uniform grids. :func:`unpack` raises ValueError for them.

:func:`unpack_lowbit` keeps the types of :data:`LOWBIT_TYPES` at their own width instead
(``weight_quant.LowBitFormat``: nibbles in GGUF's order, the fifth and sixth bits as bit planes,
float32 scales and offsets as above)::

    type    format  code                      scale (per)        offset
    Q4_0    i4      nibble (value code - 8)   d (32)             -
    Q4_1    u4      nibble                    d (32)             m
    Q4_K    u4      nibble                    d * sc_j (32)      -(dmin * m_j)
    IQ4_NL  nl4     nibble (value lut[code])  d (32)             -
    Q5_0    i5      nibble | h << 4 (- 16)    d (32)             -
    Q5_1    u5      nibble | h << 4           d (32)             m
    Q5_K    u5      nibble | h << 4           d * sc_j (32)      -(dmin * m_j)
    Q6_K    i6      6 bits (- 32)             d * sc_j (16)      -

Exact for the same reason: every product ``d * sc`` and ``scale * value`` is exact or rounded
once, as ``gguf.quants.dequantize`` does (Q6_K: ``(d * sc) * q``, one rounding). Q4_0 and Q5_0
become u4 and u5 beside the other types of a fused module with ``-8 d`` and ``-16 d`` as offsets
(:func:`as_unsigned`): ``d * code + (-8 d)`` is the exact ``d * (code - 8)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.weight_quant import LOWBIT_FORMATS, LowBitFormat

QK = 32  # values per scale
QK_K = 256  # values per K-quant super-block


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] uint8 -> [n, 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] uint8 (a little-endian uint32) -> [n, 32]: bit j of it is value j's fifth bit."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _sub_blocks(qs: np.ndarray) -> np.ndarray:
    """[n, 128] uint8 -> [n, 8, 32]: chunk c of 32 bytes holds sub-block 2c low, 2c + 1 high."""
    chunks = qs.reshape(-1, 4, 1, QK) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 8, QK)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) [n, 8] float32 of K-quant super-blocks (d, dmin, 12 bytes of 6-bit sc and m)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return _f16(blocks[:, 0:2]) * sc.astype(np.float32), -(_f16(blocks[:, 2:4]) * m.astype(np.float32))


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8), _f16(b[:, :2]), None


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return (_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])).astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (_nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (_sub_blocks(b[:, 16:]).astype(np.int8), *_k_scales(b))


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # qh: 32 bytes; bit j of byte i is the fifth bit of value i of sub-block j
    high = (b[:, 16:48].reshape(-1, 1, QK) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (_sub_blocks(b[:, 48:]) | (high << 4)).astype(np.int8), *_k_scales(b)


# type name -> (bytes per block, unpacker of [blocks, bytes] uint8)
_TYPES = {
    "Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q5_0": (22, _q5_0), "Q4_1": (20, _q4_1), "Q5_1": (24, _q5_1),
    "Q4_K": (144, _q4_k), "Q5_K": (176, _q5_k),
}
EXACT_TYPES = frozenset(_TYPES)


def unpack(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q int8 ``[V / 32, 32]``, scales float32 ``[V / 32]``, offsets float32 ``[V / 32]`` or None) of
    the ``V`` values held in ``raw``, a GGUF tensor's blocks of type ``type_name`` (any shape, uint8),
    in the tensor's order. Raises ValueError for a type outside :data:`EXACT_TYPES`."""
    if type_name not in _TYPES:
        raise ValueError(f"GGUF type {type_name} has no exact form with a scale and offset per {QK} values "
                         f"(exact: {', '.join(sorted(EXACT_TYPES))})")
    width, unpacker = _TYPES[type_name]
    q, scales, offsets = unpacker(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, width))
    return (np.ascontiguousarray(q).reshape(-1, QK), scales.reshape(-1),
            None if offsets is None else offsets.reshape(-1))


# GGUF type -> the low-bit format that holds it exactly
LOWBIT_TYPES = {"Q4_0": "i4", "Q4_1": "u4", "Q4_K": "u4", "IQ4_NL": "nl4", "Q5_0": "i5", "Q5_1": "u5",
                "Q5_K": "u5", "Q6_K": "i6"}
_LOWBIT_WIDTH = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "IQ4_NL": 18, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176,
                 "Q6_K": 210}


@dataclass(slots=True)
class LowBit:
    """A tensor's ``V`` values in a low-bit format: ``nibbles`` uint8 ``[V / 32, 16]``, ``planes``
    uint8 ``[V / 32, 4 * format.planes]`` (None at 4 bits), ``scales`` float32 ``[V / group]``,
    ``offsets`` float32 ``[V / 32]`` or None."""

    format: LowBitFormat
    nibbles: np.ndarray
    planes: np.ndarray | None
    scales: np.ndarray
    offsets: np.ndarray | None


def pack_codes(codes: np.ndarray, planes: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(nibbles ``[B, 16]``, bit planes ``[B, 4 * planes]`` or None) of ``codes`` uint8 ``[B, 32]``."""
    codes = codes.astype(np.uint8)
    nibbles = (codes[:, :16] & 0x0F) | ((codes[:, 16:] & 0x0F) << 4)
    if not planes:
        return np.ascontiguousarray(nibbles), None
    bits = [np.packbits((codes >> np.uint8(4 + p)) & 1, axis=1, bitorder="little") for p in range(planes)]
    return np.ascontiguousarray(nibbles), np.ascontiguousarray(np.concatenate(bits, axis=1))


def _k_codes(b: np.ndarray, high: bool) -> np.ndarray:
    """[n, 256] codes of Q4_K (``high`` False) or Q5_K super-blocks, in value order."""
    codes = _sub_blocks(b[:, 48:] if high else b[:, 16:])
    if high:
        codes = codes | (((b[:, 16:48].reshape(-1, 1, QK) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
    return codes.reshape(-1, QK_K)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n, 256] codes 0..63 in value order, scales [n, 16] = d * sc) of Q6_K super-blocks
    (ql 128 bytes, qh 64, sc 16 int8, d fp16), as ``gguf.quants.Q6_K`` reads them."""
    n = len(b)
    ql = (b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << 4)
    scales = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return codes.reshape(n, QK_K), scales


def unpack_lowbit(raw: np.ndarray, type_name: str) -> LowBit:
    """The values held in ``raw`` (a GGUF tensor's blocks of ``type_name``, any shape, uint8), in
    the tensor's order, in their low-bit format (the module docstring). Raises ValueError for a
    type outside :data:`LOWBIT_TYPES`."""
    if type_name not in LOWBIT_TYPES:
        raise ValueError(f"GGUF type {type_name} has no low-bit layout (those with one: "
                         f"{', '.join(sorted(LOWBIT_TYPES))})")
    fmt = LOWBIT_FORMATS[LOWBIT_TYPES[type_name]]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, _LOWBIT_WIDTH[type_name])
    offsets: np.ndarray | None = None
    if type_name in ("Q4_0", "IQ4_NL"):
        nibbles, planes, scales = np.ascontiguousarray(b[:, 2:]), None, _f16(b[:, :2])
    elif type_name == "Q4_1":
        nibbles, planes, scales, offsets = np.ascontiguousarray(b[:, 4:]), None, _f16(b[:, :2]), _f16(b[:, 2:4])
    elif type_name == "Q5_0":
        nibbles, planes, scales = np.ascontiguousarray(b[:, 6:]), np.ascontiguousarray(b[:, 2:6]), _f16(b[:, :2])
    elif type_name == "Q5_1":
        nibbles, planes = np.ascontiguousarray(b[:, 8:]), np.ascontiguousarray(b[:, 4:8])
        scales, offsets = _f16(b[:, :2]), _f16(b[:, 2:4])
    elif type_name in ("Q4_K", "Q5_K"):
        nibbles, planes = pack_codes(_k_codes(b, type_name == "Q5_K").reshape(-1, QK), fmt.planes)
        scales, offsets = _k_scales(b)
    else:  # Q6_K
        codes, scales = _q6_k(b)
        nibbles, planes = pack_codes(codes.reshape(-1, QK), fmt.planes)
    return LowBit(fmt, nibbles, planes, np.ascontiguousarray(scales, dtype=np.float32).reshape(-1),
                  None if offsets is None else np.ascontiguousarray(offsets, dtype=np.float32).reshape(-1))


def as_unsigned(lb: LowBit) -> LowBit:
    """``lb`` in the unsigned format of its width (i4 -> u4, i5 -> u5) with ``-zero * scale`` as its
    offsets (exact: the module docstring); unchanged where it is no such format."""
    target = {"i4": "u4", "i5": "u5"}.get(lb.format.name)
    if target is None:
        return lb
    offsets = (np.float32(-lb.format.zero) * lb.scales).astype(np.float32)
    return LowBit(LOWBIT_FORMATS[target], lb.nibbles, lb.planes, lb.scales, offsets)


def dequantize_lowbit_np(lb: LowBit) -> np.ndarray:
    """float32 ``[V]``: the values of ``lb`` (numpy; for tests and checks)."""
    fmt = lb.format
    codes = np.concatenate([lb.nibbles & 0x0F, lb.nibbles >> 4], axis=1)  # [B, 32]
    if lb.planes is not None:
        for p in range(fmt.planes):
            codes = codes | (np.unpackbits(lb.planes[:, 4 * p:4 * p + 4], axis=1, bitorder="little") << (4 + p))
    if fmt.lut is not None:
        values = np.asarray(fmt.lut, dtype=np.float32)[codes]
    else:
        values = codes.astype(np.float32) - np.float32(fmt.zero)
    out = values.reshape(-1, fmt.group) * lb.scales[:, None]
    if lb.offsets is not None:
        out = out.reshape(-1, QK) + lb.offsets[:, None]
    return out.reshape(-1)


__all__ = ["EXACT_TYPES", "LOWBIT_TYPES", "LowBit", "as_unsigned", "dequantize_lowbit_np", "pack_codes", "unpack",
           "unpack_lowbit"]
