"""``membership=quorum`` on real processes, through ``DiLoCoEngine`` (int8 with its error
feedback, two streams, two fragments, an overlap of one step): torchft's Manager and
Lighthouse on loopback, each replica a job of one process meeting the others at the quorum
points before each period's rounds (``Membership.point``).

- Without a fault, the replicas' θ_g and models equal those of the same ranks in one fixed
  torch.distributed job, bit for bit (every weight equal: the factor on Δ is exactly 1).
- A late replica (it reaches its point after the grace window closed) is left out of that
  period: the others wait the grace, not for it; it trains on until the next point opens,
  joins that quorum behind by one commit, heals θ_g and the position from a peer, and its
  work is carried (its model rebased onto the new θ_g, its Δ weighted by all its steps).
  Every replica ends with one θ_g.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from tests.dist.test_diloco_nodes import _inner_step, _model
from tests.dist.test_elastic_engine import KWARGS, STEPS, _drive
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft  # noqa: E402
from syncplane.algorithms.diloco import lighthouse_options  # noqa: E402


def _quorum_job(rank: int, seed: int, lighthouse: str, folder: str, grace_s: float, step_s: float,
                late: tuple[int, int, float] | None) -> dict:
    """One replica of the quorum job, driven as ``ElasticDiLoCo.after_optimizer_step`` drives it;
    ``late = (replica, local step, seconds)``: that replica stalls before that step's point."""
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.elastic import Membership, QuorumTransport, RoundBoard
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    config = DiLoCoConfig(**KWARGS, membership="quorum", grace_s=grace_s)
    H, tau = config.sync_every, config.overlap_steps
    model = _model(seed)
    transport = QuorumTransport("127.0.0.1", 20.0)
    engine = DiLoCoEngine(model, config, JobContext(rank=0, world_size=1), ReplicaLayout.of_sizes([1]),
                          transport=transport)
    events: list[dict] = []
    membership = Membership(transport, {"job": 1}, STEPS // H, engine.state_dict, engine.load_state_dict,
                            on_event=events.append, board=RoundBoard(folder, f"replica{rank}"), hold_s=grace_s,
                            boundary_timeout_s=30)
    group = ft.ReplicaGroup(f"replica{rank}", lighthouse, membership.state_dict, membership.load_state_dict,
                            round_timeout_s=20, quorum_timeout_s=60, min_replicas=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tensors = [p.data for p in model.parameters()]
    waits, weights, offset, since, out, scale, local = [], [], 0, 0, False, 1.0, 0
    try:
        torch.distributed.barrier()   # every replica heartbeating before the first quorum (the launcher's)
        membership.join(group)
        while True:
            _inner_step(model, optimizer, seed, rank, local)
            time.sleep(step_s)
            if late is not None and late[:2] == (rank, local):
                time.sleep(late[2])
            since += 1
            done, run, start = local + offset + 1, True, time.perf_counter()
            if out:
                run = not membership.late()
                if run:
                    old = engine.params.clone()
                    membership.rejoin((since - H) / H)
                    if membership.healed:
                        engine.rebase(tensors, old)
                        membership.healed = False
                    offset, done, out = membership.position * H - done + offset, membership.position * H, False
            elif done % H == 0 and membership.position < membership.total:
                run = membership.point()
                out = not run
                waits.append(time.perf_counter() - start)
            if run and done % H == 0:
                scale = membership.scale(since)
                weights.append(since)
                membership.work, since = since / H, 0
            if run:
                for fragment in engine.starting(done):
                    engine.launch(tensors, fragment, done + tau, tau > 0, CommMeter(), scale=scale)
                for round_ in engine.pop_due(done):
                    engine.merge(tensors, round_, config.alpha)
            if done >= STEPS:
                engine.wait()
                break
            local += 1
        return {"theta": engine.params.clone(), "params": [p.detach().clone() for p in model.parameters()],
                "events": events, "waits": waits, "weights": weights, "local_steps": local + 1,
                "position": membership.position}
    finally:
        engine.close()
        membership.close()


def _fixed_job(rank: int, world: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same ranks as one fixed torch.distributed job (``test_elastic_engine``'s reference)."""
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    model = _model(seed)
    engine = DiLoCoEngine(model, DiLoCoConfig(**KWARGS), JobContext(rank=rank, world_size=world),
                          ReplicaLayout.of_sizes([1] * world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        _drive(engine, model, optimizer, seed, rank, step)
    engine.wait()
    try:
        return engine.params.clone(), [p.detach().clone() for p in model.parameters()]
    finally:
        engine.close()


def _both(rank: int, world: int, lighthouse: str, folder: str, seed: int, grace_s: float, step_s: float,
          late: tuple[int, int, float] | None, fixed: bool) -> dict:
    out = _quorum_job(rank, seed, lighthouse, folder, grace_s, step_s, late)
    if fixed:
        out["fixed"] = _fixed_job(rank, world, seed)
    return out


def _run(folder: Path, replicas: int, seed: int, grace_s: float, step_s: float = 0.0,
         late: tuple[int, int, float] | None = None, fixed: bool = False) -> list[dict]:
    options = lighthouse_options({"membership": "quorum", "grace_s": grace_s, "min_replicas": 2,
                                  "heartbeat_timeout_s": 5.0})
    lighthouse = ft.start_lighthouse("127.0.0.1", **options)
    try:
        return run_distributed(_both, replicas, lighthouse.address, str(folder), seed, grace_s, step_s, late, fixed,
                               timeout=240)
    finally:
        lighthouse.shutdown()


def _digest(theta: torch.Tensor) -> str:
    return hashlib.sha256(theta.numpy().tobytes()).hexdigest()


def test_quorum_rounds_with_int8_fragments_and_overlap_equal_the_fixed_job_bit_for_bit(tmp_path: Path) -> None:
    seed = int(torch.randint(0, 2**20, ()))
    results = _run(tmp_path, 2, seed, grace_s=5.0, fixed=True)
    for r in results:
        theta, params = r["fixed"]
        assert torch.equal(theta, r["theta"])
        assert all(torch.equal(a, b) for a, b in zip(params, r["params"]))
        assert not any(e["event"] in ("late", "carried", "discarded", "heal") for e in r["events"]), r["events"]
        assert r["weights"] == [4, 4, 4] and r["position"] == STEPS // 4
    assert len({_digest(r["theta"]) for r in results}) == 1
    assert not torch.equal(results[0]["theta"], torch.cat([p.detach().reshape(-1) for p in _model(seed).parameters()]))


def test_a_late_replica_is_left_out_within_the_grace_and_its_work_is_carried(tmp_path: Path) -> None:
    """Steps of 0.75 s (periods of 3 s), a grace of 1 s; replica 2 stalls 2.5 s before its
    second point: after the grace closed, before the others' next point."""
    grace = 1.0
    results = _run(tmp_path, 3, 7, grace_s=grace, step_s=0.75, late=(2, 7, 2.5))
    assert len({_digest(r["theta"]) for r in results}) == 1, "every replica holds one θ_g"
    for r in results[:2]:   # the on-time replicas waited the grace at point 2, not for the late one
        assert grace * 0.8 <= r["waits"][1] <= grace + 1.5, r["waits"]
        assert r["weights"] == [4, 4, 4]
    late = results[2]
    events = [e["event"] for e in late["events"]]
    assert "late" in events and "heal" in events and "carried" in events, late["events"]
    assert late["weights"][0] == 4 and late["weights"][1] > 4, late["weights"]   # all its steps since its last Δ
    carried = next(e for e in late["events"] if e["event"] == "carried")
    assert carried["weight"] == (late["weights"][1] - 4) / 4
