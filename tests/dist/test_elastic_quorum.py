"""``membership=quorum`` on real processes: torchft's Manager and Lighthouse on loopback, each
replica an ``ElasticOuter`` whose "training" is a seeded offset (θ_local = θ_g − o(replica, k)
for its k-th local round, so Δ = o(replica, k) whatever θ_g it started from).

- Without a fault, quorum rounds equal fixed ones bit for bit (θ_g and the outer momentum).
- A late replica (it arrives after its round's grace window) is left out of that round: the
  others wait the grace, not for it; it joins the next quorum, heals θ_g, the momentum and the
  position from a peer, and its Δ is carried into that round. θ_g matches a float64 reference
  of exactly that sequence, on every replica.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft  # noqa: E402
from syncplane.algorithms.diloco import lighthouse_options  # noqa: E402
from syncplane.algorithms.diloco.elastic import ElasticOuter, RoundBoard, fingerprint  # noqa: E402
from syncplane.algorithms.diloco.outer import OuterOptimizer  # noqa: E402

N, SEED, LR, MU = 4096, 11, 0.7, 0.9


def _theta0() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(SEED))


def _offset(replica: int, k: int) -> torch.Tensor:
    return 0.01 * torch.randn(N, generator=torch.Generator().manual_seed(SEED + 100 * replica + k + 1))


def _replica(rank: int, world: int, lighthouse: str, membership: str, rounds: int, round_s: float,
             late: tuple[int, int, float] | None, folder: str, grace_s: float) -> dict[str, object]:
    """Run ``rounds`` rounds; ``late = (replica, local round, extra seconds)`` delays one."""
    outer = OuterOptimizer(_theta0(), pin=False)
    events: list[dict] = []
    engine = ElasticOuter(outer, fingerprint(N, 5, "torch.optim.SGD", None, [(N,)]), rounds,
                          on_event=events.append, membership=membership,
                          board=RoundBoard(folder, f"replica{rank}") if membership == "quorum" else None,
                          hold_s=grace_s)
    group = ft.ReplicaGroup(f"replica{rank}", lighthouse, engine.state_dict, engine.load_state_dict,
                            round_timeout_s=20, quorum_timeout_s=60, min_replicas=2 if membership == "quorum" else 1)
    waits: list[float] = []
    try:
        torch.distributed.barrier()   # every replica heartbeating before the first quorum (the launcher's start_barrier)
        engine.join(group)
        k = 0
        while not engine.done:
            time.sleep(round_s + (late[2] if late is not None and late[:2] == (rank, k) else 0.0))
            flat = engine.outer.params.clone() - _offset(rank, k)
            start = time.perf_counter()
            assert engine.round_(flat)
            waits.append(time.perf_counter() - start)
            k += 1
        state = engine.outer.optimizer.state_dict()["state"][0]["momentum_buffer"]
        return {"theta": engine.outer.params.clone(), "momentum": state.clone(), "waits": waits, "events": events,
                "local_rounds": k}
    finally:
        group.close()


def _run(folder: Path, membership: str, replicas: int, rounds: int, round_s: float = 0.0, grace_s: float = 5.0,
         late: tuple[int, int, float] | None = None) -> list[dict[str, object]]:
    options = lighthouse_options({"membership": membership, "grace_s": grace_s, "min_replicas": 2,
                                  "heartbeat_timeout_s": 5.0})
    lighthouse = ft.start_lighthouse("127.0.0.1", **options)
    try:
        return run_distributed(_replica, replicas, lighthouse.address, membership, rounds, round_s, late,
                               str(folder / membership), grace_s, timeout=240)
    finally:
        lighthouse.shutdown()


def _outer_reference(mean_deltas: list[torch.Tensor]) -> torch.Tensor:
    """θ_g after SGD with Nesterov momentum (DiLoCo's default outer step), in float64."""
    theta, buf = _theta0().double(), None
    for g in mean_deltas:
        buf = g.clone() if buf is None else MU * buf + g
        theta = theta - LR * (g + MU * buf)
    return theta


def test_quorum_without_a_fault_equals_fixed_bit_for_bit(tmp_path: Path) -> None:
    fixed = _run(tmp_path, "fixed", 3, 4)
    quorum = _run(tmp_path, "quorum", 3, 4)
    for f, q in zip(fixed, quorum):
        assert torch.equal(f["theta"], q["theta"]) and torch.equal(f["momentum"], q["momentum"])
        assert torch.equal(q["theta"], quorum[0]["theta"])
        assert not any(e["event"] in ("carried", "discarded", "heal") for e in q["events"])
    reference = _outer_reference([torch.stack([_offset(r, k).double() for r in range(3)]).mean(0) for k in range(4)])
    torch.testing.assert_close(quorum[0]["theta"].double(), reference, rtol=1e-5, atol=1e-6)


def test_a_late_replica_is_left_out_within_the_grace_and_its_delta_is_carried(tmp_path: Path) -> None:
    """Rounds of 3 s, a grace of 1 s; replica 2 arrives 2.5 s late at its second round: after
    the grace closed, well before the others' next quorum."""
    grace, rounds = 1.0, 4
    results = _run(tmp_path, "quorum", 3, rounds, round_s=3.0, grace_s=grace, late=(2, 1, 2.5))
    for r in results:
        assert torch.equal(r["theta"], results[0]["theta"]), "every replica holds one θ_g"
        assert torch.equal(r["momentum"], results[0]["momentum"])
    # the on-time replicas waited the grace for the late one, not for it to arrive
    for r in results[:2]:
        assert r["local_rounds"] == rounds
        assert grace * 0.8 <= r["waits"][1] <= grace + 1.5, r["waits"]
    late = results[2]
    assert late["local_rounds"] == rounds - 1     # its second local round was carried into the third
    carried = [e for e in late["events"] if e["event"] == "carried"]
    assert carried == [{"event": "carried", "from_position": 1, "position": 2, "weight": 1.0}]
    assert any(e["event"] == "heal" for e in late["events"])
    assert [e["position"] for e in late["events"] if e["event"] == "late"] == [1]   # it waited for the next boundary
    o = lambda r, k: _offset(r, k).double()   # noqa: E731
    means = [(o(0, 0) + o(1, 0) + o(2, 0)) / 3, (o(0, 1) + o(1, 1)) / 2,
             (o(0, 2) + o(1, 2) + o(2, 1)) / 3, (o(0, 3) + o(1, 3) + o(2, 2)) / 3]
    torch.testing.assert_close(results[0]["theta"].double(), _outer_reference(means), rtol=1e-5, atol=1e-6)
