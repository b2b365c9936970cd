"""Sampling: from a step's logits to tokens.

- ``sampler.py``: penalties and logit_bias, greedy, temperature, top-k, top-p, min-p, seeds and
  logprobs (``Sampler.prepare`` -> ``SampleBatch.sample``); prompt and beam logprobs.
- ``rejection.py``: exact verification of speculative proposals against the target's logits
  (greedy agreement; rejection sampling for sampled rows), drawing from the same ``SampleBatch``.
- ``bitmask.py``: structured output's token masks applied to logits.

Below the engine and the speculative package, which both sample through it: it imports neither.
"""

from pagedkv.sampling.rejection import verify
from pagedkv.sampling.sampler import (
    MIN_LOGPROB,
    NO_CANDIDATE,
    SampleBatch,
    Sampled,
    Sampler,
    SampleRow,
    SamplingError,
    logit_bias_vector,
    make_generator,
    token_logprobs,
    top_logprobs,
)

__all__ = ["MIN_LOGPROB", "NO_CANDIDATE", "SampleBatch", "SampleRow", "Sampled", "Sampler", "SamplingError",
           "logit_bias_vector", "make_generator", "token_logprobs", "top_logprobs", "verify"]
