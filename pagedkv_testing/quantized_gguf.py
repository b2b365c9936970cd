"""Tiny llama GGUF files with chosen tensor types (no tokenizer), for the quantized-weight and LoRA
tests.

The gguf package quantizes only Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 in Python; the K-quant tensors
(Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL ones are random blocks (any bytes are a valid block) with their fp16 scales set so
the values have the wanted spread."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 96, 128


# fp16 fields of K-quant blocks (byte offset -> value before scaling): d, and dmin balancing the mean
_K_FIELDS = {Q.Q4_K: {0: 1.0, 2: 7.5}, Q.Q5_K: {0: 1.0, 2: 15.5}, Q.Q6_K: {208: 1.0}, Q.IQ4_NL: {0: 1.0},
            Q.Q3_K: {108: 1.0}}


def _random_k_quant(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, std: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks for a ``shape`` tensor, values of about ``std``: uint8 ``[..., rows, row bytes]``."""
    block, width = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (int(np.prod(shape)) // block, width), dtype=np.uint8)

    def put(c: float) -> None:
        for at, v in _K_FIELDS[qtype].items():
            raw[:, at:at + 2] = np.full(len(raw), c * v, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    put(1.0)
    put(std / float(dequantize(raw, qtype).std()))
    return raw.reshape(*shape[:-1], -1)


def write_gguf(path: Path, types: dict[str, gguf.GGMLQuantizationType], tied: bool = True, seed: int = 0,
                hidden: int = HIDDEN, ffn: int = FFN, experts: int = 0) -> None:
    """A tiny llama GGUF (no tokenizer); ``types`` maps a tensor-name suffix (``attn_q.weight``,
    ``token_embd.weight``, ...) to its type, F32 for the rest (K-quants need inputs of 256).
    ``experts`` > 0: Mixtral's layout (llama with a router ``ffn_gate_inp`` and ``experts`` experts
    of ``ffn`` in ``ffn_{gate,up,down}_exps``, two used per token) instead of the dense MLP."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    head_dim = hidden // HEADS
    shapes = {"token_embd.weight": (VOCAB, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, hidden)
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.{k}": v for k, v in {
            "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
            "attn_q.weight": (HEADS * head_dim, hidden), "attn_k.weight": (KV_HEADS * head_dim, hidden),
            "attn_v.weight": (KV_HEADS * head_dim, hidden), "attn_output.weight": (hidden, HEADS * head_dim),
        }.items()}
        shapes |= {f"blk.{i}.{k}": v for k, v in ({
            "ffn_gate_inp.weight": (experts, hidden), "ffn_gate_exps.weight": (experts, ffn, hidden),
            "ffn_up_exps.weight": (experts, ffn, hidden), "ffn_down_exps.weight": (experts, hidden, ffn),
        } if experts else {
            "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
        }).items()}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        std = 1.0 if "token_embd" in name else 1 / np.sqrt(shape[-1])
        arr = (rng.standard_normal(shape) * std).astype(np.float32)
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype in _K_FIELDS:
            w.add_tensor(name, _random_k_quant(shape, qtype, std, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Q8_0 and Q4_0 are Q8_0 exactly: the quantized model computes with the very weights of the float one
EXACT = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
         "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q8_0}
