"""Canary's colayers in flight on real gloo processes: with 2 or 3 colayers exchanged at once
(each lane on its own gloo groups and worker thread) every rank ends each step with the bits
and the error-feedback residuals of one colayer after another, on the piece mesh and on the
nested exchange (hosts of two ranks, whose in-host hop is raw fp32); the backward pipeline
fed colayers out of order from another thread gives the same bits; and with the exact codec
the result is the float64 dense mean of fresh random inputs."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.dist.test_canary_nested import _profile
from tests.helpers.distributed import run_distributed
from tests.helpers.models import assert_fp32_mean, colayer_grads

SIZES = [1031, 16, 3000, 517, 2048]     # five colayers: every lane takes several, in turn
STEPS = 3
IN_FLIGHT = (1, 2, 3)


def _run(rank: int, world: int, seed: int, profile_path: str | None):
    if profile_path is not None:
        os.environ["SYNCPLANE_CLUSTER"] = profile_path
    from syncplane.algorithms.canary import BackwardPipeline, CanaryConfig, CanaryEngine
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    out = {}
    for compression in ("none", "sketch"):
        for in_flight in IN_FLIGHT:
            config = CanaryConfig(compression=compression, colayers_in_flight=in_flight, sync_timeout_s=60)
            transport = make_transport(config, JobContext.from_environment())
            assert transport.lanes == in_flight
            engine = CanaryEngine(SIZES, world, transport)
            meter = CommMeter()
            steps = []
            for step in range(STEPS):
                colayers = [c.clone() for c in colayer_grads(world, seed, SIZES, step)[rank]]
                engine.exchange_all_(colayers, meter)
                steps.append(colayers)
            out[compression, in_flight] = (steps, engine.state_dict()["transport"], meter.bytes_sent, engine.exchange)
            transport.close()
    # the backward pipeline: colayers reported ready in reverse order from another thread
    transport = make_transport(CanaryConfig(compression="sketch", colayers_in_flight=2, sync_timeout_s=60),
                               JobContext.from_environment())
    engine = CanaryEngine(SIZES, world, transport)
    piped = []
    for step in range(STEPS):
        grads = [c.clone() for c in colayer_grads(world, seed, SIZES, step)[rank]]
        pipeline = BackwardPipeline(engine, lambda i, g=grads: g[i])
        pipeline.begin()
        backward = threading.Thread(target=lambda p=pipeline: [p.ready(i) for i in reversed(range(len(SIZES)))])
        backward.start()
        backward.join()
        piped.append(pipeline.finish())
        pipeline.close()
    out["pipeline"] = (piped, engine.state_dict()["transport"])
    transport.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["mesh", "nested"])
def test_colayers_in_flight_give_the_serial_bits_and_the_dense_mean(tmp_path, layout, test_seed):
    world = 4
    profile = None
    if layout == "nested":
        profile = tmp_path / "hosts.yaml"
        profile.write_text(_profile(1, 2, 2))          # 2 hosts of 2 ranks: an exact in-host level
    results = run_distributed(_run, world, test_seed, str(profile) if profile else None, timeout=240)
    for rank in range(world):
        serial_steps, serial_residuals, serial_bytes, shape = results[rank]["sketch", 1]
        assert ("Nested" in shape) == (layout == "nested"), shape
        for in_flight in IN_FLIGHT[1:]:
            steps, residuals, sent, _ = results[rank]["sketch", in_flight]
            assert sent == serial_bytes > 0
            for step in range(STEPS):
                for c in range(len(SIZES)):
                    assert torch.equal(steps[step][c], serial_steps[step][c]), (rank, in_flight, step, c)
                    # replicas agree exactly
                    assert torch.equal(steps[step][c], results[0]["sketch", in_flight][0][step][c])
            assert torch.equal(residuals["residuals"], serial_residuals["residuals"]), (rank, in_flight)
        piped, residuals = results[rank]["pipeline"]
        for step in range(STEPS):
            for c in range(len(SIZES)):
                assert torch.equal(piped[step][c], serial_steps[step][c]), (rank, step, c)
        assert torch.equal(residuals["residuals"], serial_residuals["residuals"])
    for step in range(STEPS):
        grads = colayer_grads(world, test_seed, SIZES, step)
        for c in range(len(SIZES)):
            inputs = [grads[r][c] for r in range(world)]
            for rank in range(world):
                for in_flight in IN_FLIGHT:
                    got = results[rank]["none", in_flight][0][step][c]
                    assert_fp32_mean(got, inputs, (rank, in_flight, step, c))
                    assert torch.equal(got, results[0]["none", 1][0][step][c])
