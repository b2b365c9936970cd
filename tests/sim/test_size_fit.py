"""``pagedkv size`` for a model that does not fit: the smallest --tp and the widest weight format
with which one max-length sequence would fit, computed and then checked by sizing again with it."""

from __future__ import annotations

import json

import pytest

from pagedkv.sim.cli import main
from pagedkv.sim.model_spec import load_model_spec
from pagedkv.sim.sizing import WEIGHT_DTYPE_BYTES, DoesNotFit, SizingInputs, size_kv_cache
from pagedkv.workloads import SHAREGPT

GiB = 1 << 30


def _inputs(**kw: object) -> SizingInputs:
    args: dict[str, object] = dict(device_memory=80 * GiB, kv_memory=None, weight_memory=None, weight_dtype="fp32",
                                   reserved_fraction=0.1, kv_dtype="fp16", block_size=16, max_len=8192, tp=1)
    return SizingInputs(**{**args, **kw})  # type: ignore[arg-type]  # the fields above


def test_a_model_that_does_not_fit_names_the_smallest_tp_and_format_that_would() -> None:
    spec = load_model_spec("llama-3-70b")
    with pytest.raises(DoesNotFit) as caught:
        size_kv_cache(spec, _inputs(), SHAREGPT)
    err = caught.value
    assert err.smallest_tp is not None and err.weight_dtype is not None
    assert f"--tp {err.smallest_tp}" in str(err) and f"--weight-dtype {err.weight_dtype}" in str(err)
    # each fits one max-length sequence; half the tp, or the next wider format, does not
    fit = size_kv_cache(spec, _inputs(tp=err.smallest_tp), SHAREGPT)
    assert fit.max_concurrent_at_max_len >= 1
    if err.smallest_tp > 2:
        with pytest.raises(DoesNotFit):
            size_kv_cache(spec, _inputs(tp=err.smallest_tp // 2), SHAREGPT)
    fit = size_kv_cache(spec, _inputs(weight_dtype=err.weight_dtype), SHAREGPT)
    assert fit.max_concurrent_at_max_len >= 1
    wider = [d for d, b in WEIGHT_DTYPE_BYTES.items() if WEIGHT_DTYPE_BYTES[err.weight_dtype] < b < 4]
    for dtype in wider:
        result = None
        try:
            result = size_kv_cache(spec, _inputs(weight_dtype=dtype), SHAREGPT)
        except DoesNotFit:
            pass
        assert result is None or result.max_concurrent_at_max_len < 1, dtype


def test_the_command_says_so_and_json_carries_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "llama-3-70b", "--device-memory", "80GiB", "--weight-dtype", "fp32"]) == 1
    assert "does not fit" in capsys.readouterr().err
    assert main(["size", "llama-3-70b", "--device-memory", "80GiB", "--weight-dtype", "fp32", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["smallest_tp"] >= 2 and data["weight_dtype"] in WEIGHT_DTYPE_BYTES
    # nothing fits a 1 GiB device: it says what to raise instead
    assert main(["size", "llama-3-70b", "--device-memory", "1GiB", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["smallest_tp"] is None and "raise --device-memory" in data["error"]


def test_tp_sizes_that_do_not_divide_the_heads_are_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    # SmolLM2-135M has 3 KV heads: --tp 2 is no candidate, its error does not surface
    assert main(["size", "smollm2-135m", "--device-memory", "400MB", "--weight-dtype", "fp32", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["smallest_tp"] in (None, 3) and data["weight_dtype"] is not None
