"""The native kernels (``csrc/paged_attention.cpp``: paged attention, RMSNorm) against plain PyTorch.

Decode rows and prefill/extend rows of ragged sequences in one call, block sizes 1/16/64 (and
odd ones), GQA ratios 1..8, sliding windows, float32/float16/bfloat16 caches, rows skipped by a
length of 0; and the runner with the native kernel gives the plain path's logits. Skipped only
where the kernel cannot be built (no compiler): the fallback is then what runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.ops import native
from pagedkv.ops.paged_attention import NativeMetadata, native_paged_attention
from pagedkv.ops.reference import reference_paged_attention
from pagedkv_testing.paged_cases import paged_case as _case
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: "
                                f"{native.why_unavailable() if not native.available() else ''}")


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("d", [32, 64, 128, 256])  # 64, 128, 256: the vector path on AVX2 machines
def test_decode_and_extend_rows_match_reference(block_size, heads, kvh, d):
    rng = random.Random(block_size * 100 + heads + d)
    lens = [rng.randint(1, 300) for _ in range(5)] + [1, 17]
    new = [1, 1, min(40, lens[2]), 1, min(5, lens[4]), 1, 17]
    q, kc, vc, tables, row_seq, row_len = _case(block_size + heads, block_size, heads, kvh, d, lens, new)
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.empty_like(q), q, kc, vc, meta)
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("d", [16, 64])
def test_sliding_window(window, block_size, d):
    lens, new = [200, 5, 90], [1, 5, 30]
    q, kc, vc, tables, row_seq, row_len = _case(window, block_size, 6, 2, d, lens, new)
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.empty_like(q), q, kc, vc, meta, sliding_window=window)
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [40, 64, 256])  # the scalar path and the vector path
@pytest.mark.parametrize("window", [None, 9])
def test_soft_capped_scores(d, window):
    """Gemma 2's cap on the attention scores, c * tanh(s / c), on both kernel paths, with and
    without a window; a cap of 2 changes the result."""
    lens, new = [150, 7, 60], [1, 7, 20]
    q, kc, vc, tables, row_seq, row_len = _case(d, 16, 6, 2, d, lens, new)
    q = q * 4  # large scores, so that the cap matters
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.empty_like(q), q, kc, vc, meta, sliding_window=window, softcap=2.0)
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len, sliding_window=window, softcap=2.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    uncapped = reference_paged_attention(q, kc, vc, tables, row_seq, row_len, sliding_window=window)
    assert (uncapped - expected).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_accumulate_in_float32(dtype):
    q, kc, vc, tables, row_seq, row_len = _case(3, 16, 8, 2, 64, [130, 40], [1, 12], dtype)
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.empty_like(q), q, kc, vc, meta)
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_rows_of_length_zero_are_left_alone():
    q, kc, vc, tables, row_seq, row_len = _case(5, 4, 4, 2, 8, [10, 6], [3, 1])
    row_len[1] = 0
    meta = NativeMetadata.build(tables, row_seq, row_len)
    out = native_paged_attention(torch.full_like(q, 7.0), q, kc, vc, meta)
    assert meta.num_rows == 3 and torch.equal(out[1], torch.full_like(q[1], 7.0))
    expected = reference_paged_attention(q, kc, vc, tables, row_seq, row_len)
    torch.testing.assert_close(out[[0, 2, 3]], expected[[0, 2, 3]], atol=2e-5, rtol=1e-4)


def test_runner_logits_equal_the_plain_path(tmp_path):
    """A mixed step (fresh prefill, extend over a cached prefix, ragged decodes) through the
    model: the native kernel and the plain PyTorch path give the same logits."""
    from pagedkv.models.loader import load_model
    from pagedkv.runner import ModelRunner
    from pagedkv.runner.batch import SeqChunk

    folder = write_tiny_model(tmp_path)
    runners = [ModelRunner(load_model(str(folder)), block_size=4, num_blocks=64, native_attention=flag)
               for flag in (True, False)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (13, 9, 22)]
    tables = [list(range(0, 6)), list(range(6, 12)), list(range(12, 20))]
    for runner in runners:  # the prompts' KV, computed once per runner
        runner.execute([SeqChunk(p[:-1], 0, t) for p, t in zip(prompts, tables)])
    step = [SeqChunk(prompts[0][-1:], len(prompts[0]) - 1, tables[0]),
            SeqChunk(prompts[1][-1:], len(prompts[1]) - 1, tables[1]),
            SeqChunk(prompts[2][-1:] + [5, 6, 7], len(prompts[2]) - 1, tables[2], all_logits=True),
            SeqChunk([9, 8, 7, 6, 5], 0, [20, 21])]
    native_logits, plain_logits = (r.execute(step) for r in runners)
    torch.testing.assert_close(native_logits, plain_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 100), (33, 64)])
def test_native_rms_norm_matches_torch(rows, hidden):
    """The fused RMSNorm the runner switches on (``RMSNorm.native``) equals torch's rms_norm."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    out = torch.empty_like(x)
    torch.ops.pagedkv.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5), atol=1e-5, rtol=1e-5)
    from pagedkv.models.llama import RMSNorm
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
    plain = norm(x)
    norm.native = True
    torch.testing.assert_close(norm(x), plain, atol=1e-5, rtol=1e-5)


def _probe(env_extra: dict[str, str]) -> str:
    import os
    import subprocess
    import sys
    code = ("from pagedkv.ops import native\n"
            "from pagedkv.models.loader import load_model\n"
            "import sys\n"
            "from pagedkv_testing.tiny_model import write_tiny_model\n"
            "from pagedkv.runner import ModelRunner, SeqChunk\n"
            "folder = write_tiny_model(sys.argv[1])\n"
            "runner = ModelRunner(load_model(str(folder)), block_size=4, num_blocks=16)\n"
            "runner.execute([SeqChunk([1, 2, 3, 4, 5], 0, [0, 1])])\n"
            "print(native.available(), runner.native_attention)\n")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__), **env_extra}
        env = {k: v.replace("{tmp}", tmp) for k, v in env.items()}
        proc = subprocess.run([sys.executable, "-c", code, tmp + "/m"], capture_output=True, text=True,
                              env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip() + "\n" + proc.stderr


@pytest.mark.parametrize("env", [{"PAGEDKV_NATIVE": "0"},
                                 {"PAGEDKV_CACHE_DIR": "{tmp}/cache", "CXX": "/nonexistent/c++"}],
                         ids=["disabled", "no-compiler"])
def test_without_the_kernel_the_runner_falls_back(env):
    """PAGEDKV_NATIVE=0, or a build that fails (no compiler), leaves the plain PyTorch path
    running; a failed build says why once on stderr."""
    out = _probe(env)
    assert out.splitlines()[0] == "False False"
    if "CXX" in env:
        assert "native CPU kernels unavailable" in out


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start(tmp_path):
    """PyTorch waits for ever while its build "lock" file exists, and a process killed while
    loading leaves it behind: the next start removes it (under pagedkv's own lock) and loads."""
    import os
    import shutil
    import subprocess
    import sys

    from pagedkv.paths import cache_root

    key = native._build_key()
    built = cache_root() / "native" / key
    copy = tmp_path / "cache" / "native" / key
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "pagedkv-build.lock"))
    (copy / "lock").write_text("")  # what a killed build leaves
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "pagedkv.ops.native"], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0 and "built and loaded" in proc.stdout, proc.stdout + proc.stderr[-2000:]
