"""A pool that mixes KV formats per block: full-precision blocks (ids below ``base``) beside 8-bit
ones (ids from ``base``, with their scales), one block table mixing both.

- the native kernel (``paged_attention_mixed``) against the plain reference, block by block, for
  every float format x every 8-bit format, block sizes 1/3/16/64, GQA shapes, the vector and the
  portable path, sliding windows and soft-capped scores;
- copy-on-write within a format and across formats (8-bit -> full exact, full -> 8-bit by the
  write kernel's whole-block rule);
- the runner over a mixed pool: blocks in the full range give the float32 pool's logits, blocks in
  the 8-bit range the int8 pool's.
- ``kv_quant_parts`` "v" (K at the model dtype, V 8-bit): the kernel over tables mixing full,
  K-full/V-8-bit and 8-bit blocks; the runner's write, plain path, swap and payloads; the engine's
  outputs across swap, recompute, forks and a disk-tier restart (parametrized beside "kv").
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.ops import native
from pagedkv.ops.cache_ops import copy_blocks_mixed
from pagedkv.ops.kv_format import dequantize, kv_format, quantize
from pagedkv.ops.paged_attention import NativeMetadata, QuantBlocks, native_paged_attention
from pagedkv.ops.reference import reference_paged_attention
from pagedkv_testing.paged_cases import mixed_case

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# PAGEDKV_KV_FORMAT_FULL_MATRIX=1: every float x 8-bit format x head dim, every block size x GQA
# shape, and the default model's greedy target; by default a slice where each value appears once.
FULL_MATRIX = os.environ.get("PAGEDKV_KV_FORMAT_FULL_MATRIX") == "1"
FORMAT_CASES = ([(f, k, d) for f in FLOATS for k in KINDS for d in (24, 64, 128)] if FULL_MATRIX
                else [(torch.float32, "int8", 24), (torch.bfloat16, "fp8_e4m3", 64), (torch.float16, "fp8_e5m2", 128),
                      (torch.float32, "fp8_e4m3", 128)])
SHAPES = [(4, 4), (9, 3), (8, 1)]
LAYOUT_CASES = ([(b, h, k) for b in (1, 3, 16, 64) for h, k in SHAPES] if FULL_MATRIX
                else [(b, *SHAPES[i % 3]) for i, b in enumerate((1, 3, 16, 64))])


def _check(q, kc, vc, quant: QuantBlocks, tables, row_seq, row_len, **kw):
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.empty_like(q), q, kc, vc, meta, quant=quant, **kw)
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len, k_scales=quant.k_scales,
                                         v_scales=quant.v_scales, k_quant=quant.k_quant, v_quant=quant.v_quant,
                                         base=quant.base, k_base=quant.k_base, **kw)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("parts", ["v", "three"])
@pytest.mark.parametrize("full_dtype,kind,d,block_size,heads,kvh", [
    (torch.float32, "int8", 64, 16, 8, 2), (torch.bfloat16, "fp8_e4m3", 24, 3, 9, 3),
    (torch.float16, "fp8_e5m2", 128, 1, 4, 4), (torch.float32, "int8", 40, 64, 8, 1)])
def test_k_at_full_precision_beside_8bit_v(parts, full_dtype, kind, d, block_size, heads, kvh):
    """K and V with a base each (``kv_quant_parts`` "v": every K full precision; "three": one table
    holding full blocks, K-full/V-8-bit blocks and 8-bit ones), vector and portable paths, with
    and without a sliding window."""
    case = mixed_case(kind, full_dtype, d + block_size, block_size, heads, kvh, d, [1, 37, 150, 90], [1, 5, 1, 20],
                      parts)
    quant = case[3]
    assert quant.base < quant.key_base <= quant.base + quant.v_quant.shape[0]
    _check(*case)
    _check(*case, sliding_window=33)


@needs_native
@pytest.mark.parametrize("full_dtype,kind,d", FORMAT_CASES)  # d 64, 128: the vector path on AVX2; 24 the portable
def test_every_float_and_8bit_format_in_one_table(full_dtype, kind, d):
    lens, new = [1, 37, 150, 90], [1, 5, 1, 20]
    case = mixed_case(kind, full_dtype, d + len(kind), 16, 8, 2, d, lens, new)
    _check(*case)


@needs_native
@pytest.mark.parametrize("block_size,heads,kvh", LAYOUT_CASES)
def test_block_sizes_and_gqa_shapes(block_size, heads, kvh):
    lens, new = [2, 40, 130], [1, 7, 1]
    for d in (32, 64):
        _check(*mixed_case("int8", torch.float32, block_size * 10 + heads + d, block_size, heads, kvh, d, lens, new))


@needs_native
@pytest.mark.parametrize("d", [40, 64])
def test_sliding_window_and_soft_cap(d):
    q, kc, vc, quant, tables, row_seq, row_len = mixed_case("fp8_e4m3", torch.bfloat16, 7, 16, 6, 2, d,
                                                            [200, 60], [1, 12])
    _check(q, kc, vc, quant, tables, row_seq, row_len, sliding_window=33)
    _check(q * 4, kc, vc, quant, tables, row_seq, row_len, softcap=2.0)


@needs_native
def test_the_format_is_read_per_block():
    """The same K/V read through a table of full-precision blocks and through one of 8-bit blocks:
    the full table gives the float attention exactly, the 8-bit one only within int8's error."""
    q, kc, vc, quant, _, _, _ = mixed_case("int8", torch.float32, 3, 4, 4, 2, 64, [40], [1])  # base 4
    fmt = kv_format("int8")
    for cache, stored, scales in ((kc, quant.k_quant, quant.k_scales), (vc, quant.v_quant, quant.v_scales)):
        scales[:3] = cache[:3].abs().amax(dim=(1, 3)) / fmt.qmax  # blocks 0-2 again, 8-bit, at base..base+2
        stored[:3] = quantize(cache[:3], fmt, scales[:3, None, :, None])
    q = q[:1]
    full_table, quant_table = [[0, 1, 2]], [[quant.base, quant.base + 1, quant.base + 2]]
    meta = NativeMetadata.build(full_table, [0], [12])
    out_full = native_paged_attention(torch.empty_like(q), q, kc, vc, meta, quant=quant)
    float_ref = reference_paged_attention(q, kc, vc, full_table, [0], [12])
    torch.testing.assert_close(out_full, float_ref, atol=2e-5, rtol=1e-4)
    meta = NativeMetadata.build(quant_table, [0], [12])
    out_quant = native_paged_attention(torch.empty_like(q), q, kc, vc, meta, quant=quant)
    assert 0 < (out_quant - float_ref).abs().max() < 0.03


