"""The exchange's phase profile (``syncplane bench --profile``) and the emulator's per-flow
classes that the profile led to (issue 19): pure functions, no processes."""

from __future__ import annotations

import re
import threading

from syncplane.bench.runner import report_rows
from syncplane.cluster import load_profile
from syncplane.cluster.emulator import PORT_BUCKETS, per_flow_commands
from syncplane.comm import PhaseProfile


def test_phase_profile_adds_per_phase_from_many_threads_and_resets():
    profile = PhaseProfile()

    def work(stream: int) -> None:
        for _ in range(100):
            profile.add(f"wait/s{stream}", 0.5)
            profile.add("sum", 0.25)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with profile.time("copy"):
        pass
    got = profile.as_dict()
    assert list(got) == sorted(got)
    assert got["sum"] == {"s": 100.0, "n": 400}
    assert all(got[f"wait/s{s}"] == {"s": 50.0, "n": 100} for s in range(4))
    assert got["copy"]["n"] == 1 and got["copy"]["s"] >= 0
    profile.reset()
    assert profile.as_dict() == {}


def test_bench_row_carries_every_ranks_profile():
    per_rank = [{"exchange": {"s": 1.0, "n": 3}}, {"exchange": {"s": 2.0, "n": 3}}]
    measured = {"diloco": {"step_s": [1.0, 1.2], "comm_bytes": [8.0] * 4, "nic_tx_bytes": [8.0] * 4,
                           "profile": per_rank}}
    rows = report_rows(load_profile("wan_two_sites"), ["diloco"], 2**20, measured, period=1)
    assert rows[0]["profile"] == per_rank


def test_every_pair_of_port_buckets_has_its_own_capped_class():
    """Flows that share a class share one cap; with ``src XOR dst`` 16 WAN flows fell into
    11 classes. Each (source bucket, destination bucket) now leads to a class of its own."""
    lines = per_flow_commands("upl0r", 1000, 100)
    classes = {m.group(1) for line in lines
               if (m := re.search(r"classid 1:([0-9a-f]+) htb rate 100mbit ceil 100mbit", line))}
    targets = [m.group(1) for line in lines if (m := re.search(r"u32 ht [0-9a-f]+:[0-9a-f]+: .* flowid 1:([0-9a-f]+)",
                                                                line))]
    assert len(targets) == PORT_BUCKETS ** 2 == len(set(targets))
    assert set(targets) == classes
