"""The error the low-bit linear kernels may make, for tests that hold their output to float64 on the
dequantized weight (``ops/csrc/gemv_common.h``, ``lowbit_matmul.cpp``).

A decode batch (up to ``INT_ROWS_MAX`` rows, 2) takes integer activations: each row of ``x`` is
quantized per run of 32 values to int16, with the scale ``s = absmax / 32767`` of its run and
``q = round(x / s)``, so ``|x - q s| <= s / 2`` per value. The dot products of a weight row with ``q``
are exact (integers), the offsets multiply the float sums of ``x`` (no rounding of ``x`` there), so

    |out[m, n] - (x W^T)[m, n]| <= sum over runs b of s[m, b] / 2 * sum_{k in b} |W[n, k] - offset[n, b]|

and float32 rounding adds at most a small multiple of 2^-24 of ``|x| @ |W|^T`` (the kernel's own sums
and the bias). More rows take float activations: within the float term alone, so the same bound holds
for every row count. :func:`assert_within_activation_rounding` checks that bound, times ``SAFETY``,
element by element: a kernel bug (a wrong scale, offset or code) is far outside it.

A model's prompt logits (:func:`assert_logits_within_head_rounding`): the prompt's rows go through
the layers with float activations (several rows: float rounding, the tests' 1e-4), the LM head takes
the last row alone, with integer activations: the bound above on the head's actual input
(:func:`record_inputs`) on top.
"""

from __future__ import annotations

import torch
from torch import nn

RUN = 32  # values per run (GGUF's block of 32), each with its own activation scale
INT16_MAX = 32767
FLOAT_REL = 2.0 ** -20  # float32 rounding of the sums, relative to |x| @ |W|^T (16 ulps)
SAFETY = 2.0


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The bound above for ``x [M, K] @ weight [N, K]^T (+ bias)``, ``weight`` dequantized with its
    ``offsets [N, K / 32]`` (None: none): float64 ``[M, N]``, before ``SAFETY``."""
    m, k = x.shape
    if k % RUN:
        raise ValueError(f"x: K = {k} is no multiple of {RUN}; the kernels take runs of {RUN} values")
    xd, wd = x.double(), weight.double()
    step = xd.abs().view(m, k // RUN, RUN).amax(-1) / INT16_MAX  # [M, K / 32]: s
    scaled = wd if offsets is None else wd - offsets.double().repeat_interleave(RUN, dim=1)
    run_mass = scaled.abs().view(wd.shape[0], k // RUN, RUN).sum(-1)  # [N, K / 32]
    rounding = (step / 2) @ run_mass.t()
    magnitude = xd.abs() @ wd.abs().t()
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return rounding + FLOAT_REL * magnitude


def assert_within_activation_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                      offsets: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
    """``got`` (a kernel's ``[M, N]``) is ``x @ weight^T (+ bias)`` within ``SAFETY`` times the bound;
    the message names the worst element and its error over the bound."""
    want = x.double() @ weight.double().t()
    if bias is not None:
        want = want + bias.double()
    bound = SAFETY * activation_rounding_bound(x, weight, offsets, bias)
    err = (got.double() - want).abs()
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.inf, 0.0))
    worst = int(ratio.argmax())
    r, c = divmod(worst, ratio.shape[1])
    assert bool((err <= bound).all()), (
        f"output [{r}, {c}] = {float(got[r, c])} is {float(err[r, c]):.3g} from {float(want[r, c])}: "
        f"{float(ratio[r, c]):.3g}x the activation-rounding bound ({float(bound[r, c]):.3g}, SAFETY included)")


def record_inputs(module: nn.Module) -> list[torch.Tensor]:
    """A list that receives a copy of ``module``'s input at each call (a forward pre-hook)."""
    seen: list[torch.Tensor] = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    return seen


def assert_logits_within_head_rounding(got: torch.Tensor, want: torch.Tensor, head_input: torch.Tensor,
                                       head: nn.Module, float_tol: float = 1e-4) -> None:
    """``got`` logits ``[R, V]`` (the packed model's) are ``want`` (the float model's) within float
    rounding (``float_tol``, absolute and relative) plus ``SAFETY`` times the integer activations'
    bound for the LM ``head`` (``weight``, ``offsets``) on its input ``head_input`` (its last R rows)."""
    weight, offsets = head.weight, getattr(head, "offsets", None)
    assert isinstance(weight, torch.Tensor)
    rows = head_input.reshape(-1, weight.shape[1])[-got.shape[0]:]
    rounding = activation_rounding_bound(rows, weight, offsets if isinstance(offsets, torch.Tensor) else None)
    tolerance = float_tol + float_tol * want.double().abs() + SAFETY * rounding
    err = (got.double() - want.double()).abs()
    assert bool((err <= tolerance).all()), (
        f"logits differ by up to {float(err.max()):.3g}: {float((err / tolerance).max()):.3g}x the tolerance "
        f"(float rounding {float_tol} + the head's activation rounding)")
