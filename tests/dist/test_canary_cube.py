"""Canary's two-stage cube exchange (paper 004 §4.4) on real gloo processes, chosen by the
engine because the job runs on a BCube profile: with the identity codec every rank ends
with the float64 dense mean of the inputs (to fp32 rounding) and all ranks hold the same
bits; with the gradient sketch the replicas still agree bit for bit, the result is near
the dense mean, the error-feedback residuals are kept, and the bytes sent are what the
transport predicts. A world that is not α^β fails with the field named."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.models import assert_fp32_mean, colayer_grads

SIZES = [1031, 8, 3000]          # colayers; 8 = β·n pieces exactly
SEED = 20261122

BCUBE_2_2 = """name: bcube_2_2_test
bcube: {alpha: 2, beta: 2}
racks:
  - name: cube
    hosts:
"""


def _run(rank: int, world: int, profile_path: str, seed: int):
    os.environ["SYNCPLANE_CLUSTER"] = profile_path
    from syncplane.algorithms.canary import CanaryConfig, CanaryEngine
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.comm import CommMeter
    from syncplane.exchanges import CubeExchange
    from syncplane.job import JobContext

    out = {}
    for compression in ("none", "sketch"):
        transport = make_transport(CanaryConfig(compression=compression, sync_timeout_s=60), JobContext.from_environment())
        cube = transport.exchange
        assert isinstance(cube, CubeExchange) and (cube.alpha, cube.beta) == (2, 2)
        engine = CanaryEngine(SIZES, world, transport)
        colayers = [c.clone() for c in colayer_grads(world, seed, SIZES)[rank]]
        meter = CommMeter()
        engine.exchange_all_(colayers, meter)
        predicted = sum(transport.bytes_per_round(size) for size in SIZES)
        out[compression] = (colayers, engine.state_dict(), meter.bytes_sent, predicted)
        transport.close()
    try:
        CubeExchange(3, 2).check(world)
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.timeout(240)
def test_cube_exchange_is_the_dense_mean_on_bcube_2_2(tmp_path):
    world = 4
    profile = tmp_path / "bcube_2_2.yaml"
    profile.write_text(BCUBE_2_2 + "".join(f"      - {{name: w{h}, nic_mbit: 100, nics: 2}}\n" for h in range(world)))
    print(f"seed {SEED}")
    results = run_distributed(_run, world, str(profile), SEED, timeout=200)
    grads = colayer_grads(world, SEED, SIZES)
    dense = [torch.stack([grads[r][c].double() for r in range(world)]).mean(0) for c in range(len(SIZES))]
    inputs = [[grads[r][c] for r in range(world)] for c in range(len(SIZES))]
    for compression in ("none", "sketch"):
        for rank in range(world):
            mine, state, sent, predicted = results[rank][compression]
            assert sent == predicted > 0
            for c, ref in enumerate(dense):
                assert torch.equal(mine[c], results[0][compression][0][c])        # replicas agree exactly
                if compression == "none":
                    assert_fp32_mean(mine[c], inputs[c], (rank, c))
                else:
                    err = (mine[c].double() - ref).norm() / ref.norm()
                    assert 0 < err < 0.1, (c, float(err))
            residuals = state["transport"].get("residuals")
            if compression == "none":
                assert residuals is None
            else:        # own pieces, relayed partial sums, owned means: one residual each
                assert residuals.shape == (3, sum(SIZES)) and residuals.abs().sum() > 0
    assert "world size: BCube(3, 2) has alpha^beta = 9 hosts" in results[0]["bad"]