@pytest.mark.parametrize("kind", KINDS)
def test_copy_on_write_within_and_across_formats(kind):
    fmt = kv_format(kind)
    gen = torch.Generator().manual_seed(1)
    layers, base, num_quant, bs, kvh, d = 2, 3, 4, 4, 2, 8
    full = torch.randn(layers, 2, base, bs, kvh, d, generator=gen)
    x = torch.randn(layers, 2, num_quant, bs, kvh, d, generator=gen)
    scales = x.abs().amax(dim=(3, 5)) / fmt.qmax  # [layers, 2, num_quant, kvh]
    qkv = quantize(x, fmt, scales[:, :, :, None, :, None])
    before_full, before_q, before_s = full.clone(), qkv.clone(), scales.clone()
    # full 0 -> full 1; 8-bit 3 -> 8-bit 4; 8-bit 5 -> full 2; full 0 -> 8-bit 6 (ids: base = 3)
    copy_blocks_mixed(full, qkv, scales, fmt, [(0, 1), (3, 4), (5, 2), (0, 6)])
    assert torch.equal(full[:, :, 1], before_full[:, :, 0])
    assert torch.equal(qkv[:, :, 1].view(torch.uint8), before_q[:, :, 0].view(torch.uint8))
    assert torch.equal(scales[:, :, 1], before_s[:, :, 0])
    exact = dequantize(before_q[:, :, 2], fmt, before_s[:, :, 2][:, :, None, :, None])
    assert torch.equal(full[:, :, 2], exact)  # 8-bit -> full precision loses nothing
    back = dequantize(qkv[:, :, 3], fmt, scales[:, :, 3][:, :, None, :, None])
    expected_scale = before_full[:, :, 0].abs().amax(dim=(2, 4)) / fmt.qmax
    torch.testing.assert_close(scales[:, :, 3], expected_scale)
    assert float((back - before_full[:, :, 0]).abs().max()) <= float(expected_scale.max()) * (0.51 if kind == "int8"
                                                                                             else fmt.qmax / 8)
    with pytest.raises(ValueError, match="destination block appears twice"):
        copy_blocks_mixed(full, qkv, scales, fmt, [(0, 1), (3, 1)])


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_plain_write_stores_the_native_bytes(kind):
    """The write rule in plain PyTorch (the plain backend's write without the native kernels):
    runs opening blocks, runs growing a filled block's scale and runs that do not, bit for bit
    the native kernel's bytes, scales and error sums."""
    from pagedkv.ops.cache_ops import write_kv_scaled_plain

    gen = torch.Generator().manual_seed(len(kind))
    storage = kv_format(kind).storage
    native_cache, plain_cache = torch.zeros(5, 4, 2, 8, dtype=storage), torch.zeros(5, 4, 2, 8, dtype=storage)
    native_scales, plain_scales = torch.zeros(5, 2), torch.zeros(5, 2)
    native_err, plain_err = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    for slots, gain in (([0, 1, 4, 5, 6], 1.0), ([2, 7], 4.0), ([3, 8, 9, 10, 11, 12], 0.5), ([13], 9.0)):
        x = torch.randn(len(slots), 2, 8, generator=gen) * gain
        torch.ops.pagedkv.write_kv_scaled(native_cache, native_scales, x, torch.tensor(slots), native_err)
        write_kv_scaled_plain(plain_cache, plain_scales, x, torch.tensor(slots), plain_err)
    assert torch.equal(native_cache.view(torch.uint8), plain_cache.view(torch.uint8))
    assert torch.equal(native_scales, plain_scales)
    torch.testing.assert_close(native_err, plain_err)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("kvmixed"), "llama", seed=11)


