"""A BlueFog-style program runs unchanged (but for its import line) on the compat adapter.

References are dense float64 computations from BlueFog's definitions, built here
independently of syncplane: exponential-2 mixing ``W[i, i + 2^k] = 1/(K+1)``; the
one-peer schedule (step t: i sends to ``i + 2^(t mod K)``, averages ½–½ with what it
receives); hierarchical = machine means mixed by the machine exponential-2 graph;
push-sum (made synchronous by barriers) is that same mixing matrix applied to x and p,
conserves Σx and Σp, and ``x/p`` tends to the global mean.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed


def _run(rank, world, seed, local_size):
    if local_size is not None:          # launcher environment: local_size processes per machine
        os.environ["LOCAL_WORLD_SIZE"] = str(local_size)
        os.environ["LOCAL_RANK"] = str(rank % local_size)
    from tests.dist.bluefog_style_example import main

    return main(seed, hierarchical=local_size is not None)


def _exp2(n: int) -> np.ndarray:
    offsets = [d for d in (2 ** k for k in range(max(1, math.ceil(math.log2(n))) + 1)) if d < n]
    w = np.zeros((n, n))
    for i in range(n):
        w[i, i] = 1.0 / (len(offsets) + 1)
        for d in offsets:
            w[i, (i + d) % n] = 1.0 / (len(offsets) + 1)
    return w


def _check(results, world, local_size, iterations=6):
    X = np.stack([r["x"].numpy().reshape(-1) for r in results])           # rank × features
    w = _exp2(world)
    Y = X.copy()
    for _ in range(iterations):
        Y = w.T @ Y                                                        # y_i = Σ_j W[j, i] y_j
    Z = X.copy()
    k = max(1, math.ceil(math.log2(world))) if world > 1 else 1
    for t in range(iterations):
        d = 2 ** (t % k)
        Z = np.stack([(Z[i] + Z[(i - d) % world]) / 2 for i in range(world)]) if world > 1 else Z
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["static"].numpy().reshape(-1), Y[i], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(r["dynamic"].numpy().reshape(-1), Z[i], rtol=1e-12, atol=1e-12)
    if local_size is not None:
        machines = world // local_size
        means = np.stack([X[m * local_size:(m + 1) * local_size].mean(axis=0) for m in range(machines)])
        mixed = _exp2(machines).T @ means
        for i, r in enumerate(results):
            m = i // local_size
            np.testing.assert_allclose(r["hierarchical"].numpy().reshape(-1), mixed[m], rtol=1e-12, atol=1e-12)
            assert r["in_machines"] == sorted({(m - d) % machines for d in (1, 2, 4) if d < machines})
    total_x = sum(r["push_sum_x"].numpy().reshape(-1) for r in results)
    total_p = sum(r["push_sum_p"] for r in results)
    np.testing.assert_allclose(total_x, X.sum(axis=0), rtol=1e-12, atol=1e-12)   # mass conserved
    assert total_p == pytest.approx(world, abs=1e-12)
    # synchronous push-sum: x ← Aᵀx and p ← Aᵀp with A[j, i] = 1/(outdegree + 1) for i ∈ out(j) ∪ {j},
    # which for exponential-2 is the static mixing matrix; it is doubly stochastic, so p stays 1
    P = X.copy()
    for _ in range(4 * iterations):
        P = w.T @ P
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["push_sum_x"].numpy().reshape(-1), P[i], rtol=1e-12, atol=1e-12)
        assert r["push_sum_p"] == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(r["push_sum_x"].numpy().reshape(-1) / r["push_sum_p"], X.mean(axis=0),
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("world,local_size", [(2, None), (4, None), (5, None), (6, 2), (8, 2)])
def test_bluefog_program_runs_unchanged_on_the_adapter(world, local_size):
    seed = int(torch.randint(0, 2**30, ()))
    print(f"seed={seed}")
    results = run_distributed(_run, world, seed, local_size, timeout=300)
    _check(results, world, local_size)
