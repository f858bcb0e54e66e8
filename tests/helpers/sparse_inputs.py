"""Inputs for the sparse codec's tests (CPU and GPU): the shapes that reach every layout
case, and the kinds of values a pseudo-gradient can hold."""

from __future__ import annotations

import torch

KINDS = ("gaussian", "student_t3", "outliers", "zeros")
# (numel, k, chunk, bits): full chunks only, with a tail, one short chunk, bitmap chunks
# (k * width >= chunk), k = chunk (every value kept), chunk 1, the empty buffer
SHAPES = [(10_000, 41, 4096, 2), (100_003, 123, 4096, 4), (7, 3, 4096, 8), (5000, 100, 512, 8),
          (4096, 1000, 4096, 2), (130, 64, 64, 4), (999, 999, 1000, 2), (3000, 1, 1, 8), (0, 5, 64, 2)]


def sample(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "student_t3":   # heavy tails: t(3) = N / sqrt(chi2_3 / 3)
        chi2 = torch.randn(3, n, generator=g).pow(2).sum(0)
        return torch.randn(n, generator=g) / (chi2 / 3).sqrt()
    x = torch.randn(n, generator=g)
    if kind == "outliers" and n:
        x[torch.randint(0, n, (max(1, n // 200),), generator=g)] *= 1e4
    return x
