"""Canary's piece-level exchange on real gloo processes: with the identity codec it is the
dense mean; with the gradient sketch it equals a reference built from the definition
(every rank's pieces encoded with error feedback, decoded, summed in rank order by the
owner, averaged, re-encoded with the owner's error feedback); one gloo group per NIC
gives the same bits as one group."""

from __future__ import annotations

import pytest
import torch

from syncplane.comm import GradientSketch, shard_bounds
from tests.helpers.distributed import run_distributed
from tests.helpers.models import assert_fp32_mean, colayer_grads

SIZES = [1031, 4, 3000]      # colayers in exchange order (one barely larger than the pieces)
STEPS = 2


def _grads(world: int, step: int, seed: int, sizes: list[int] = SIZES) -> list[list[torch.Tensor]]:
    return colayer_grads(world, seed, sizes, step)


def _run(rank: int, world: int, seed: int, nic_counts: list[int], compressions: list[str],
         sizes: list[int] = SIZES):
    from syncplane.algorithms.canary import CanaryConfig, CanaryEngine
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.job import JobContext

    results = {}
    for compression in compressions:
        for nics in nic_counts:
            transport = make_transport(CanaryConfig(compression=compression, nics=nics, sync_timeout_s=60), JobContext.from_environment())
            engine = CanaryEngine(sizes, world, transport)
            steps = []
            for step in range(STEPS):
                colayers = [c.clone() for c in _grads(world, step, seed, sizes)[rank]]
                engine.exchange_all_(colayers)
                steps.append(colayers)
            results[compression, nics] = (steps, engine.state_dict(), transport.bytes_per_round(sizes[-1]))
            transport.close()
    return results


def _sketch_reference(world: int, seed: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """What every rank must hold after each step, and each rank's residuals at the end."""
    codec = GradientSketch()
    total = sum(SIZES)
    local_e = [torch.zeros(total) for _ in range(world)]
    owner_e = [torch.zeros(total) for _ in range(world)]
    outputs = []
    for step in range(STEPS):
        grads = _grads(world, step, seed)
        step_out, offset = [], 0
        for c, size in enumerate(SIZES):
            out = torch.empty(size)
            for owner, (lo, hi) in enumerate(shard_bounds(size, world)):
                a, b = offset + lo, offset + hi
                acc = None
                for r in range(world):
                    wanted = grads[r][c][lo:hi] + local_e[r][a:b]
                    decoded = codec.extract(codec.compress(wanted), hi - lo)
                    local_e[r][a:b] = wanted - decoded
                    acc = decoded.clone() if acc is None else acc + decoded
                wanted = acc / world + owner_e[owner][a:b]
                mean = codec.extract(codec.compress(wanted), hi - lo)
                owner_e[owner][a:b] = wanted - mean
                out[lo:hi] = mean
            step_out.append(out)
            offset += size
        outputs.append(step_out)
    return outputs, torch.stack([torch.stack([local_e[r], owner_e[r]]) for r in range(world)])


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_matches_dense_references_and_nic_count_does_not_matter(world, test_seed):
    results = run_distributed(_run, world, test_seed, [1, 2], ["none", "sketch"], timeout=240)
    # identity codec: the float64 dense mean (to fp32 rounding), bit-identical on every rank and NIC count
    for step in range(STEPS):
        grads = _grads(world, step, test_seed)
        for c in range(len(SIZES)):
            inputs = [grads[r][c] for r in range(world)]
            for rank in range(world):
                for nics in (1, 2):
                    got = results[rank]["none", nics][0][step][c]
                    assert_fp32_mean(got, inputs, (rank, nics, step, c))
                    assert torch.equal(got, results[0]["none", 1][0][step][c])
    # sketch: the reference of decode∘encode sums, bit for bit, on every rank and NIC count
    want, residuals = _sketch_reference(world, test_seed)
    for rank in range(world):
        for nics in (1, 2):
            steps, state, _ = results[rank]["sketch", nics]
            for step in range(STEPS):
                for c in range(len(SIZES)):
                    assert torch.equal(steps[step][c], want[step][c]), f"rank {rank}, {nics} NICs, step {step}"
            assert torch.equal(state["transport"]["residuals"], residuals[rank])
    # the sketch is close to the exact mean, and about a quarter of its bytes on the wire
    exact = results[0]["none", 1][0][STEPS - 1][2]
    sketched = results[0]["sketch", 1][0][STEPS - 1][2]
    assert ((sketched - exact).norm() / exact.norm()).item() < 0.05
    assert results[0]["sketch", 1][2] < 0.3 * results[0]["none", 1][2] + 2 * world * 1024


@pytest.mark.slow
def test_six_ranks_identity_is_the_dense_mean(test_seed):
    world, sizes = 6, [1031, 6, 700]
    results = run_distributed(_run, world, test_seed, [3], ["none"], sizes, timeout=240)
    for step in range(STEPS):
        grads = _grads(world, step, test_seed, sizes)
        for c in range(len(sizes)):
            inputs = [grads[r][c] for r in range(world)]
            for rank in range(world):
                assert_fp32_mean(results[rank]["none", 3][0][step][c], inputs, (rank, step, c))