@needs_native
def test_runner_reads_each_block_in_its_format(tiny_folder):
    """A mixed runner (ids 0-15 float32, 16-47 int8): a sequence in full-precision blocks gives the
    float32 pool's logits, one in 8-bit blocks exactly the int8 pool's, one mixing both lies
    close to both; copy-on-write across the formats keeps the logits."""
    from pagedkv.models.loader import load_model
    from pagedkv.runner import ModelRunner, SeqChunk

    loaded = load_model(str(tiny_folder))
    mixed = ModelRunner(loaded, block_size=4, num_blocks=48, kv_cache_dtype="int8", kv_full_blocks=16)
    assert mixed.cache.is_mixed and mixed.kv_full_blocks == 16 and mixed.cache.kv.dtype == torch.float32
    assert mixed.cache.block_format(15).name == "float32" and mixed.cache.block_format(16).name == "int8"
    f32 = ModelRunner(loaded, block_size=4, num_blocks=48, kv_cache_dtype="float32")
    i8 = ModelRunner(loaded, block_size=4, num_blocks=48, kv_cache_dtype="int8")
    prompt = list(range(7, 30))  # 23 tokens: 6 blocks

    def run(runner, table):
        runner.execute([SeqChunk(prompt[:10], 0, table)])
        return runner.execute([SeqChunk(prompt[10:], 10, table, all_logits=True)])

    full_table, quant_table, both = [0, 1, 2, 3, 4, 5], [16, 17, 18, 19, 20, 21], [6, 22, 23, 24, 25, 26]
    torch.testing.assert_close(run(mixed, full_table), run(f32, full_table), atol=2e-4, rtol=1e-4)
    assert torch.equal(run(mixed, quant_table), run(i8, quant_table))
    mixed_logits, reference = run(mixed, both), run(f32, full_table)
    assert not torch.equal(mixed_logits, run(i8, quant_table))  # its first block was read at full precision
    assert float((mixed_logits - reference).norm() / reference.norm()) < 0.02  # int8's bound (test_kv_quant)
    # copy-on-write across the formats: 8-bit block 16 -> full block 5 exactly; a decode reading
    # the copy in place of the original attends to the same values
    mixed.copy_blocks([(16, 5)])
    via_copy = mixed.execute([SeqChunk([99], 23, [5, *quant_table[1:]])])
    via_original = mixed.execute([SeqChunk([99], 23, quant_table)])
    torch.testing.assert_close(via_copy, via_original, atol=1e-5, rtol=1e-5)
    assert mixed.payload_bytes == 1 + mixed.cache.bytes_per_full_block  # the larger format, and its byte


@pytest.mark.parametrize("backend,parts", [("plain", "kv"), ("plain", "v"),
                                           pytest.param("triton", "kv", marks=pytest.mark.slow),  # interpreter: ~10 s
                                           pytest.param("triton", "v", marks=pytest.mark.slow)])
