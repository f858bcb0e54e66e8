"""``syncplane chaos`` without launching a job: the fault specs, where they land, what the
watcher reads from logs and processes, the checkpoint check, and the verdict.

The end-to-end run (a real job, a real fault) is ``tests/e2e/test_chaos.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from syncplane.cluster import load_profile
from syncplane.config import ConfigError
from syncplane.experiments import chaos
from syncplane.experiments.chaos import FaultSpec, Observation, RankSeen, parse_fault, plan_faults
from syncplane.runtime.settings import FaultSettings, parse_faults, parse_job

MULTI_NIC = load_profile("multi_nic")   # hosts n0 (ranks 0, 1) and n1 (ranks 2, 3)


@pytest.mark.parametrize(("text", "expected"), [
    ("kill:host=1:step=20", FaultSpec("kill:host=1:step=20", "kill", 20, host=1)),
    ("stop:rank=2:step=5", FaultSpec("stop:rank=2:step=5", "stop", 5, rank=2)),
    ("netdown:step=10:host=0", FaultSpec("netdown:step=10:host=0", "netdown", 10, host=0)),
    ("raise:rank=0:step=1", FaultSpec("raise:rank=0:step=1", "raise", 1, rank=0)),
])
def test_fault_specs_parse(text: str, expected: FaultSpec) -> None:
    assert parse_fault(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("explode:rank=1:step=3", "unknown kind 'explode'; allowed kinds: kill, stop, raise, netdown"),
    ("kill:rank=1", r"step=S \(>= 1, the training step after which it fails\) is missing"),
    ("kill:rank=1:step=0", "step=S"),
    ("kill:step=3", "name exactly one of rank=N"),
    ("kill:rank=1:host=0:step=3", "name exactly one of rank=N"),
    ("kill:node=1:step=3", "'node=1' is not rank=N, host=N or step=N"),
    ("kill:rank=one:step=3", "rank must be a whole number >= 0, got 'one'"),
    ("kill:rank=-1:step=3", "rank must be a whole number >= 0, got '-1'"),
    ("kill:rank=1:rank=2:step=3", "rank is given twice"),
])
def test_bad_fault_specs_are_refused_naming_the_spec(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_fault(text)
    assert f"--fault {text!r}" in str(info.value)


def test_a_host_fault_fails_every_rank_of_the_host() -> None:
    [kill] = plan_faults([parse_fault("kill:host=1:step=20")], 4, MULTI_NIC)
    assert kill.injected == kill.lost == [2, 3]
    assert chaos.fault_config([kill]) == [{"kind": "kill", "rank": 2, "step": 20}, {"kind": "kill", "rank": 3, "step": 20}]
    assert chaos.fault_override([kill]) == "fault=[{kind:kill,rank:2,step:20},{kind:kill,rank:3,step:20}]"


def test_netdown_is_injected_once_and_loses_the_whole_host() -> None:
    by_host, = plan_faults([parse_fault("netdown:host=1:step=10")], 4, MULTI_NIC)
    by_rank, = plan_faults([parse_fault("netdown:rank=3:step=10")], 4, MULTI_NIC)
    assert (by_host.injected, by_host.lost) == ([2], [2, 3])
    assert (by_rank.injected, by_rank.lost) == ([3], [2, 3])


@pytest.mark.parametrize(("faults", "profile", "message"), [
    (["stop:rank=4:step=5"], None, "rank 4 is not a rank of this job of 4 \\(trainer.devices\\)"),
    (["kill:host=2:step=5"], MULTI_NIC, "host 2 is not a host of cluster 'multi_nic' \\(hosts: 0=n0, 1=n1\\)"),
    (["kill:host=0:step=5"], None, "host=N names a host of an emulated cluster and this job runs on this machine"),
    (["netdown:rank=1:step=5"], None, "netdown takes an emulated host's NICs down; it needs cluster=NAME"),
    (["kill:host=0:step=5", "stop:rank=1:step=9"], MULTI_NIC, "rank 1 is already failed by --fault 'kill:host=0"),
    (["kill:host=0:step=5", "netdown:rank=2:step=9"], MULTI_NIC, "take every rank of the job of 4 down"),
    ([], None, "give at least one fault"),
])
def test_faults_that_cannot_run_are_refused_before_anything_starts(faults: list[str], profile, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_faults([parse_fault(f) for f in faults], 4, profile)


@pytest.mark.parametrize(("overrides", "faults", "message"), [
    (["strategy=ddp", "fault={kind:stop,rank:1,step:3}"], ["kill:rank=1:step=3"], "give faults with --fault"),
    (["strategy=ddp", "+fault.rank=1"], ["kill:rank=1:step=3"], "give faults with --fault"),
    (["strategy=ddp", "hydra.run.dir=/tmp/x"], ["kill:rank=1:step=3"], "sets the run directory itself"),
    (["strategy=ddp", "trainer.devices=2"], ["netdown:rank=1:step=3"], "netdown .* needs cluster=NAME"),
    (["strategy=nope"], ["kill:rank=1:step=3"], "composing the job"),
    (["strategy=ddp", "trainer.devices=2"], ["stop:rank=2:step=3"], "rank 2 is not a rank of this job of 2"),
])
def test_prepare_refuses_a_bad_job_before_it_starts(tmp_path: Path, overrides: list[str], faults: list[str],
                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        chaos.prepare(overrides, faults, tmp_path)
    assert not (tmp_path / "logs").exists()


def test_prepare_refuses_a_run_directory_that_holds_a_run(tmp_path: Path) -> None:
    plan = chaos.prepare(["strategy=ddp", "trainer.devices=2"], ["kill:rank=1:step=3"], tmp_path / "new")
    assert plan.run_dir == (tmp_path / "new").resolve() and plan.job.faults == [FaultSettings("kill", 1, 3)]
    (tmp_path / "job.yaml").write_text("config: {}\n")
    with pytest.raises(ConfigError, match="holds a run already; give a fresh directory"):
        chaos.prepare(["strategy=ddp"], ["kill:rank=1:step=3"], tmp_path)


def test_the_job_config_takes_one_fault_or_a_list_and_a_rank_fails_once() -> None:
    assert parse_faults(None) == []
    assert parse_faults({"kind": "kill", "rank": 1, "step": 3}) == [FaultSettings("kill", 1, 3)]
    assert parse_faults([{"kind": "kill", "rank": 2, "step": 3}, {"kind": "stop", "rank": 3, "step": 4}]) == [
        FaultSettings("kill", 2, 3), FaultSettings("stop", 3, 4)]
    with pytest.raises(ConfigError, match=r"fault: rank\(s\) 2 given more than one fault"):
        parse_faults([{"kind": "kill", "rank": 2, "step": 3}, {"kind": "stop", "rank": 2, "step": 4}])
    with pytest.raises(ConfigError, match=r"fault\[1\].kind: got 'boom'"):
        parse_faults([{"kind": "kill", "rank": 2, "step": 3}, {"kind": "boom", "rank": 1, "step": 4}])


# ------------------------------------------------------------------ the watcher


def test_the_watcher_reads_fault_and_error_lines_as_they_appear(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    watch = chaos.JobWatch(tmp_path, 3, started=0.0)
    (tmp_path / "logs" / "rank2.log").write_text("epoch 1/3\nfault: rank 2 fails (stop) after step 15, as fault.* "
                                                 "asked\n")
    (tmp_path / "logs" / "rank0.log").write_text("UserWarning: not an error\nsyncplane: rank 2 stopped sen")
    watch.poll()
    assert watch.ranks[2].fired_at is not None and watch.ranks[0].errors == []   # half a line is not read yet
    with open(tmp_path / "logs" / "rank0.log", "a") as f:
        f.write("ding heartbeats 3 s ago; noticed by rank 1\nTraceback (most recent call last):\n"
                "torch.distributed.DistBackendError: Connection closed by peer\n"
                "[rank0]: RuntimeError: [pair.cc:561] Connection closed by peer [198.18.0.2]:61104\n")
    watch.poll()
    assert [line for _, line in watch.ranks[0].errors] == [
        "syncplane: rank 2 stopped sending heartbeats 3 s ago; noticed by rank 1",
        "torch.distributed.DistBackendError: Connection closed by peer",
        "[rank0]: RuntimeError: [pair.cc:561] Connection closed by peer [198.18.0.2]:61104"]
    assert watch.ranks[1] == RankSeen()


def test_the_watcher_sees_a_rank_process_start_and_end(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    rank = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                             str(job_file)], env={"RANK": "1", "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"up\n"   # it runs the command by now
        assert chaos.job_processes(job_file) == {rank.pid: 1}
        watch = chaos.JobWatch(tmp_path, 2, started=0.0)
        watch.poll()
        assert watch.ranks[1].alive and watch.ranks[1].exited_at is None and not watch.ranks[0].alive
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()
    watch.poll()
    assert not watch.ranks[1].alive and watch.ranks[1].exited_at is not None
    assert chaos.job_processes(job_file) == {}


# ------------------------------------------------------------------ the checkpoint


def _history(run_dir: Path, *steps: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"epoch": i, "step": s, "val_acc": 0.5}) for i, s in enumerate(steps)]
    (run_dir / "history.jsonl").write_text("\n".join([*lines, json.dumps({"event": "membership", "step": 99})]) + "\n")


def _checkpoint(run_dir: Path, obj: object) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.save(obj, run_dir / "checkpoints" / "last.ckpt")


class NotWeights:   # an object weights_only=True refuses to unpickle
    pass


def test_the_checkpoint_before_the_fault_must_exist_and_load_weights_only(tmp_path: Path) -> None:
    _history(tmp_path, 11, 22)
    _checkpoint(tmp_path, {"global_step": 11, "state_dict": {"w": torch.ones(2)}})
    good = chaos.check_checkpoint(tmp_path, fault_step=15)
    assert good["ok"] and good["loads"] and good["global_step"] == 11 and good["due_step"] == 11

    _checkpoint(tmp_path, {"global_step": 11, "extra": NotWeights()})
    bad = chaos.check_checkpoint(tmp_path, fault_step=15)
    assert not bad["ok"] and bad["loads"] is False and "does not load with weights_only=True" in bad["error"]

    _checkpoint(tmp_path, {"global_step": 0})
    old = chaos.check_checkpoint(tmp_path, fault_step=15)
    assert not old["ok"] and "holds step 0; expected the one written at step 11" in old["error"]

    (tmp_path / "checkpoints" / "last.ckpt").unlink()
    missing = chaos.check_checkpoint(tmp_path, fault_step=15)
    assert not missing["ok"] and "no checkpoint, although validation ended at step 11" in missing["error"]
    early = chaos.check_checkpoint(tmp_path, fault_step=5)   # the fault came before the first validation
    assert early["ok"] and early["due_step"] is None


# ------------------------------------------------------------------ the report and its verdict


@pytest.fixture(scope="module")
def ddp_plan(tmp_path_factory: pytest.TempPathFactory) -> chaos.ChaosPlan:
    run_dir = tmp_path_factory.mktemp("run")
    job = parse_job({"strategy": {"name": "ddp"}, "recipe": {"name": "digits"}, "trainer": {"devices": 4},
                     "fault": {"kind": "stop", "rank": 2, "step": 15}}, run_dir=str(run_dir))
    faults = plan_faults([parse_fault("stop:rank=2:step=15")], 4)
    return chaos.ChaosPlan(["strategy=ddp", "trainer.devices=4"], job, faults, run_dir)


LAUNCHER_OUTPUT = ("syncplane: ddp on digits with 4 processes on this machine; run dir /x\nepoch 1/3  step 11\n"
                   "syncplane: training failed: rank 1 failed (exit code 75); the other ranks were stopped. Its log: "
                   "/x/logs/rank1.log\n--- last lines of rank 1 ---\nsyncplane: rank 2 stopped sending heartbeats "
                   "16 s ago (hung, stopped, or its host lost the network); noticed by rank 1\n")
HEARTBEAT = "syncplane: rank 2 stopped sending heartbeats 16 s ago (...); noticed by rank 1"


def _stopped_rank_2(**launcher: object) -> Observation:
    """What the watcher sees when rank 2 hangs after 20 s and the heartbeat ends the job."""
    ranks = {r: RankSeen(exited_at=40.0) for r in range(4)}
    ranks[2] = RankSeen(fired_at=20.0, exited_at=41.0)
    for r in (0, 1, 3):
        ranks[r].errors = [(5.0, "UserWarning-free noise before the fault: RuntimeError: x"), (36.5 + r / 10, HEARTBEAT)]
    return Observation(ranks=ranks, **{"ended_at": 42.0, "exit_code": 1, "output": LAUNCHER_OUTPUT, **launcher})


def test_a_job_that_fails_fast_and_clean_keeps_the_promise(ddp_plan: chaos.ChaosPlan) -> None:
    checkpoint = {"path": "x", "ok": True, "loads": True, "global_step": 11, "error": None}
    report = chaos.analyse(ddp_plan, _stopped_rank_2(), checkpoint, deadline_s=30)
    assert report["ok"] and report["problems"] == []
    assert report["lost_ranks"] == [2]
    assert report["faults"][0]["fired"] and report["faults"][0]["fired_at_s"] == {"2": 20.0}
    survivors = [r for r in report["ranks"] if r["role"] == "survivor"]
    assert [r["error_after_s"] for r in survivors] == [16.5, 16.6, 16.8]     # the error written after the fault
    assert all(r["error"] == HEARTBEAT and r["names_lost_rank"] for r in survivors)
    assert report["launcher"] == {"exit_code": 1, "ended_after_s": 22.0, "stopped_by_chaos": False,
                                  "error": "syncplane: training failed: rank 1 failed (exit code 75); the other ranks "
                                           "were stopped. Its log: /x/logs/rank1.log",
                                  "names_lost_rank": True, "records": []}
    json.dumps(report)   # the JSON file takes it as it is


@pytest.mark.parametrize(("launcher", "checkpoint_ok", "problem"), [
    ({"exit_code": 0}, True, r"the job exited 0 although it lost rank\(s\) \[2\]"),
    ({"ended_at": 55.0}, True, "the job ended 35.0 s after the fault; the deadline is 30 s"),
    ({"stopped_by_chaos": True}, True, "syncplane chaos stopped it at --timeout-s"),
    ({"leftover": [{"pid": 4242, "rank": 3}]}, True, r"1 process\(es\) left running after the launcher exited: 4242"),
    ({}, False, "checkpoint x: gone"),
    ({"output": "syncplane: training failed: rank 0 failed (exit code 1)\nConnection reset\n"}, True, None),
])
def test_each_broken_promise_is_a_problem(ddp_plan: chaos.ChaosPlan, launcher: dict, checkpoint_ok: bool,
                                          problem: str | None) -> None:
    seen = _stopped_rank_2(**launcher)
    checkpoint = {"path": "x", "ok": checkpoint_ok, "error": None if checkpoint_ok else "gone"}
    report = chaos.analyse(ddp_plan, seen, checkpoint, deadline_s=30)
    if problem is None:    # the launcher named another rank, but the survivors' errors name rank 2
        assert report["ok"] and not report["launcher"]["names_lost_rank"]
    else:
        assert not report["ok"] and any(re.search(problem, p) for p in report["problems"]), report


def test_a_fault_that_never_fired_or_an_unnamed_loss_is_a_problem(ddp_plan: chaos.ChaosPlan) -> None:
    never = Observation(ranks={r: RankSeen() for r in range(4)}, ended_at=30.0, exit_code=0, output="")
    report = chaos.analyse(ddp_plan, never, None, deadline_s=30)
    assert "no fault fired: the job ended before the step it was to fail at" in report["problems"]
    unnamed = _stopped_rank_2(output="syncplane: training failed: rank 0 failed (exit code 1)\n")
    for r in (0, 1, 3):
        unnamed.ranks[r].errors = [(21.0, "RuntimeError: Connection closed by peer [127.0.0.1]:4021")]
    report = chaos.analyse(ddp_plan, unnamed, None, deadline_s=30)
    assert report["problems"] == ["no error names the lost rank(s) [2]"]


def test_an_elastic_job_must_go_on(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    job = parse_job({"strategy": {"name": "diloco", "kwargs": {"elastic": True}}, "recipe": {"name": "digits"},
                     "trainer": {"devices": 3, "max_restarts": 1}}, run_dir=str(tmp_path))
    plan = chaos.ChaosPlan([], job, plan_faults([parse_fault("kill:rank=2:step=7")], 3), tmp_path)
    ranks = {0: RankSeen(), 1: RankSeen(), 2: RankSeen(fired_at=10.0, exited_at=10.2, restarted=True)}
    output = "[2026-11-23 03:00:00,000][syncplane.runtime.launcher][WARNING] - rank 2 failed (signal 9); restart 1 of 1\n"
    went_on = chaos.analyse(plan, Observation(ranks=ranks, ended_at=60.0, exit_code=0, output=output), None, 30)
    assert went_on["ok"] and went_on["launcher"]["records"] == ["rank 2 failed (signal 9); restart 1 of 1"]
    assert went_on["ranks"][2]["restarted"]
    stopped = chaos.analyse(plan, Observation(ranks=ranks, ended_at=20.0, exit_code=1, output=""), None, 30)
    assert stopped["problems"] == ["the elastic job exited 1; it should have gone on without the lost replica(s) [2]"]


def test_the_matrix_plans_every_cell_up_front_and_puts_netdown_on_a_cluster(tmp_path: Path) -> None:
    plans = chaos.matrix_plans(["ddp", "atc"], ["kill", "netdown"], ["trainer.devices=4"], tmp_path, rank=2, step=12)
    cells = [(p.job.strategy.name, p.faults[0].spec.kind, p.job.cluster and p.job.cluster.name) for p in plans]
    assert cells == [("ddp", "kill", None), ("ddp", "netdown", chaos.NETDOWN_CLUSTER), ("atc", "kill", None),
                     ("atc", "netdown", chaos.NETDOWN_CLUSTER)]
    assert [p.run_dir.name for p in plans] == ["ddp-kill", "ddp-netdown", "atc-kill", "atc-netdown"]
    assert plans[1].faults[0].lost == [2, 3]          # netdown loses rank 2's whole host


def test_a_node_replica_row_runs_on_hosts_of_two_ranks_under_its_own_label(tmp_path: Path) -> None:
    """``diloco[replica=node]`` is a row of its own: its kwargs reach the job, it runs on
    ``multi_nic`` (two nodes of two ranks; this machine is one host), and its cells, run
    directories and table rows carry the whole item."""
    plans = chaos.matrix_plans(["diloco[replica=node]", "diloco[replica=node,inner=fsdp]"], ["kill", "netdown"],
                               ["trainer.devices=4"], tmp_path, rank=2, step=12)
    assert [p.run_dir.name for p in plans] == ["diloco-replica-node-kill", "diloco-replica-node-netdown",
                                               "diloco-replica-node-inner-fsdp-kill",
                                               "diloco-replica-node-inner-fsdp-netdown"]
    for plan in plans:
        assert plan.job.cluster is not None and plan.job.cluster.name == chaos.NETDOWN_CLUSTER
        assert plan.job.strategy.name == "diloco" and plan.job.strategy.kwargs["replica"] == "node"
    assert [p.job.strategy.kwargs["inner"] for p in plans] == ["ddp", "ddp", "fsdp", "fsdp"]
    assert [p.job.label for p in plans[::2]] == ["diloco[replica=node]", "diloco[replica=node,inner=fsdp]"]
    assert plans[0].faults[0].lost == [2]                # a rank inside node 1, not its whole host
    own = chaos.matrix_plans(["diloco[replica=node]"], ["kill"], ["trainer.devices=5", "cluster=asymmetric_2_3"],
                             tmp_path / "own", rank=2, step=12)
    assert own[0].job.cluster.name == "asymmetric_2_3"    # the job's own cluster is kept
    report = chaos.analyse(plans[0], Observation(ranks={r: RankSeen() for r in range(4)}), None, 30)
    assert chaos.matrix_row(report)["strategy"] == "diloco[replica=node]"


@pytest.mark.parametrize(("strategies", "kinds", "overrides", "message"), [
    (["ddp"], ["kill"], ["strategy=atc"], "--matrix sets the strategy per cell"),
    (["diloco[replica=nod]"], ["kill"], ["trainer.devices=4"], "strategy.kwargs.replica: got 'nod'"),
    (["diloco[replica=node]"], ["kill"], ["label=x"], "--matrix sets the strategy per cell"),
    (["ddp"], ["explode"], [], "--kinds: unknown explode"),
    (["ddp"], [], [], r"--kinds: unknown \(none given\)"),
    (["ddp", "atc"], ["stop"], ["trainer.devices=1"], "rank 2"),   # the last cell's problem, before any runs
])
def test_a_bad_matrix_is_refused_before_any_cell_runs(tmp_path: Path, strategies: list[str], kinds: list[str],
                                                       overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        chaos.matrix_plans(strategies, kinds, overrides, tmp_path, rank=2, step=12)
    assert not any(tmp_path.iterdir())
