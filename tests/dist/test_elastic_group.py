"""``syncplane.algorithms.diloco.ft`` on real processes: two replicas form a torchft quorum through a
Lighthouse on loopback, average a seeded tensor over the quorum's store (the engine's exchange,
``elastic.QuorumTransport``; checked against a float64 mean), vote to commit, and the quorum
service, each replica's RPC server and the exchange's gloo pairs listen on loopback only."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft as elastic  # noqa: E402

SEED = 2024
N = 1000


def _values(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(SEED + rank), dtype=torch.float64)


def _listening_addresses(pid: int, except_ports: tuple[int, ...] = ()) -> list[str]:
    """Local addresses of the process's listening TCP sockets (from /proc), but those on
    ``except_ports``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                address, port = cols[1].split(":")
                if cols[3] == "0A" and cols[9] in inodes and int(port, 16) not in except_ports:   # 0A = LISTEN
                    found.append(address[:width])
    return found


_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}   # 127.0.0.1, ::1 as /proc writes them


def _replica(rank: int, world: int, lighthouse: str) -> dict[str, object]:
    from syncplane.algorithms.diloco.elastic import QuorumTransport
    from syncplane.comm.codecs import Fp32
    from syncplane.exchanges import MeshExchange

    state = {"x": torch.zeros(1)}
    group = elastic.ReplicaGroup(f"replica{rank}", lighthouse, lambda: state, lambda s: state.update(s),
                                 round_timeout_s=20, quorum_timeout_s=60)
    transport = QuorumTransport(group.host, 20.0)
    exchanger = transport.runner(MeshExchange(2), codec=Fp32(), interfaces=None, timeout_s=20.0,
                                 error_feedback_beta=1.0)
    try:
        view = transport.view = group.quorum()
        flat = _values(rank).float()
        averaged = exchanger.allreduce_mean_(flat)
        committed = group.commit()
        return {"participants": view.participants, "rank": view.rank, "averaged": averaged, "committed": committed,
                "mean": flat.double(),
                # torch's TCPStore server (torchft's rendezvous for the replica gloo group) binds every
                # interface whatever host it is given: a torch limitation, left out here and documented
                # (the test harness's own store, on MASTER_PORT, too)
                "listening": _listening_addresses(os.getpid(), (group._store.port, int(os.environ["MASTER_PORT"])))}
    finally:
        exchanger.close()
        group.close()


def test_two_replicas_form_a_quorum_and_average_on_loopback() -> None:
    lighthouse = elastic.start_lighthouse("127.0.0.1", min_replicas=2, join_timeout_s=30, heartbeat_timeout_s=5)
    try:
        assert set(_listening_addresses(os.getpid())) <= _LOOPBACK
        results = run_distributed(_replica, 2, lighthouse.address, timeout=180)
    finally:
        lighthouse.shutdown()
    reference = (_values(0) + _values(1)) / 2
    for r in results:
        assert r["participants"] == 2 and r["averaged"] and r["committed"]
        torch.testing.assert_close(r["mean"], reference, rtol=1e-6, atol=1e-6)
        # the replica's manager RPC server and gloo pairs: on loopback
        assert r["listening"] and set(r["listening"]) <= _LOOPBACK, r["listening"]
    assert sorted(r["rank"] for r in results) == [0, 1]
