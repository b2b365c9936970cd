"""Speculative decoding: proposers guess the next tokens, the target model checks them all in one
forward pass, and the paged cache gives back the slots of the guesses it rejects.

- ``config.py``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` shape), pure Python.
- ``ngram.py``: prompt lookup (the last tokens matched against the prompt and output so far).
- ``draft_model.py``: a smaller model with the same tokenizer and a paged KV cache of its own.
- ``decoder.py``: the engine's glue: who speculates, how far (back-off), the verification of a
  sequence's proposal (its tokens appended until one finishes it) and the counters. The check
  itself is sampling (``pagedkv/sampling/rejection.py``: greedy argmax agreement; rejection
  sampling against a point-mass proposal, which keeps the target distribution exactly).
"""

from pagedkv.speculative.config import SPEC_METHODS, SpeculativeConfig

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]
