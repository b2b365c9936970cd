"""The sampler over its whole input space: any valid parameters, any logits a model can produce.

Properties (hypothesis): a row with a finite or +inf value always yields a token, and that token
is one the parameters allow (greedy: a maximum; +inf rows: a +inf token; never a NaN or -inf
token); log-probabilities are finite; a row with no candidate raises SamplingError, never
something else. Regression: a subnormal temperature used to overflow and fail the whole batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sampling.sampler import MIN_LOGPROB, Sampler, SampleRow, SamplingError, make_generator
from pagedkv.sampling_params import SamplingParams

VOCAB = 12
SPECIAL = [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, 0.0]

logit_values = st.one_of(st.floats(-1e4, 1e4, allow_nan=False, width=32), st.sampled_from(SPECIAL))
rows_st = st.lists(st.lists(logit_values, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=4)
temperatures = st.one_of(
    st.just(0.0), st.sampled_from([1e-45, 5e-324, 1e-40, 1e-37, 1e-7, 1.0, 2.0, 1e30, 1.7e308]),
    st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False))
params_st = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=st.one_of(st.sampled_from([1e-300, 1e-9, 0.5, 0.999999, 1.0]),
                    st.floats(min_value=1e-12, max_value=1.0)),
    top_k=st.one_of(st.sampled_from([-1, 0, 1, VOCAB, VOCAB + 5]), st.integers(-1, 10 ** 6)),
    min_p=st.one_of(st.sampled_from([0.0, 1e-300, 0.5, 1.0]), st.floats(min_value=0.0, max_value=1.0)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    seed=st.one_of(st.none(), st.integers(-(2 ** 70), 2 ** 70)),
)


def _candidates(row: list[float]) -> set[int]:
    """Tokens a correct sampler may return for this row, whatever the filters."""
    clean = [float("-inf") if math.isnan(x) else x for x in row]
    if float("inf") in clean:
        return {i for i, x in enumerate(clean) if x == float("inf")}
    return {i for i, x in enumerate(clean) if x != float("-inf")}


@settings(max_examples=400, deadline=None)
@given(rows=rows_st, params=params_st, data=st.data())
def test_sampler_never_fails_a_row_that_has_a_candidate(rows, params, data) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    sampler = Sampler(seed=1)
    sample_rows = [SampleRow(i, params, make_generator(params.seed) if params.seed is not None else None)
                   for i in range(len(rows))]
    batch = sampler.prepare(logits, sample_rows)
    for r in sample_rows:
        cands = _candidates([float(x) for x in logits[r.row]])
        if not cands:
            with pytest.raises(SamplingError):
                batch.sample(r)
            continue
        s = batch.sample(r)
        assert s.token in cands
        if params.temperature == 0.0:
            clean = batch.logits[r.row]
            assert clean[s.token] == clean.max()
        if params.logprobs is not None:
            assert math.isfinite(s.logprob) and MIN_LOGPROB <= s.logprob <= 0.0
            assert all(math.isfinite(lp.logprob) and lp.rank >= 1 for lp in s.top.values())
            assert len(s.top) >= min(params.logprobs, VOCAB)


def test_tiny_temperatures_are_greedy_with_ties() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.999, -1.0]])
    for temperature in (1e-40, 5e-324, 1e-300, 1e-20):
        row = SampleRow(0, SamplingParams(temperature=temperature, seed=3), make_generator(3))
        assert Sampler().sample(logits, [row])[0].token == 1


def test_huge_temperature_is_uniform_over_finite_tokens() -> None:
    logits = torch.tensor([[0.0, 50.0, float("-inf"), -50.0]])
    g = make_generator(0)
    row = SampleRow(0, SamplingParams(temperature=1e300), g)
    seen = {Sampler().sample(logits, [row])[0].token for _ in range(200)}
    assert seen == {0, 1, 3}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 10 ** 400])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_non_finite_parameters_are_rejected(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=50)
