"""``membership=quorum`` through ``train.py``: the goodput benchmark's job, shortened
(``scripts/diloco_goodput.py``): 4 elastic replicas on the emulated ``wan_two_sites`` (3 local
ones where this machine cannot emulate a cluster), an emulated step, replica 1 killed
mid-round and restarted. The restarted process takes part in the round it joins with weight 0
after healing from a live peer, every replica reaches the job's last round, and the benchmark's
accounting finds the killed process's lost steps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from syncplane.cluster import emulator
from tests.helpers.emulation import UNSUPPORTED
from tests.helpers.scripts import load_script

pytest.importorskip("torchft")

goodput_script = load_script("diloco_goodput")


@pytest.mark.slow
def test_a_quorum_job_goes_on_without_a_killed_replica_and_takes_it_back(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(sync_every=5, grace_s=3.0, step_s=0.5, rounds=8, run_timeout_s=400)
    faults = [{"kind": "kill", "rank": 1, "step": 12}]
    if UNSUPPORTED:   # no namespaces here: the same job on 3 local replicas
        monkeypatch.setattr(goodput_script, "REPLICAS", 3)
        original = goodput_script.command
        monkeypatch.setattr(goodput_script, "command", lambda *a: [x for x in original(*a)
                                                                   if x != "cluster=wan_two_sites"])
    try:
        numbers = goodput_script.run("quorum", faults, args, tmp_path)
    finally:
        if not UNSUPPORTED:
            emulator.down()
    events = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    replicas = goodput_script.REPLICAS
    assert {e["replica"] for e in events if e.get("event") == "done"} == set(range(replicas))
    assert all(e["position"] == args.rounds for e in events if e.get("event") == "done")
    joined = [e for e in events if e.get("event") == "round" and e["replica"] == 1 and e["weight"] == 0.0
              and e["committed"]]
    assert len(joined) == 1, "the restarted replica joins one round with nothing"
    assert any(e.get("event") == "heal" and e["replica"] == 1 for e in events)
    # whether the survivors commit a round without it depends on how soon it is back (about 3 s
    # here, under the round): either way it joins at a boundary after the round it died in
    assert joined[0]["position"] >= faults[0]["step"] // args.sync_every
    assert numbers["lost"] > 0 and 0 < numbers["useful"] <= replicas * args.rounds * args.sync_every