def test_every_backend_reads_a_mixed_pool(tiny_folder, backend, parts):
    """The plain and Triton backends over a mixed pool (writes into each block's storage, each
    block read in its format): a prefill, an extend and decodes of two sequences whose tables mix
    both formats give the native kernels' logits and store the same bytes (``kv_quant_parts``
    "v": K of every block stored as it is)."""
    from pagedkv.models.loader import load_model
    from pagedkv.ops.triton import usable_on
    from pagedkv.runner import ModelRunner, SeqChunk

    if backend == "triton" and not usable_on("cpu"):
        pytest.skip("Triton's interpreter is unavailable")
    if not native.available():
        pytest.skip("the native kernels are the reference here")
    loaded = load_model(str(tiny_folder))
    runners = [ModelRunner(loaded, block_size=4, num_blocks=24, kv_cache_dtype="int8", kv_full_blocks=6,
                           attention_backend=b, kv_quant_parts=parts) for b in ("native", backend)]
    tables = [[0, 9, 10, 11, 12], [1, 2, 13, 14, 15]]
    steps = [[SeqChunk(list(range(5, 14)), 0, tables[0], all_logits=True)],
             [SeqChunk(list(range(20, 26)), 0, tables[1]), SeqChunk([7, 8, 9], 9, tables[0])],
             [SeqChunk([3], 12, tables[0]), SeqChunk([4], 6, tables[1])],
             [SeqChunk([5], 13, tables[0]), SeqChunk([6], 7, tables[1])]]
    for step in steps:
        expected, got = (r.execute(step) for r in runners)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    ref, other = (r.cache for r in runners)
    torch.testing.assert_close(other.kv, ref.kv, atol=1e-5, rtol=1e-5)
    assert float((other.quant_kv.float() - ref.quant_kv.float()).abs().max()) <= 1  # a rounding step at most
    torch.testing.assert_close(other.scales, ref.scales, atol=1e-6, rtol=1e-4)
    if parts == "v":
        assert ref.keys is not None and other.keys is not None and ref.keys.dtype == torch.float32
        torch.testing.assert_close(other.keys, ref.keys, atol=1e-5, rtol=1e-5)
        assert bool(ref.keys[:, :, 9:16].abs().sum() > 0)  # K of the 8-bit-V blocks, at full precision


@needs_native
def test_v_only_8bit_lies_between_float32_and_int8(tiny_folder):
    """``kv_quant_parts`` "v" over one table of 8-bit-V blocks: its K is the float32 pool's, so its
    logits lie nearer the float32 pool's than an all-int8 pool's do; its K error sums stay 0."""
    from pagedkv.models.loader import load_model
    from pagedkv.runner import ModelRunner, SeqChunk

    loaded = load_model(str(tiny_folder))
    runners = {name: ModelRunner(loaded, block_size=4, num_blocks=24, kv_cache_dtype=kind, kv_quant_parts=parts)
               for name, kind, parts in (("f32", "float32", "kv"), ("i8", "int8", "kv"), ("v", "int8", "v"))}
    assert runners["v"].cache.is_mixed and runners["v"].kv_full_blocks == 0
    table, prompt = [3, 9, 12, 20, 1, 7], list(range(7, 30))
    logits = {name: r.execute([SeqChunk(prompt, 0, table, all_logits=True)]) for name, r in runners.items()}
    ref = logits["f32"]
    err_v, err_i8 = (float((logits[n] - ref).norm() / ref.norm()) for n in ("v", "i8"))
    assert 0 < err_v < err_i8, (err_v, err_i8)
    sums = runners["v"].write_error
    assert sums is not None and float(sums[:, 0].abs().sum()) == 0 and float(sums[:, 1, 1].sum()) > 0


