"""Ranks forked from the launcher's preloaded server (``syncplane.runtime.forkserver``) start
as ``python -m`` would start them: own identity, environment, session, log and exit status,
inside their host's network namespace."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from syncplane.runtime import forkserver
from syncplane.runtime.launcher import LaunchError, RankSpec, launch, local_ranks

RANK = [sys.executable, "-m", "tests.helpers.forked_rank"]


def reports(out, world_size):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_forked_ranks_are_processes_of_their_own_with_the_jobs_environment(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)                  # the launcher's directory now, not the server's
    env = {**os.environ, "FORKED_RANK_MARKER": uuid.uuid4().hex}
    echo = io.StringIO()
    launch([*RANK, "report", str(tmp_path)], local_ranks(3), tmp_path / "logs", env=env, echo_to=echo)
    seen = reports(tmp_path, 3)
    assert len({s["pid"] for s in seen}) == 3
    for rank, s in enumerate(seen):
        assert s["argv"] == ["report", str(tmp_path)] and s["name"] == "__main__"
        assert s["cwd"] == str(work) and s["world_size"] == "3" and s["marker"] == env["FORKED_RANK_MARKER"]
        assert s["pgid"] == s["sid"] == s["pid"]          # its own session: the launcher can end its group
        assert s["stdin"] == ""
        assert s["cmdline"].startswith(f"{sys.executable} -m tests.helpers.forked_rank report {tmp_path}")  # for ps
        assert (tmp_path / "logs" / f"rank{rank}.log").read_text() == f"rank {rank} says hello\n"
        assert s["pid"] != os.getpid()
    assert len({s["numpy"] for s in seen}) == 3        # each seeds NumPy anew, as a fresh interpreter would
    # the server's objects (torch, Lightning: hundreds of thousands) are frozen, so collections
    # never write into their shared pages; the rank's own garbage is still collected
    assert all(s["frozen"] > 100_000 and s["cycle_collected"] for s in seen), [(s["frozen"], s["cycle_collected"]) for s in seen]
    assert echo.getvalue() == "rank 0 says hello\n"  # rank 0 echoed, from its log


def test_a_forked_ranks_exit_status_and_traceback_reach_the_launcher(tmp_path):
    with pytest.raises(LaunchError, match=r"rank 0 failed \(exit code 3\)"):
        launch([*RANK, "exit3", str(tmp_path)], local_ranks(1), tmp_path / "a", echo_rank0=False)
    with pytest.raises(LaunchError, match=r"(?s)rank 0 failed \(exit code 1\).*ValueError: this rank raised on purpose"):
        launch([*RANK, "raise", str(tmp_path)], local_ranks(1), tmp_path / "b", echo_rank0=False)


def test_a_forked_rank_that_outlives_the_timeout_is_ended(tmp_path):
    with pytest.raises(LaunchError, match="ranks still running: 0, 1"):
        launch([*RANK, "sleep", str(tmp_path)], local_ranks(2), tmp_path, echo_rank0=False, timeout_s=5)


def test_only_python_dash_m_commands_are_forked():
    assert forkserver.forkable([*RANK, "x"]) == ("tests.helpers.forked_rank", ["x"])
    assert forkserver.forkable([sys.executable, "-c", "pass"]) is None
    assert forkserver.forkable(["/other/python", "-m", "m"]) is None
    assert forkserver.forkable(["nice", "-n", "5", *RANK]) is None
    assert not forkserver.enabled({forkserver.ENV: "0"}) and forkserver.enabled({})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (netns)")
def test_a_forked_rank_joins_its_hosts_network_namespace(tmp_path):
    name = f"sp-forktest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "add", "eth7", "type", "veth", "peer", "name", "eth8"], check=True)
        spec = RankSpec(rank=0, local_rank=0, local_world_size=1, namespace=name)
        launch([*RANK, "report", str(tmp_path)], [spec], tmp_path / "logs", echo_rank0=False)
        seen, = reports(tmp_path, 1)
        assert seen["netns"] == os.stat(f"/run/netns/{name}").st_ino != os.stat("/proc/self/ns/net").st_ino
        assert seen["nics"] == ["eth7", "eth8", "lo"]     # its own /sys, as ip netns exec mounts it
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


def test_a_namespace_that_cannot_be_joined_is_named_in_the_ranks_log(tmp_path):
    spec = RankSpec(rank=0, local_rank=0, local_world_size=1, namespace="sp-forktest-missing")
    with pytest.raises(LaunchError, match=r"(?s)rank 0 failed \(exit code 1\).*/run/netns/sp-forktest-missing"):
        launch([*RANK, "report", str(tmp_path)], [spec], tmp_path / "logs", echo_rank0=False)


def test_a_rank_the_server_cannot_fork_starts_as_a_fresh_process_with_a_warning(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise EOFError("the server is gone")

    monkeypatch.setattr(forkserver, "start", broken)
    launch([*RANK, "report", str(tmp_path)], local_ranks(2), tmp_path / "logs", echo_rank0=False)
    seen = reports(tmp_path, 2)
    assert [s["cmdline"].split("\0")[:3] for s in seen] == [RANK] * 2   # an interpreter of its own
    assert (tmp_path / "logs" / "rank1.log").read_text() == "rank 1 says hello\n"
    assert "could not start rank0 (EOFError: the server is gone); starting it as a fresh process" in caplog.text
