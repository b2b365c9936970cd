"""The fused per-layer kernels (csrc/fused_ops.cpp) against their plain PyTorch forms and the model's
own RoPE; the plain fallbacks where the kernels cannot run; the runner turning them on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.models.rope import apply_rope
from pagedkv.ops import fused, native

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


def _cos_sin(t: int, rd: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(t, 1, rd // 2, generator=gen) * 100.0  # [T, 1, rd/2]: positions up to ~100
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@needs_native
@pytest.mark.parametrize(("t", "heads", "kv_heads", "d", "rd"), [
    (1, 9, 3, 64, 64),  # SmolLM2 at batch 1
    (7, 4, 1, 32, 16),  # partial rotary: dims 16.. pass through
    (40, 8, 8, 80, 80),  # many rows (the kernel splits them over threads), head_dim not a power of 2
])
def test_rope_qk_matches_plain_and_the_models_rope(t: int, heads: int, kv_heads: int, d: int, rd: int) -> None:
    gen = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=gen)
    cos, sin = _cos_sin(t, rd, gen)
    want = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    plain_q, plain_k = fused.rope_qk(qkv.clone(), cos, sin, heads, kv_heads, native_on=False)
    work = qkv.clone()
    q, k = fused.rope_qk(work, cos, sin, heads, kv_heads, native_on=True)
    assert q.shape == (t, heads, d) and q.is_contiguous() and k.shape == (t, kv_heads, d)
    assert k.data_ptr() == work[:, heads:].data_ptr()  # k rotated in place, inside qkv
    for got, ref in ((q, want[:, :heads]), (k, want[:, heads:]), (plain_q, want[:, :heads]),
                     (plain_k, want[:, heads:])):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-6)
    assert torch.equal(work[:, heads + kv_heads:], qkv[:, heads + kv_heads:])  # v untouched
    assert torch.equal(work[:, :heads], qkv[:, :heads])  # q read, not written


@needs_native
def test_rope_qk_takes_rows_of_a_wider_tensor() -> None:
    """qkv may be a row slice of a larger buffer (rows strided): the kernel follows the stride."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 2, 6, 16, generator=gen)  # [T, 2, heads, d]: qkv is wide[:, 0]
    qkv = wide[:, 0]
    assert not qkv.is_contiguous()
    cos, sin = _cos_sin(5, 16, gen)
    want = apply_rope(qkv[:, :4], cos, sin)
    q, k = fused.rope_qk(qkv, cos, sin, 3, 1, native_on=True)
    torch.testing.assert_close(q, want[:, :3], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(k, want[:, 3:], atol=2e-6, rtol=1e-6)


@needs_native
@pytest.mark.parametrize(("t", "inter"), [(1, 1536), (3, 13), (33, 200)])  # 13: no full 8-wide vector
def test_silu_mul_matches_plain(t: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(t, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -87.5])  # beyond the exp clamp, and zero
    got = fused.silu_mul(gate_up, native_on=True)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (t, inter)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(fused.silu_mul(gate_up, native_on=False), want, atol=0, rtol=0)


@needs_native
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (19, 100)])
def test_add_rms_norm_matches_plain(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    summed = x + residual
    want = F.rms_norm(summed, (hidden,), weight, 1e-6)
    for native_on in (True, False):
        work = x.clone()
        normed, new_residual = fused.add_rms_norm(work, residual, weight, 1e-6, native_on=native_on)
        assert new_residual.data_ptr() == work.data_ptr()  # the sum is written into x
        torch.testing.assert_close(new_residual, summed, atol=0, rtol=0)
        torch.testing.assert_close(normed, want, atol=2e-6, rtol=1e-5)


def test_fallbacks_for_other_dtypes_and_a_missing_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 (which the kernels do not take) and an extension without the op both run the
    plain forms, with native_on set."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 4, 8, generator=gen)
    cos, sin = _cos_sin(2, 8, gen)
    want = apply_rope(qkv[:, :3], cos, sin)
    q, k = fused.rope_qk(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), 2, 1, native_on=True)
    assert q.dtype == torch.bfloat16
    torch.testing.assert_close(q.float(), want[:, :2], atol=0.05, rtol=0.02)
    monkeypatch.setattr(fused, "_OPS", {"rope_qk": None, "silu_mul": None, "add_rms_norm": None})
    q, k = fused.rope_qk(qkv.clone(), cos, sin, 2, 1, native_on=True)
    torch.testing.assert_close(k, want[:, 2:], atol=2e-6, rtol=1e-6)
    gate_up = torch.randn(2, 8, generator=gen)
    torch.testing.assert_close(fused.silu_mul(gate_up, native_on=True), F.silu(gate_up[:, :4]) * gate_up[:, 4:])


@needs_native
def test_native_runner_turns_the_fused_ops_on() -> None:
    """The fused path is what a native runner runs (the model tests against transformers then
    cover it); a plain runner keeps the reference ops."""
    from pagedkv.models.config import ModelConfig
    from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
    from pagedkv.runner import ModelRunner

    config = ModelConfig(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    for backend, on in (("native", True), ("plain", False)):
        runner = ModelRunner(LlamaForCausalLM(config), block_size=4, num_blocks=16, attention_backend=backend)
        flags = [m.native for m in runner.model.modules() if isinstance(m, (LlamaAttention, LlamaMLP))]
        assert len(flags) == 4 and all(f is on for f in flags), backend
