"""Real ``torchrun --nnodes 2 --nproc-per-node 2`` on two emulated hosts (network
namespaces), c10d rendezvous on host 0's NIC: ``train.py`` runs once per rank, rank 0
writes the one ``summary.json``, and the model learns as on one machine; and a plain
Lightning script with the planner (``syncplane.Auto`` given the emulated network's profile)
trains on the same hosts and records its choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from syncplane.cluster import emulator, parse_profile
from tests.helpers.emulation import requires_emulation

pytestmark = [requires_emulation, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TWO_HOSTS = {"name": "test_two_hosts",
             "racks": [{"name": "r0", "hosts": [{"name": "n0", "nic_mbit": 1000, "ranks": 2},
                                                {"name": "n1", "nic_mbit": 1000, "ranks": 2}]}]}


@pytest.fixture(scope="module")
def two_hosts():
    profile = parse_profile(TWO_HOSTS)
    emulator.up(profile)
    yield profile
    emulator.down()


#: H-ATC's groups follow the hosts, so it needs the hosts that torchrun's agents report; ``ddp``
#: under torchrun, which ignores hosts, is ``tests/e2e/test_external_launch.py``'s (one machine)
STRATEGY = "h_atc"


def torchrun_on_hosts(hosts, rdzv_id: str, script: list[str], cwd: Path, env: dict[str, str] | None = None
                      ) -> list[str]:
    """One torchrun agent per emulated host, each starting 2 ranks of ``script`` (``env`` added
    to theirs); every agent must succeed. Returns their outputs."""
    endpoint = f"{emulator.master_addr(hosts)}:29411"
    procs = []
    for node, host in enumerate(hosts.hosts):
        command = [*emulator.rank_prefix(hosts, host.ranks[0]), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", rdzv_id, "--max-restarts", "0",
                   # the namespaces share one hostname: say which agent hosts the c10d store, and
                   # which address each node's workers are reached on (what DNS gives on a real cluster)
                   "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", host.address(0), *script]
        procs.append(subprocess.Popen(command, cwd=cwd, env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0", **(env or {})},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=500)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def test_torchrun_on_two_emulated_hosts(two_hosts, tmp_path):
    run_dir = tmp_path / "run"
    torchrun_on_hosts(two_hosts, f"two-hosts-{STRATEGY}",
                      [str(ROOT / "train.py"), f"strategy={STRATEGY}", "recipe=digits", "trainer.devices=2",
                       "trainer.max_epochs=3", "logger.csv=false", "trainer.rendezvous_timeout_s=120",
                       f"hydra.run.dir={run_dir}"], tmp_path)
    summaries = list(run_dir.rglob("summary.json"))
    assert summaries == [run_dir / "summary.json"]
    summary = json.loads(summaries[0].read_text())
    assert summary["world_size"] == 4
    # a single-machine run of this recipe reaches ~0.95 after 3 epochs (4 ranks, batch 32 each)
    assert summary["metrics"]["val_acc"] > 0.85, summary["metrics"]


def test_the_planner_in_a_plain_script_trains_on_the_emulated_hosts_and_records_its_choice(two_hosts, tmp_path):
    """``Auto(cluster=<the emulated network's profile>)`` in ``tests/helpers/plain_script.py``
    under torchrun on the two hosts: every rank decides alike (else the job would hang in
    mismatched collectives), trains as the choice, and ``summary.json`` records it."""
    profile = tmp_path / "test_two_hosts.yaml"
    profile.write_text(yaml.safe_dump(TWO_HOSTS))
    report = tmp_path / "report"
    outputs = torchrun_on_hosts(two_hosts, "two-hosts-auto",
                                [str(ROOT / "tests" / "helpers" / "plain_script.py"), "--strategy", f"auto:{profile}",
                                 "--accept", "approximate", "--candidates", "diloco,atc,ddp", "--max-steps", "30",
                                 "--report", str(report), "--out", str(tmp_path / "run")], tmp_path,
                                env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    summary = json.loads((report / "summary.json").read_text())
    auto = summary["strategy_details"]["auto"]
    assert summary["world_size"] == 4 and auto["inputs"]["cluster"] == "test_two_hosts", auto
    chosen = auto["choice"]["strategy"]
    assert chosen in ("diloco", "atc", "ddp") and summary["steps"] == 30, summary
    assert f"(Auto chose {chosen}" in outputs[0], outputs[0][-2000:]
