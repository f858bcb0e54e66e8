"""Elastic DiLoCo's membership (``syncplane.algorithms.diloco.elastic.Membership``) against an
in-process torchft group: the vote at a boundary, a heal and what it carries, a peer with other
settings refused, the fingerprint on disk; and the launcher's elastic mode. The round itself is
``DiLoCoEngine``'s over the quorum, on real processes: tests/dist/test_elastic_engine.py; torchft's
quorum: tests/dist/test_elastic_group.py and tests/e2e/test_elastic.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from syncplane.algorithms.diloco.elastic import (
    JobFingerprint,
    Membership,
    QuorumTransport,
    ReplicaMismatch,
    differences,
    fingerprint,
)
from syncplane.algorithms.diloco.ft import check_bind_host
from syncplane.algorithms.diloco.streaming import FragmentedOuter
from syncplane.runtime.launcher import LaunchError, launch, local_ranks

SEED = 1234


class FakeGroup:
    """torchft's side as ``Membership`` sees it: a quorum (healing from ``peer`` when its step is
    ahead, as torchft's rule), the error report and the commit vote that advances the step."""

    host = "127.0.0.1"

    def __init__(self, membership: Membership, peer: Membership | None = None, peer_step: int = 0) -> None:
        self.membership, self.peer, self.peer_step = membership, peer, peer_step
        self.step, self.errors, self.quorums = 0, [], 0

    def quorum(self) -> Any:
        self.quorums += 1
        if self.peer is not None and self.peer_step > self.step:
            self.membership.load_state_dict(self.peer.state_dict())
            self.step = self.peer_step
        return SimpleNamespace(quorum_id=self.quorums, participants=2 if self.peer else 1, step=self.step, rank=0,
                               store_addr="")

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def commit(self) -> bool:
        ok = not self.errors
        self.step += ok
        self.errors = []
        return ok

    def set_step(self, step: int) -> None:
        self.step = step

    def close(self) -> None:
        pass


def _membership(n: int = 32, sync_every: int = 5, events: list | None = None,
                total: int = 10) -> tuple[Membership, FragmentedOuter]:
    torch.manual_seed(SEED)
    flat = torch.randn(n)
    outer = FragmentedOuter(flat, n, 2, sync_every, "torch.optim.SGD", None, pin=False)
    fp = fingerprint(n, sync_every, "torch.optim.SGD", None, [(n,)], {"fragments": 2})
    membership = Membership(QuorumTransport("127.0.0.1", 5.0), fp, total, outer.state_dict, outer.load_state_dict,
                            on_event=None if events is None else events.append)
    return membership, outer


def _advance(outer: FragmentedOuter, gen: torch.Generator) -> None:
    """A committed round of each fragment, averaging to a random Δ."""
    for p in range(2):
        outer.flat.copy_(torch.randn(outer.flat.numel(), generator=gen))
        outer.launch(p, lambda flat, _: True, due=0, background=False)
        outer.pop(p)


def test_an_unknown_outcome_votes_against_the_commit_and_a_clean_period_commits() -> None:
    membership, _ = _membership()
    group = FakeGroup(membership)
    membership.join(group)
    membership.boundary()
    assert (group.step, membership.position) == (1, 1)
    membership.transport.uncertain = RuntimeError("the agreement broke off")
    membership.boundary()
    # the step stays behind (a peer that committed heals this replica at the next quorum), the job goes on
    assert (group.step, membership.position) == (1, 2) and membership.transport.uncertain is None
    membership.record(False)
    assert membership.stats.as_dict()["rounds_discarded"] == 1


def test_a_committed_round_carries_the_work_of_its_fragments_discarded_rounds() -> None:
    events: list[dict[str, Any]] = []
    membership, _ = _membership(events=events)
    for committed, fragment in [(False, 0), (True, 1), (True, 0), (True, 0)]:
        membership.record(committed, fragment, fragments=2)
    assert [e["weight"] for e in events if e["event"] == "round"] == [0.0, 0.5, 1.0, 0.5]


def test_a_late_replica_heals_every_fragments_theta_and_momentum_and_the_position_from_a_peer() -> None:
    events: list[dict[str, Any]] = []
    peer, peer_outer = _membership()
    joiner, joiner_outer = _membership(events=events)
    gen = torch.Generator().manual_seed(SEED)
    peer.join(FakeGroup(peer))
    for _ in range(3):   # the peer has gone three periods alone
        _advance(peer_outer, gen)
        peer.record(True)
        peer.record(True)
        peer.boundary()
    joiner.join(FakeGroup(joiner, peer, peer_step=3))
    assert joiner.healed and joiner.position == peer.position == 3
    torch.testing.assert_close(joiner_outer.params, peer_outer.params)
    for mine, theirs in zip(joiner_outer.outers, peer_outer.outers):
        mom = [o.optimizer.state_dict()["state"][0]["momentum_buffer"] for o in (mine, theirs)]
        torch.testing.assert_close(*mom)
    assert joiner.stats.committed == 6 and joiner.stats.heals[0]["bytes"] >= 2 * 32 * 4
    kinds = [e["event"] for e in events]
    assert "heal" in kinds and "membership" in kinds


def test_heal_from_a_peer_with_other_settings_is_refused_naming_the_field() -> None:
    peer, _ = _membership(sync_every=5)
    other, _ = _membership(sync_every=7)
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
    ({"strategy": {"kwargs": {"exchange": "tree"}}}, "exchange=tree with elastic=true"),
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
    assert DiLoCo(sync_every=4, elastic=True, streams=2, compression="int8").config.streams == 2
    with pytest.raises(ValueError, match="exchange=tree with elastic=true"):
        DiLoCo(sync_every=4, elastic=True, exchange="tree")
    # membership=quorum: the same class and round (every codec, fragments, overlap)
    quorum = DiLoCo(sync_every=4, elastic=True, membership="quorum", compression="int8", fragments=2, overlap_steps=1)
    assert type(quorum) is ElasticDiLoCo and quorum.quorum
    with pytest.raises(ValueError, match="inner_steps=time with membership=quorum"):
        DiLoCo(sync_every=4, elastic=True, membership="quorum", inner_steps="time")
