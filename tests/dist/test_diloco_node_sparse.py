"""``replica: node`` with ``compression: sparse``: each shard group gathers its owners' top-k
pieces (error feedback per shard, the floating buffers exact), on real gloo ranks with fresh
random data.

- One rank per node: today's ``diloco`` with the sparse gather, bit for bit.
- Nodes of 2+2 and 2+1: every rank of every node ends with the same model and θ_g shards
  that agree with their peers in the other nodes (the gather's decoded mean is the same on
  every member), and training moved it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_diloco_nodes import LR, _model, _train
from tests.helpers.distributed import run_distributed

SPARSE = {"compression": "sparse", "exchange": "gather", "density": 0.3, "chunk": 16, "bits": 4}


def _engines(rank: int, world: int, sizes: list[int] | None, seed: int, model: torch.nn.Module):
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.algorithms.diloco.node import NodeEngine
    from syncplane.job import JobContext

    job = JobContext(rank=rank, world_size=world)
    if sizes is None:
        tensors = [p.data for p in model.parameters()]
        return DiLoCoEngine(tensors, sum(t.numel() for t in tensors), DiLoCoConfig(sync_every=2, **SPARSE), job)
    return NodeEngine(model, DiLoCoConfig(sync_every=2, replica="node", **SPARSE), job, ReplicaLayout.of_sizes(sizes))


def sparse_rounds(rank: int, world: int, layouts: list, seed: int):
    out = []
    for sizes in layouts:
        model = _model(seed)
        engine = _engines(rank, world, sizes, seed, model)
        module = model if sizes is None else engine.module
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        _train(engine, module, model, optimizer, seed, rank, range(8), 2)
        shards = {k: engine.outers[k].params.clone() for k in engine.owned} if sizes else None
        out.append(([p.detach().clone() for p in model.parameters()], engine.outer.params.clone(), shards,
                    engine.exchange_name))
        engine.close()
    return out


def test_one_rank_per_node_is_todays_sparse_diloco_bit_for_bit():
    seed = int(torch.randint(0, 2**20, ()))
    for (params, outer, _, _), (node_params, node_outer, _, name) in run_distributed(
            sparse_rounds, 3, [None, [1, 1, 1]], seed, timeout=180):
        assert name == "gather"
        assert torch.equal(outer, node_outer)
        assert all(torch.equal(a, b) for a, b in zip(params, node_params))


@pytest.mark.parametrize("sizes", [[2, 2], [2, 1]], ids=str)
def test_node_replicas_gather_sparse_shards_and_agree(sizes):
    seed = int(torch.randint(0, 2**20, ()))
    results = [r[0] for r in run_distributed(sparse_rounds, sum(sizes), [sizes], seed, timeout=180)]
    first = results[0][0]
    for params, _, _, name in results:
        assert name == "gather"
        assert all(torch.equal(a, b) for a, b in zip(params, first))      # one model on every rank
    assert any(not torch.equal(a, b) for a, b in zip(first, _model(seed).parameters()))
    shards: dict[int, torch.Tensor] = {}
    for _, _, owned, _ in results:                                       # each shard's θ_g agrees across nodes
        for k, theta in owned.items():
            assert torch.equal(shards.setdefault(k, theta), theta)