@pytest.mark.parametrize("kind", ["int8", "fp8_e5m2", "bfloat16"])
def test_plain_backend_reads_single_format_pools(tiny_folder, kind):
    """The plain backend over an all-8-bit (or another float dtype's) pool: the step's blocks read
    into the model dtype give the native kernels' logits, and the same stored bytes."""
    from pagedkv.models.loader import load_model
    from pagedkv.runner import ModelRunner, SeqChunk

    if not native.available():
        pytest.skip("the native kernels are the reference here")
    loaded = load_model(str(tiny_folder))
    runners = [ModelRunner(loaded, block_size=4, num_blocks=12, kv_cache_dtype=kind, attention_backend=b)
               for b in ("native", "plain")]
    steps = [[SeqChunk(list(range(5, 14)), 0, [3, 7, 1], all_logits=True)],
             [SeqChunk(list(range(20, 26)), 0, [0, 2]), SeqChunk([7, 8], 9, [3, 7, 1])],
             [SeqChunk([3], 11, [3, 7, 1]), SeqChunk([4], 6, [0, 2])]]
    for step in steps:
        expected, got = (r.execute(step) for r in runners)
        torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-4)
    ref, other = (r.cache for r in runners)
    assert float((other.kv.float() - ref.kv.float()).abs().max()) <= (1 if kind == "int8" else 0.1)
    if ref.scales is not None:
        torch.testing.assert_close(other.scales, ref.scales, atol=1e-6, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("parts", ["kv", "v"])
def test_swap_keeps_each_block_in_its_format(tiny_folder, parts):
    """Device -> host -> device: a block comes back byte for byte (scales too) into a block of its
    format; an 8-bit block swapped into a full-precision block is dequantized exactly, a
    full-precision one into an 8-bit block quantized by the whole-block rule (``kv_quant_parts``
    "v": the same for V, K comes back as it was); the host blocks' payloads load back alike."""
    from pagedkv.models.loader import load_model
    from pagedkv.ops.kv_format import dequantize
    from pagedkv.runner import ModelRunner, SeqChunk

    runner = ModelRunner(load_model(str(tiny_folder)), block_size=4, num_blocks=24, num_host_blocks=6,
                         kv_cache_dtype="int8", kv_full_blocks=8, kv_quant_parts=parts)
    cache, fmt = runner.cache, runner.cache.format
    runner.execute([SeqChunk(list(range(5, 16)), 0, [2, 9, 12])])  # 11 tokens: a full block, then two 8-bit
    keys = cache.keys if cache.keys is not None else torch.zeros(1, 1, 24)  # ("kv": K is in kv / quant_kv)
    keys_before = keys[:, :, [2, 9, 12]].clone()
    full_before = cache.kv[:, :, 2].clone()
    quant_before = cache.quant_kv[:, :, [1, 4]].clone()  # ids 9 and 12: base 8
    scales_before = cache.scales[:, :, [1, 4]].clone()
    runner.swap_out([(2, 0), (9, 1), (12, 5)])
    assert cache.host_full[:2] == [True, False] and cache.host_full[5] is False
    cache.kv.zero_()
    cache.quant_kv.zero_()
    cache.scales.zero_()
    keys.zero_()
    payloads = runner.host_block_payloads([0, 1, 5])
    assert [p[0] for p in payloads] == ([1, 0, 0] if parts == "kv" else [2, 3, 3])  # the format byte
    runner.load_host_blocks([(2, payloads[0]), (3, payloads[1]), (4, payloads[2])])  # copies of 0, 1, 5
    assert runner.host_block_payloads([2, 3, 4]) == payloads
    runner.swap_in([(0, 3), (1, 10), (5, 20)])  # each back into a block of its own format
    assert torch.equal(keys[:, :, [3, 10, 20]], keys_before)
    assert torch.equal(cache.kv[:, :, 3], full_before)
    assert torch.equal(cache.quant_kv[:, :, [2, 12]].view(torch.uint8), quant_before.view(torch.uint8))
    assert torch.equal(cache.scales[:, :, [2, 12]], scales_before)
    runner.swap_in([(3, 4), (2, 15)])  # across: 8-bit -> full exactly, full -> 8-bit by the block rule
    assert torch.equal(keys[:, :, [4, 15]], keys_before[:, :, [1, 0]])
    exact = dequantize(quant_before[:, :, 0], fmt, scales_before[:, :, 0][:, :, None, :, None])
    assert torch.equal(cache.kv[:, :, 4], exact)
    back = dequantize(cache.quant_kv[:, :, 7], fmt, cache.scales[:, :, 7][:, :, None, :, None])
    assert float((back - full_before).abs().max()) <= float(cache.scales[:, :, 7].max()) * 0.51


def test_mixed_pool_sizing_and_refusals(tiny_folder):
    from pagedkv.models.loader import load_model
    from pagedkv.runner.kv_cache import KVCache, bytes_per_block, mixed_split

    config = load_model(str(tiny_folder)).config
    full, quant = mixed_split(config, 16, "4MiB", "int8", "float32", 1 / 64)
    used = full * bytes_per_block(config, 16, "float32") + quant * bytes_per_block(config, 16, "int8")
    assert used <= 4 << 20 and (4 << 20) - used < bytes_per_block(config, 16, "int8")
    assert abs(full / (full + quant) - 1 / 64) < 0.01
    cache = KVCache(config, block_size=16, num_blocks=full + quant, dtype="int8", full_blocks=full)
    assert cache.device_bytes == used  # the tensors take what the formula says
    with_host = KVCache(config, block_size=16, num_blocks=8, num_host_blocks=2, dtype="int8", full_blocks=2)
    assert with_host.host_bytes == 2 * (bytes_per_block(config, 16, "int8") + bytes_per_block(config, 16, "float32"))
    with pytest.raises(ValueError, match="8-bit kv_cache_dtype"):
        KVCache(config, block_size=16, num_blocks=8, dtype="float32", full_blocks=2)


def test_v_only_8bit_sizing_and_refusals(tiny_folder):
    """``kv_quant_parts`` "v": a block's bytes count K at the model dtype, V 8-bit and V's scales
    alone; the tensors take what the formula says (device and host); "k" or "v" with a float
    kind are refused naming the accepted values or why."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.model_shape import kv_bytes_per_block
    from pagedkv.models.loader import load_model
    from pagedkv.runner.kv_cache import KVCache, bytes_per_block, host_bytes_per_block, mixed_split

    config = load_model(str(tiny_folder)).config
    layers, kvh, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    v_block = bytes_per_block(config, 16, "int8", "float32")
    assert v_block == layers * kvh * (16 * d * (4 + 1) + 4)  # K float32, V int8, one scale per V head
    assert v_block == kv_bytes_per_block(config, 16, "int8", k_dtype="float32")
    for full in (0, 3):
        cache = KVCache(config, block_size=16, num_blocks=8, num_host_blocks=2, dtype="int8", full_blocks=full,
                        quant_parts="v")
        f32 = bytes_per_block(config, 16, "float32")
        assert cache.device_bytes == full * f32 + (8 - full) * v_block
        assert cache.host_bytes == 2 * host_bytes_per_block(config, 16, "int8", "float32" if full else None,
                                                            "float32")
    full, quant = mixed_split(config, 16, "4MiB", "int8", "float32", 1 / 16, "float32")
    assert (4 << 20) - v_block < full * f32 + quant * v_block <= 4 << 20
    with pytest.raises(ValueError, match="must be one of kv, v"):
        EngineConfig(kv_cache_dtype="int8", kv_quant_parts="k")
    with pytest.raises(ValueError, match="needs an 8-bit kv cache dtype"):
        EngineConfig(kv_cache_dtype="bfloat16", kv_quant_parts="v")
    with pytest.raises(ValueError, match="needs an 8-bit kv cache dtype"):
        EngineConfig(kv_quant_parts="v")  # auto: the model dtype
    with pytest.raises(ValueError, match="8-bit kv cache dtype"):
        KVCache(config, block_size=16, num_blocks=8, dtype="float32", quant_parts="v")
    EngineConfig(kv_cache_dtype="fp8", kv_quant_parts="v")  # (an alias of an 8-bit kind)


def _run(engine, prompts, params_of):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params_of(i))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [c.token_ids for c in out.outputs]
    return results


@needs_native
def test_engine_with_sink_blocks_and_a_full_precision_request(tiny_folder):
    """An int8 engine with one sink block a sequence: sinks in full-precision blocks (integrity
    checked every step), outputs close to the float32 engine's; a request asking for float32 KV
    gets exactly the float32 engine's tokens, and shares no block with the int8 requests of the
    same prompt."""
    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine
    from pagedkv.engine.errors import RequestRejectedError

    prompt = list(range(3, 40))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, kv_cache_dtype="float32")
    base = dict(block_size=4, num_kv_blocks=96, kv_offloading_size=0, debug_integrity=True, max_model_len=64)
    f32 = _run(LLMEngine.from_options(str(tiny_folder), **base), [prompt], lambda i: greedy)
    engine = LLMEngine.from_options(str(tiny_folder), kv_cache_dtype="int8", kv_sink_blocks=1, **base)
    assert engine.runner.kv_full_blocks == 16  # one request of max_model_len at full precision
    got = _run(engine, [prompt, prompt, list(prompt)], lambda i: full if i == 1 else greedy)
    assert got["r1"] == f32["r0"]  # the full-precision request: the float32 pool's tokens
    stats = engine.kv.stats()
    assert stats.full_precision_blocks == engine.runner.kv_full_blocks
    assert stats.free_full_precision_blocks <= stats.full_precision_blocks
    # a full-precision request is turned away by a pool without full-precision blocks
    plain = LLMEngine.from_options(str(tiny_folder), kv_cache_dtype="int8", **base)
    with pytest.raises(RequestRejectedError, match="kv_sink_blocks"):
        plain.add_request("x", prompt, full)
    with pytest.raises(RequestRejectedError, match="fp8_e5m2"):
        engine.add_request("y", prompt, SamplingParams(kv_cache_dtype="fp8_e5m2"))


@needs_native
def test_engine_mixed_pool_host_tier_reload(tiny_folder):
    """A prompt's cached blocks evicted from a small mixed pool to the host tier come back on its
    next turn (host hits) into blocks of their formats, and the output is the first turn's."""
    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine

    engine = LLMEngine.from_options(str(tiny_folder), block_size=4, num_kv_blocks=32, kv_offloading_size=0.01,
                                    kv_cache_dtype="int8", kv_sink_blocks=1, debug_integrity=True, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 35))
    first = _run(engine, [prompt], lambda i: params)["r0"]
    for j in range(4):  # other prompts take the device blocks: the first prompt's go to the host
        engine.add_request(f"o{j}", [200 + j] * 40, params)
        while engine.has_unfinished_requests():
            engine.step()
    again = _run(engine, [prompt], lambda i: params)["r0"]
    stats = engine.kv.stats()
    assert stats.host_hit_tokens > 0 and stats.reloaded_blocks > 0
    assert again == first


