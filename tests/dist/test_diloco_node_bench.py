"""``syncplane bench``'s ``diloco[replica=node]`` step on real gloo ranks, against a dense
reference: DDP's mean inside each node, then the node engine's round (Nesterov outer step on
the mean of the nodes' pseudo-gradients, weighted by their rank counts), fresh random payloads,
hosts from a cluster profile (even 2+2 and uneven 2+1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed

NUMEL = 37


def bench_node_round(rank: int, world: int, profile: str, seed: int):
    from syncplane.algorithms.diloco import SPEC
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    job = JobContext(rank=rank, world_size=world, cluster=profile)
    step = SPEC.bench_step("diloco", {"replica": "node", "period": 1, "payload_bytes": 4 * NUMEL}, job)
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    payload = start.clone()
    step(payload, 0, CommMeter())             # the warm-up: builds the engine; Δ = 0, nothing moves
    fresh = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed + 1 + rank))
    payload.copy_(fresh)
    meter = CommMeter()
    step(payload, 1, meter)
    step.engine.close()
    return type(step).__name__, start, fresh, payload.clone(), meter.bytes_sent, step.describe()


@pytest.mark.parametrize("sizes", [[2, 2], [2, 1]], ids=str)
def test_the_node_step_is_ddp_inside_then_one_outer_step_on_the_rank_weighted_mean(tmp_path: Path, sizes):
    from syncplane.algorithms.diloco.outer import OuterOptimizer

    hosts = ", ".join(f"{{name: h{i}, nic_mbit: 100, ranks: {n}}}" for i, n in enumerate(sizes))
    profile = tmp_path / "nodes.yaml"
    profile.write_text(f"name: nodes\nracks:\n  - name: r0\n    hosts: [{hosts}]\n")
    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(bench_node_round, sum(sizes), str(profile), seed, timeout=180)
    assert {r[0] for r in results} == {"NodeStep"}
    start = results[0][1]
    everyone = torch.stack([r[2] for r in results]).mean(dim=0)   # rank-weighted mean of the node means
    reference = OuterOptimizer(start.clone())
    reference.step(start - everyone)
    for _, _, _, after, sent, described in results:
        torch.testing.assert_close(after, reference.params, rtol=1e-6, atol=1e-6)
        assert sent > 0 and f"nodes of {sizes} ranks" in described
