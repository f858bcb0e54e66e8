"""Elastic DiLoCo with node replicas (``replica: node``) on real processes and real gloo: two
nodes of two ranks, each node a torch.distributed job of its own (DDP inside it, the outer
state sharded over its ranks) and one torchft replica group of two ranks, meeting through a
Lighthouse on loopback. With no fault they end with the θ_g shards and local models of the
same ranks in one fixed job of 2 + 2 ranks, bit for bit -- with int8 and its error feedback,
two streams, two fragments and an overlap of one step. Then one node leaves and comes back
as a fresh process pair: each of its ranks heals its own shard from the same rank of the live
node (a shard's bytes, not the model's) and the two nodes hold one θ_g again."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.dist.test_diloco_nodes import _model
from tests.dist.test_elastic_engine import _drive
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft  # noqa: E402

KWARGS = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compression": "int8", "block_size": 4,
          "streams": 2, "exchange": "mesh", "replica": "node"}
STEPS = 13   # boundaries at 5, 9 and 13 (kH + τ): the round at 12 merges at 13
L = 2        # ranks per node


def _config(inner: str = "ddp"):
    from syncplane.algorithms.diloco.config import DiLoCoConfig

    return DiLoCoConfig(**KWARGS, inner=inner)


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameter values (its FSDP2 shard of each under ``inner: fsdp``)."""
    from syncplane.algorithms.sharded import local

    return [local(p.detach()).clone() for p in model.parameters()]


