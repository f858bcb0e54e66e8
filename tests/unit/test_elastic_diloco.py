"""Elastic DiLoCo's engine (``syncplane.algorithms.diloco.elastic``) against an in-process
transport: replicas are threads meeting at barriers (the real transport, torchft's quorum,
is tested with real processes in tests/dist/test_elastic_group.py and tests/e2e/test_elastic.py).

The reference is DiLoCo's outer step written out in float64 (SGD, Nesterov momentum):
``b ← μ·b + Δ̄``, ``θ_g ← θ_g − lr·(Δ̄ + μ·b)``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from syncplane.algorithms.diloco.elastic import (
    ElasticOuter,
    JobFingerprint,
    ReplicaMismatch,
    differences,
    fingerprint,
)
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.ft import check_bind_host
from syncplane.runtime.launcher import LaunchError, launch, local_ranks

SEED = 1234
LR, MU = 0.7, 0.9


class LockstepGroup:
    """Replicas as threads: every phase is a barrier among the current members; ``lose``
    takes a member out during a round (its peers' average then fails, as a dead peer's would)."""

    def __init__(self, members: list[int]) -> None:
        self.members = list(members)
        self.barrier = threading.Barrier(len(members))
        self.values: dict[int, torch.Tensor] = {}
        self.failed_round = False
        self.quorum_id = 0
        self.engines: dict[int, ElasticOuter] = {}
        self.lock = threading.Lock()

    def transport(self, replica: int) -> "LockstepTransport":
        return LockstepTransport(self, replica)


class LockstepTransport:
    def __init__(self, group: LockstepGroup, replica: int) -> None:
        self.group, self.replica = group, replica

    def quorum(self) -> Any:
        g = self.group
        g.barrier.wait()
        if self.replica == g.members[0]:
            g.quorum_id += 1
            g.failed_round = False
        g.barrier.wait()
        # heal from the most advanced member if behind (torchft's rule: step < max step)
        ahead = max(g.members, key=lambda r: g.engines[r].position)
        me = g.engines[self.replica]
        if g.engines[ahead].position > me.position:
            me.load_state_dict(g.engines[ahead].state_dict())
        g.barrier.wait()

        class View:
            quorum_id, participants, step = g.quorum_id, len(g.members), me.position
        return View()

    def allreduce_mean_(self, flat: torch.Tensor) -> bool:
        g = self.group
        with g.lock:
            g.values[self.replica] = flat.clone()
        g.barrier.wait()
        ok = not g.failed_round
        mean = torch.stack([g.values[r] for r in g.members]).mean(0)
        g.barrier.wait()
        if ok:
            flat.copy_(mean)
        return ok

    def commit(self) -> bool:
        return not self.group.failed_round

    def close(self) -> None:
        pass


def _engine(n: int, total_rounds: int, events: list[dict[str, Any]] | None = None,
            sync_every: int = 5) -> ElasticOuter:
    torch.manual_seed(SEED)
    theta0 = torch.randn(n)
    fp = fingerprint(n, sync_every, "torch.optim.SGD", None, [(n,)])
    return ElasticOuter(OuterOptimizer(theta0, pin=False), fp, total_rounds,
                        on_event=None if events is None else events.append)


def _reference(theta0: torch.Tensor, deltas_per_round: list[torch.Tensor]) -> torch.Tensor:
    theta, buf = theta0.double().clone(), None
    for mean_delta in deltas_per_round:
        g = mean_delta.double()
        buf = g.clone() if buf is None else MU * buf + g
        theta = theta - LR * (g + MU * buf)
    return theta


def test_rounds_match_the_outer_step_reference_and_replicas_agree() -> None:
    n, replicas, rounds = 64, 3, 3
    gen = torch.Generator().manual_seed(SEED)
    locals_ = [[torch.randn(n, generator=gen) for _ in range(replicas)] for _ in range(rounds)]
    group = LockstepGroup(list(range(replicas)))
    for r in range(replicas):
        group.engines[r] = _engine(n, rounds)
    theta0 = group.engines[0].outer.params.clone()
    results: dict[int, torch.Tensor] = {}

    def run(r: int) -> None:
        eng = group.engines[r]
        eng.join(group.transport(r))
        for k in range(rounds):
            flat = locals_[k][r].clone()
            assert eng.round_(flat)
        results[r] = eng.outer.params.clone()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(replicas)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    # θ_g after each round feeds the next Δ = θ_g − θ_local: rebuild that in float64
    theta, history = theta0.double(), []
    for k in range(rounds):
        mean_delta = torch.stack([theta - x.double() for x in locals_[k]]).mean(0)
        history.append(mean_delta)
        theta = _reference(theta0, history)
    for r in range(replicas):
        torch.testing.assert_close(results[r].double(), theta, rtol=1e-5, atol=1e-5)
        assert group.engines[r].stats.committed == rounds and group.engines[r].done


def test_a_failed_round_is_discarded_everywhere_and_theta_is_unchanged() -> None:
    n = 16
    events: list[dict[str, Any]] = []
    group = LockstepGroup([0, 1])
    group.engines = {0: _engine(n, 2, events), 1: _engine(n, 2)}
    before = group.engines[0].outer.params.clone()
    flats: dict[int, torch.Tensor] = {}

    def run(r: int) -> None:
        eng = group.engines[r]
        eng.join(group.transport(r))
        group.failed_round = True   # a peer was lost in this round
        flats[r] = torch.zeros(n)
        assert not eng.round_(flats[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    eng = group.engines[0]
    torch.testing.assert_close(eng.outer.params, before)          # no outer step
    torch.testing.assert_close(flats[0], before)                  # the head holds Δ = θ_g − 0
    assert eng.stats.discarded == 1 and eng.stats.committed == 0 and eng.position == 1
    assert any(e["event"] == "discarded" for e in events)


def test_a_late_replica_heals_theta_momentum_and_position_from_a_peer() -> None:
    n = 32
    events: list[dict[str, Any]] = []
    peer, joiner = _engine(n, 10), _engine(n, 10, events)
    gen = torch.Generator().manual_seed(SEED)
    # the peer has done two rounds alone
    solo = LockstepGroup([0])
    solo.engines = {0: peer}
    peer.join(solo.transport(0))
    for _ in range(2):
        assert peer.round_(torch.randn(n, generator=gen))
    group = LockstepGroup([0, 1])
    group.engines = {0: peer, 1: joiner}
    threads = [threading.Thread(target=lambda: peer._next_quorum()),
               threading.Thread(target=lambda: joiner.join(group.transport(1)))]
    peer.transport = group.transport(0)
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    torch.testing.assert_close(joiner.outer.params, peer.outer.params)
    assert joiner.position == peer.position == 2
    mom_peer = peer.outer.optimizer.state_dict()["state"][0]["momentum_buffer"]
    mom_joiner = joiner.outer.optimizer.state_dict()["state"][0]["momentum_buffer"]
    torch.testing.assert_close(mom_joiner, mom_peer)
    assert joiner.healed and joiner.stats.heals[0]["bytes"] >= 2 * n * 4
    kinds = [e["event"] for e in events]
    assert "heal" in kinds and "membership" in kinds


def test_heal_from_a_peer_with_other_settings_is_refused_naming_the_field() -> None:
    peer, other = _engine(8, 4, sync_every=5), _engine(8, 4, sync_every=7)
    with pytest.raises(ReplicaMismatch, match="sync_every: the job has 5, this replica has 7"):
        other.load_state_dict(peer.state_dict())


def test_fingerprint_first_replica_records_later_ones_must_match(tmp_path: Path) -> None:
    job = JobFingerprint(tmp_path)
    ours = fingerprint(10, 5, "torch.optim.SGD", None, [(2, 5)])
    job.check(ours, "replica 0")
    job.check(dict(ours), "replica 1")   # the same: admitted
    wider = fingerprint(12, 5, "torch.optim.SGD", None, [(2, 6)])
    with pytest.raises(ReplicaMismatch, match=r"replica 2 cannot join.*model_shapes.*model_values: the job has 10, "
                                              r"this replica has 12"):
        job.check(wider, "replica 2")
    adam = fingerprint(10, 5, "torch.optim.Adam", {"lr": 0.1}, [(2, 5)])
    diff = differences(ours, adam)
    assert [d.split(":")[0] for d in diff] == ["outer_kwargs", "outer_optimizer"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "example.org"])
def test_lighthouse_refuses_a_wildcard_or_a_name(host: str) -> None:
    with pytest.raises(ValueError, match="lighthouse_host"):
        check_bind_host(host)


def test_launcher_restarts_a_failed_replica_and_leaves_the_others(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # rank 1 fails on its first start, succeeds on its restart; rank 0 is never touched
    code = ("import os, sys; r = os.environ['RANK']; k = os.environ['SYNCPLANE_RESTART_COUNT']; "
            "print('start', r, k); sys.exit(3 if (r, k) == ('1', '0') else 0)")
    with caplog.at_level(logging.WARNING, logger="syncplane.runtime.launcher"):
        launch([sys.executable, "-c", code], local_ranks(2), tmp_path, echo_rank0=False, max_restarts=1)
    assert (tmp_path / "rank1.log").read_text().split() == ["start", "1", "0", "start", "1", "1"]
    assert (tmp_path / "rank0.log").read_text().split() == ["start", "0", "0"]
    # the restart is the launcher's log record (train.py's Hydra logging shows it and keeps it in train.log)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("syncplane.runtime.launcher", "WARNING", "rank 1 failed (exit code 3); restart 1 of 1")]


def test_launcher_waits_restart_delay_s_before_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # each start of rank 1 records when it began; the first exits 3 at once, the restart succeeds
    code = ("import os, sys, time; k = os.environ['SYNCPLANE_RESTART_COUNT']; "
            "print('start', k, time.monotonic(), flush=True); "
            "sys.exit(3 if (os.environ['RANK'], k) == ('1', '0') else 0)")
    with caplog.at_level(logging.WARNING, logger="syncplane.runtime.launcher"):
        launch([sys.executable, "-c", code], local_ranks(2), tmp_path, echo_rank0=False, max_restarts=1,
               restart_delay_s=2.0)
    starts = [float(line.split()[2]) for line in (tmp_path / "rank1.log").read_text().splitlines()]
    assert len(starts) == 2 and starts[1] - starts[0] >= 2.0, starts
    assert [r.getMessage() for r in caplog.records] == ["rank 1 failed (exit code 3); restart 1 of 1 in 2 s"]


def test_launcher_elastic_job_fails_only_when_no_replica_finishes(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    lost_one = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    with caplog.at_level(logging.WARNING, logger="syncplane.runtime.launcher"):
        launch([sys.executable, "-c", lost_one], local_ranks(2), tmp_path / "a", echo_rank0=False, max_restarts=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"rank 1 failed (exit code 3) and is not restarted (max_restarts=0); the others go on. Its log: "
        f"{tmp_path / 'a' / 'rank1.log'}"]
    with pytest.raises(LaunchError, match="every rank failed"):
        launch([sys.executable, "-c", "raise SystemExit(4)"], local_ranks(2), tmp_path / "b", echo_rank0=False,
               max_restarts=1)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"strategy": {"kwargs": {"fragments": 2, "sync_every": 4}}}, "elastic=true supports fragments=1 only, got fragments=2"),
    ({"strategy": {"kwargs": {"compression": "int8"}}}, "supports compression=none only, got compression=int8"),
    ({"strategy": {"kwargs": {"lighthouse_host": "0.0.0.0"}}}, "would listen on every interface"),
    ({"strategy": {"kwargs": {"round_timeout_s": 0}}}, "round_timeout_s must be positive, got 0"),
    ({"trainer": {"max_restarts": -1}}, "max_restarts: must be >= 0, got -1"),
    ({"trainer": {"restart_delay_s": -1}}, "restart_delay_s: must be >= 0, got -1"),
    ({"strategy": {"kwargs": {"elastic": False}}, "trainer": {"max_restarts": 2}}, "max_restarts=2: only elastic jobs"),
    ({"strategy": {"kwargs": {"lighthouse_host": "198.18.0.1"}}, "cluster": "wan_two_sites"},
     "lighthouse_host=198.18.0.1: on an emulated cluster the quorum service runs on host 0"),
])
def test_elastic_settings_are_refused_before_any_worker_starts(tmp_path: Path, overrides: dict[str, Any],
                                                               message: str) -> None:
    from syncplane.config import ConfigError
    from syncplane.runtime.settings import parse_job

    cfg: dict[str, Any] = {"strategy": {"name": "diloco", "kwargs": {"elastic": True}}, "recipe": {"name": "digits"}}
    cfg["strategy"]["kwargs"].update(overrides.get("strategy", {}).get("kwargs", {}))
    if "trainer" in overrides:
        cfg["trainer"] = overrides["trainer"]
    if "cluster" in overrides:
        cfg["cluster"] = overrides["cluster"]
    with pytest.raises(ConfigError, match=message):
        parse_job(cfg, run_dir=str(tmp_path))


def test_launcher_ends_a_replica_left_running_after_the_others_finished(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    from syncplane.runtime.launcher import _wait_elastic

    hung = "import os, sys, time; time.sleep(60) if os.environ['RANK'] == '1' else sys.exit(0)"
    procs = [(spec, subprocess.Popen([sys.executable, "-c", hung], env={**os.environ, "RANK": str(spec.rank)}),
              tmp_path / "x") for spec in local_ranks(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="syncplane.runtime.launcher"):
            _wait_elastic(procs, lambda spec, k: procs[spec.rank], max_restarts=0, timeout_s=50, finish_grace_s=1.0)
        assert procs[0][1].returncode == 0 and procs[1][1].poll() is None   # returned; the caller ends rank 1
        assert [r.getMessage() for r in caplog.records] == [
            "rank(s) 1 still running 1 s after the job's first replica finished (hung, or restarted too late): ended"]
    finally:
        procs[1][1].kill()
        procs[1][1].wait()


def test_diloco_with_elastic_true_builds_the_elastic_strategy_and_the_modes_do_not_mix() -> None:
    """One strategy name for both modes: the registry's ``diloco`` class picks ``ElasticDiLoCo``
    for ``elastic=True``; each class refuses the other mode's flag."""
    from syncplane.strategies.diloco import DiLoCo
    from syncplane.strategies.diloco_elastic import ElasticDiLoCo
    from syncplane.strategies.registry import strategy_class

    plain, elastic = strategy_class("diloco")(sync_every=4), strategy_class("diloco")(sync_every=4, elastic=True)
    assert type(plain) is DiLoCo and not plain.elastic
    assert type(elastic) is ElasticDiLoCo and elastic.elastic and elastic.round_timeout_s == 30.0
    with pytest.raises(ValueError, match="elastic=False on ElasticDiLoCo"):
        ElasticDiLoCo(sync_every=4)
    with pytest.raises(ValueError, match="supports streams=1 only"):
        DiLoCo(sync_every=4, elastic=True, streams=2)