@needs_native
@pytest.mark.parametrize("mode,kinds,parts,recent", [("swap", "swap+evict+alloc", "kv", False),
                                                     ("recompute", "recompute+evict+alloc", "kv", False),
                                                     ("swap", "swap+evict+alloc", "v", False),
                                                     ("swap", "swap+evict+alloc", "kv", True),
                                                     ("recompute", "recompute+evict+alloc", "kv", True)])
def test_engine_mixed_pool_under_faults_and_forks(tiny_folder, mode, kinds, parts, recent):
    """Seeded faults (swap or recompute preemption, evictions, allocation failures) on a small mixed
    pool with a host tier, forked (n=3) requests sharing blocks copy-on-write: every request
    finishes with all its tokens, integrity holds after every step, no block leaks; the undisturbed
    run's tokens nearly all agree (a recompute re-prefills a block whose 8-bit scale had grown token
    by token; a swapped block may come back into the other format when its own has none free).
    ``recent``: with ``kv_recent_block`` (tail blocks read from shadows; a swapped-in, copied or
    reused block reads its 8-bit bytes)."""
    import random

    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 30, 14, 22, 9, 41, 3, 18)]

    def params(i):
        return SamplingParams(temperature=0, n=3 if i % 3 == 2 else 1, max_tokens=12 + i, ignore_eos=True)

    options = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=40, kv_offloading_size=0.001,
                   preemption_mode=mode, debug_integrity=True, kv_cache_dtype="int8", kv_sink_blocks=1,
                   kv_quant_parts=parts, kv_recent_block=recent,
                   max_num_seqs=6 if recent else 64)  # (recent: fewer shadows than sequences, some reclaimed)
    expected = _run(LLMEngine.from_options(str(tiny_folder), **{**options, "num_kv_blocks": 400}), prompts, params)
    same = total = preemptions = 0
    for seed in range(2):
        faults = f"seed={seed},rate=0.15,kinds={kinds}"
        engine = LLMEngine.from_options(str(tiny_folder), fault_injection=faults, **options)
        got = _run(engine, prompts, params)
        assert got.keys() == expected.keys()
        for rid, outs in expected.items():
            assert [len(o) for o in got[rid]] == [len(o) for o in outs], rid
            for a, b in zip(got[rid], outs):
                same += sum(x == y for x, y in zip(a, b))
                total += len(b)
        stats = engine.stats()
        assert stats.kv.used_blocks == 0 and stats.kv.host_used_blocks == 0
        preemptions += stats.preemptions_recompute + stats.preemptions_swap
        if recent:
            assert engine.runner.kv_recent_blocks == 6 and engine.runner._recent.written_through > 0
    assert preemptions > 2
    assert same / total >= 0.9, f"{same} of {total} tokens equal the undisturbed run's"


