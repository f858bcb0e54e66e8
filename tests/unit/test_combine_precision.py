"""Precision of the weighted combine (issue 16): one rounding, at the end.

The expectation is the float64 value of ``a·x + Σ w_j·y_j`` (weights as Python floats)
rounded once to the input dtype -- what BlueFog's tolerance assumes. Accumulating in
fp32 with fp32-rounded weights (the old kernel) misses it on a large share of elements.
"""

from __future__ import annotations

import pytest
import torch

from syncplane import kernels

SEED = 20261122


def _inputs(dtype: torch.dtype, k: int, n: int = 100_000):
    g = torch.Generator().manual_seed(SEED + k)
    x = torch.randn(n, generator=g).to(dtype)
    ys = [torch.randn(n, generator=g).to(dtype) for _ in range(k)]
    weights = [1.0 / (k + 1)] * k           # 1/3 and 1/4 etc.: 1/3 is not a binary fraction
    return x, ys, weights, 1.0 / (k + 1)


def _correctly_rounded(x, ys, weights, a):
    acc = x.double() * a
    for w, y in zip(weights, ys):
        acc += w * y.double()
    return acc


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """max |got − exact| in units of the spacing of got's dtype at got (exact: float64)."""
    magnitude = got.abs()
    spacing = (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).double()
    return float(((got.double() - exact).abs() / spacing).max())


# Correct rounding is off by at most half a unit in the last place. The float64 reference
# carries ~1e-16 relative error itself, so allow that on top; a kernel that rounds more
# than once (fp32 accumulation with fp32 weights) lands a full unit or more away.
HALF_ULP = 0.5 + 1e-6


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize("k", [2, 3, 20])
def test_fp32_combine_is_correctly_rounded(backend, k):
    x, ys, weights, a = _inputs(torch.float32, k)
    got = kernels.weighted_combine(x, ys, weights, a, backend=backend)
    assert _ulps(got, _correctly_rounded(x, ys, weights, a)) <= HALF_ULP


def test_old_fp32_accumulation_misses_the_correct_rounding():
    """The check above can fail: fp32 accumulation with fp32 weights is a unit or more off."""
    x, ys, weights, a = _inputs(torch.float32, 3)
    acc = x * torch.tensor(a, dtype=torch.float32)
    for w, y in zip(weights, ys):
        acc += torch.tensor(w, dtype=torch.float32) * y
    assert _ulps(acc, _correctly_rounded(x, ys, weights, a)) > 0.9


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_combine_accumulates_in_fp32(backend, dtype):
    x, ys, weights, a = _inputs(dtype, 3)
    got = kernels.weighted_combine(x, ys, weights, a, backend=backend)
    assert _ulps(got, _correctly_rounded(x, ys, weights, a)) <= 0.5 + 1e-3


@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_fp64_combine_accumulates_in_fp64(backend):
    x, ys, weights, a = _inputs(torch.float64, 3)
    got = kernels.weighted_combine(x, ys, weights, a, backend=backend)
    torch.testing.assert_close(got, _correctly_rounded(x, ys, weights, a), rtol=4e-16, atol=4e-16)
