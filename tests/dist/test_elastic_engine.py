"""Elastic mode runs ``DiLoCoEngine``'s own round over a torchft quorum (real processes, real
gloo): with no fault, replicas that are each a job of one process, meeting through a
Lighthouse on loopback, end with the θ_g and local models of the same ranks in one fixed
job, bit for bit -- with int8 and its error feedback, two streams, two fragments and an
overlap of one step (the schedule and codec that cross the wire differently from plain rounds)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_diloco_nodes import _inner_step, _model
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft  # noqa: E402

KWARGS = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compression": "int8", "block_size": 4,
          "streams": 2, "exchange": "mesh"}
STEPS = 13   # boundaries at 5, 9 and 13 (kH + τ): the round at 12 merges at 13


def _drive(engine, model, optimizer, seed: int, rank: int, step: int, boundary=None, inner=None) -> None:
    """One inner step (of ``inner``, a node's DDP module, else of ``model``), then the strategy's
    schedule (``DiLoCo.after_optimizer_step``)."""
    from syncplane.comm import CommMeter

    _inner_step(model if inner is None else inner, optimizer, seed, rank, step)
    tensors, done, config = [p.data for p in model.parameters()], step + 1, engine.config
    for fragment in engine.starting(done):
        engine.launch(tensors, fragment, done + config.overlap_steps, config.overlap_steps > 0, CommMeter())
    for round_ in engine.pop_due(done):
        engine.merge(tensors, round_, config.alpha)
    if boundary is not None and done >= config.sync_every and done % config.sync_every == config.overlap_steps:
        boundary()


def elastic_vs_fixed(rank: int, world: int, lighthouse: str, seed: int) -> dict:
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.elastic import Membership, QuorumTransport
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    config = DiLoCoConfig(**KWARGS)
    out = {}
    # the fixed job: the ranks of one torch.distributed job
    model = _model(seed)
    engine = DiLoCoEngine(model, config, JobContext(rank=rank, world_size=world), ReplicaLayout.of_sizes([1] * world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        _drive(engine, model, optimizer, seed, rank, step)
    engine.wait()
    out["fixed"] = (engine.params.clone(), [p.detach().clone() for p in model.parameters()])
    engine.close()

    # the elastic job: each replica a job of one rank, the exchange over the quorum
    model = _model(seed)
    transport = QuorumTransport("127.0.0.1", 20.0)
    engine = DiLoCoEngine(model, config, JobContext(rank=0, world_size=1), ReplicaLayout.of_sizes([1]),
                          transport=transport)
    membership = Membership(transport, {"job": 1}, total=3, outer_state=engine.state_dict,
                            load_outer_state=engine.load_state_dict)
    group = ft.ReplicaGroup(f"replica{rank}", lighthouse, membership.state_dict, membership.load_state_dict,
                            round_timeout_s=20, quorum_timeout_s=60)
    try:
        membership.join(group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            _drive(engine, model, optimizer, seed, rank, step, membership.boundary)
        engine.wait()
        out["elastic"] = (engine.params.clone(), [p.detach().clone() for p in model.parameters()])
        out["view"] = (transport.view.participants, transport.view.rank, membership.position, group.step)
        out["exchange"] = engine.exchange_name, engine.streams
    finally:
        engine.close()
        membership.close()
    return out


def test_elastic_rounds_with_int8_streams_fragments_and_overlap_equal_the_fixed_job_bit_for_bit() -> None:
    seed = int(torch.randint(0, 2**20, ()))
    lighthouse = ft.start_lighthouse("127.0.0.1", min_replicas=2, join_timeout_s=30, heartbeat_timeout_s=5)
    try:
        results = run_distributed(elastic_vs_fixed, 2, lighthouse.address, seed, timeout=240)
    finally:
        lighthouse.shutdown()
    for rank, r in enumerate(results):
        assert r["view"] == (2, rank, 3, 3), r["view"]   # every boundary committed, one quorum of both
        assert r["exchange"] == ("mesh", 2)
        theta, params = r["fixed"]
        e_theta, e_params = r["elastic"]
        assert torch.equal(theta, e_theta)
        assert all(torch.equal(a, b) for a, b in zip(params, e_params))
    assert torch.equal(results[0]["elastic"][0], results[1]["elastic"][0])
    assert not torch.equal(results[0]["elastic"][0], torch.cat([p.detach().reshape(-1) for p in _model(seed).parameters()]))