def fixed_nodes(rank: int, world: int, seed: int, inner: str = "ddp") -> tuple:
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    model = _model(seed)
    engine = DiLoCoEngine(model, _config(inner), JobContext(rank=rank, world_size=world),
                          ReplicaLayout.of_sizes([L] * (world // L), inner))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        _drive(engine, model, optimizer, seed, rank, step, inner=engine.module)
    engine.wait()
    out = (engine.params.clone(), _values(model))
    engine.close()
    return out


def _share_port(port):
    import torch.distributed as dist

    box = [port]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def elastic_node(rank: int, world: int, node: int, lighthouse: str, seed: int, steps: range,
                 total: int, ready: str | None = None, joins: bool = False, inner: str = "ddp") -> dict:
    """Node ``node``'s rank ``rank``: the engine over its own job's ranks, the exchange over the
    quorum. ``ready``: files the joining node's ranks (``joins``) create as they ask to join (they
    start once the other node has passed its first boundary: ``ready.go``); the other node waits
    for them, and a second more, before its second boundary, so that its quorum takes the joiner
    in (the Lighthouse forms a quorum of the previous one's members at once if no one else has
    asked yet: its fast path)."""
    import os
    import time

    from syncplane.algorithms.diloco.elastic import Membership, QuorumTransport
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    model = _model(seed)
    transport = QuorumTransport("127.0.0.1", 20.0)
    engine = DiLoCoEngine(model, _config(inner), JobContext(rank=rank, world_size=world),
                          ReplicaLayout.of_sizes([world], inner), transport=transport)
    if joins and ready is not None:
        while not os.path.exists(f"{ready}.go"):
            time.sleep(0.05)
    membership = Membership(transport, {"job": 1}, total=total, outer_state=engine.shard_state_dict,
                            load_outer_state=engine.load_shard_state_dict)
    group = ft.ReplicaGroup(f"replica{node}", lighthouse, membership.state_dict, membership.load_state_dict,
                            round_timeout_s=20, quorum_timeout_s=60, group_rank=rank, group_world_size=world,
                            share_port=_share_port)
    out: dict = {}

    def boundary() -> None:
        if ready is not None and not joins and membership.position == 1:
            while not all(os.path.exists(f"{ready}.{r}") for r in range(world)):
                time.sleep(0.05)
            time.sleep(1.0)
        membership.boundary()
        if ready is not None and not joins and membership.position == 1 and rank == 0:
            open(f"{ready}.go", "w").close()

    try:
        if joins and ready is not None:
            open(f"{ready}.{rank}", "w").close()
        membership.join(group)
        if membership.healed:
            engine.adopt([p.data for p in model.parameters()])
            out["heal"], out["adopted"] = membership.stats.heals[-1], _values(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in steps:
            _drive(engine, model, optimizer, seed, node * world + rank, step, boundary, inner=engine.module)
        engine.wait()
        out["elastic"] = (engine.params.clone(), _values(model))
        out["view"] = (transport.view.participants, transport.view.rank, membership.position, group.step)
        out["owned"] = engine.owned
    finally:
        engine.close()
        membership.close()
    return out


def _nodes(lighthouse: str, seed: int, runs: list[tuple]) -> list[list[dict]]:
    """Each of ``runs`` (node, steps, boundaries, ...) as its own job of L processes, all at once."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run_distributed, elastic_node, L, node, lighthouse, seed, steps, *rest, timeout=240)
                   for node, steps, *rest in runs]
        return [f.result() for f in futures]


@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_elastic_node_replicas_equal_the_fixed_job_of_nodes_bit_for_bit(inner: str) -> None:
    """DDP inside the node (θ_g gathered over its ranks after each round), and FSDP2 (a rank's
    outer shard is its FSDP shard)."""
    seed = int(torch.randint(0, 2**20, ()))
    fixed = run_distributed(fixed_nodes, 2 * L, seed, inner, timeout=240)
    lighthouse = ft.start_lighthouse("127.0.0.1", min_replicas=2, join_timeout_s=30, heartbeat_timeout_s=5)
    try:
        nodes = _nodes(lighthouse.address, seed, [(0, range(STEPS), 3, None, False, inner),
                                                  (1, range(STEPS), 3, None, False, inner)])
    finally:
        lighthouse.shutdown()
    for node, ranks in enumerate(nodes):
        for j, r in enumerate(ranks):
            assert r["view"] == (2, node, 3, 3), r["view"]   # every boundary committed, one quorum of both nodes
            assert r["owned"] == [j] or inner == "fsdp"       # local rank j owns shard j (FSDP: its one set)
            theta, params = fixed[node * L + j]
            e_theta, e_params = r["elastic"]
            assert torch.equal(theta, e_theta)
            assert all(torch.equal(a, b) for a, b in zip(params, e_params))
    assert torch.equal(nodes[0][0]["elastic"][0], nodes[1][0]["elastic"][0])
    assert not torch.equal(nodes[0][0]["elastic"][0], nodes[0][1]["elastic"][0])   # two shards, not one copy


def test_a_node_that_comes_back_heals_each_shard_from_the_same_rank_of_a_live_node(tmp_path) -> None:
    """Node 0 trains a period alone; node 1 then starts fresh (as a restarted node would) and
    joins at node 0's second boundary (step 9): each of its ranks receives its own shard's state
    only, from the same rank of node 0, and from then on both nodes hold one θ_g."""
    seed = int(torch.randint(0, 2**20, ()))
    ready = str(tmp_path / "node1-ready")
    lighthouse = ft.start_lighthouse("127.0.0.1", min_replicas=1, join_timeout_s=30, heartbeat_timeout_s=5)
    try:
        live, joined = _nodes(lighthouse.address, seed, [(0, range(STEPS), 3, ready, False),
                                                          (1, range(9, STEPS), 3, ready, True)])
    finally:
        lighthouse.shutdown()
    n = sum(p.numel() for p in _model(seed).parameters())
    for j in range(L):
        heal = joined[j]["heal"]
        assert heal["shards"] == [j] and heal["position"] == 2, heal
        # θ_g and the outer momentum of one shard (about half the model), not the whole model's
        assert 0 < heal["bytes"] < 2 * 4 * n, (heal, n)
        assert torch.equal(live[j]["elastic"][0], joined[j]["elastic"][0])
        assert live[j]["view"] == (2, 0, 3, 3) and joined[j]["view"] == (2, 1, 3, 3), (live[j]["view"], joined[j]["view"])
    # the healed shards, all-gathered over the node: both ranks start from the one whole θ_g
    fresh = [p.detach() for p in _model(seed).parameters()]
    assert all(torch.equal(a, b) for a, b in zip(joined[0]["adopted"], joined[1]["adopted"]))
    assert not any(torch.equal(a, b) for a, b in zip(joined[0]["adopted"], fresh))
