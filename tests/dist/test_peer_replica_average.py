"""The torchft DiLoCo peer validates the average of its replicas, as our ``diloco`` does:
``peer_loop.replica_average`` on real gloo ranks against the dense mean, fresh random
replicas per rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_distributed


def _average_of_random_replicas(rank: int, world: int, seed: int):
    import torch.distributed as dist

    from syncplane.experiments.peer_loop import replica_average

    torch.manual_seed(seed * 100 + rank)            # every rank its own replica
    model = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    model[1].running_mean.normal_()
    model[1].num_batches_tracked.fill_(rank + 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    average, sent = replica_average(model, dist)
    after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return before, average.state_dict(), sent, unchanged


@pytest.mark.parametrize("world", [2, 3])
def test_replica_average_is_the_dense_mean(world):
    seed = int(torch.randint(0, 10_000, ()))         # fresh inputs each run
    results = run_distributed(_average_of_random_replicas, world, seed)
    replicas = [r[0] for r in results]
    for before, average, sent, unchanged in results:
        assert unchanged                              # training goes on from the replica itself
        for key, value in average.items():
            if key.endswith("num_batches_tracked"):   # not floating point: each rank keeps its own
                assert torch.equal(value, before[key])
                continue
            dense = torch.stack([r[key].double() for r in replicas]).mean(0)
            torch.testing.assert_close(value.double(), dense, rtol=1e-6, atol=1e-6)
        floats = sum(v.numel() for k, v in before.items() if v.is_floating_point())
        assert sent == 2 * (world - 1) / world * floats * 4
    assert not torch.equal(replicas[0]["0.weight"], replicas[1]["0.weight"])   # the replicas did differ
