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
"""

from __future__ import annotations

import numpy as np

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


__all__ = ["EXACT_TYPES", "unpack"]