@pytest.mark.slow
@needs_native
@pytest.mark.skipif(not FULL_MATRIX, reason="about a minute: PAGEDKV_KV_FORMAT_FULL_MATRIX=1 (bench/kv_quant.py "
                                            "reports the same figure)")
def test_default_model_one_sink_block_greedy_matches_float32():
    """The bundled model, greedy, 16 prompts of 32 tokens (windows of the shipped English text),
    32 new tokens, int8 blocks with the first block of each sequence at float32: at least 10 of
    the 16 outputs equal the float32 engine's (the issue's target; measured 12, with these
    prompts and with bench/kv_quant.py's, 2026-12-02)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv_testing import TEST_DATA

    text = (TEST_DATA / "declaration_of_independence.txt").read_text()
    outputs = {}
    for kind, sinks in (("float32", 0), ("int8", 1)):
        llm = LLM(kv_cache_dtype=kind, kv_cache_memory="256MiB", kv_sink_blocks=sinks, max_model_len=2048)
        assert llm.engine.runner.kv_full_blocks > 0 if sinks else llm.engine.runner.kv_full_blocks == 0
        tokens = llm.get_tokenizer().encode(text)
        prompts = [tokens[i * 100:i * 100 + 32] for i in range(16)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        outputs[kind] = [o.outputs[0].token_ids for o in outs]
    equal = sum(a == b for a, b in zip(outputs["float32"], outputs["int8"]))
    print(f"int8 + 1 sink block equals float32 on {equal} of 16 prompts")
    assert equal >= 10, f"int8 with one sink block equals float32 on {equal} of 16 prompts"


@needs_native
@pytest.mark.parametrize("parts,recent", [("kv", False), ("v", False), ("kv", True)])
def test_disk_tier_restart_serves_a_mixed_pool(tiny_folder, tmp_path, parts, recent):
    """The disk tier under a mixed pool: block files carry each block's format; after a restart
    the prompt's blocks are read back (disk hits) and the output equals the first run's. A
    payload of another format byte or size is refused, writing nothing. The other
    ``kv_quant_parts``' pool (payloads of the same size) finds none of these blocks: its own run."""
    from pagedkv import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 43))
    options = dict(block_size=4, num_kv_blocks=40, kv_offloading_size=0.002, kv_cache_dtype="int8", kv_sink_blocks=1,
                   debug_integrity=True, max_model_len=64, kv_offload_dir=str(tmp_path / "kv"), kv_quant_parts=parts,
                   kv_recent_block=recent)
    full_byte, quant_byte = (1, 0) if parts == "kv" else (2, 3)
    with LLM(str(tiny_folder), **options) as llm:
        first = llm.generate([prompt], params)[0].outputs[0].token_ids
        runner = llm.engine.runner
        payloads = runner.block_payloads([0, runner.kv_full_blocks])  # a full-precision and an 8-bit block
        assert payloads[0][0] == full_byte and payloads[1][0] == quant_byte and len(payloads[0]) == len(payloads[1])
        with pytest.raises(ValueError, match="format byte"):
            runner.load_host_blocks([(0, b"\x07" + payloads[0][1:])])
        with pytest.raises(ValueError, match="format byte"):  # the other parts' bytes (same size: see below)
            runner.load_host_blocks([(0, bytes([3 if parts == "kv" else 1]) + payloads[0][1:])])
    assert list((tmp_path / "kv" / "blocks").glob("*/*.kvb"))
    with LLM(str(tiny_folder), **options) as llm:
        again = llm.generate([prompt], params)[0]
        assert llm.engine.kv.stats().disk_hit_tokens > 0
    assert again.outputs[0].token_ids == first
    other = {**options, "kv_quant_parts": "v" if parts == "kv" else "kv"}
    with LLM(str(tiny_folder), **{**other, "kv_offload_dir": None}) as llm:
        own = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert llm.engine.runner.payload_bytes == len(payloads[0])  # only the fingerprint tells them apart
    with LLM(str(tiny_folder), **other) as llm:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == own
        assert llm.engine.kv.stats().disk_hit_tokens == 0


@needs_native
def test_hybrid_model_with_a_mixed_pool(tmp_path):
    """A model with sliding-window and global layers (Gemma 3: KV groups with tables of their own)
    over a mixed pool: every group's sink block is full precision, integrity holds every step, and
    the greedy tokens stay close to the float32 pool's."""
    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine
    from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path, "gemma3", seed=5, num_hidden_layers=4, sliding_window=6,
                                sliding_window_pattern=3, head_dim=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (30, 9, 21)]
    base = dict(block_size=4, num_kv_blocks=120, kv_offloading_size=0, debug_integrity=True, max_model_len=64)
    f32 = _run(LLMEngine.from_options(str(folder), **base), prompts, lambda i: params)
    engine = LLMEngine.from_options(str(folder), kv_cache_dtype="int8", kv_sink_blocks=1, **base)
    assert len(engine.runner.kv_groups) > 1 and engine.runner.kv_full_blocks > 0
    got = _run(engine, prompts, lambda i: params)
    same = sum(x == y for rid in f32 for x, y in zip(got[rid][0], f32[rid][0]))
    assert same >= 0.8 * sum(len(o[0]) for o in f32.values()), f"{same} tokens equal the float32 run's"
