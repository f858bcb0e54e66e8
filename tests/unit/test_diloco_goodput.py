"""``scripts/diloco_goodput.py``'s accounting on a made-up history (the benchmark itself runs
train.py on an emulated cluster): the kill schedule, useful and lost replica-steps, goodput."""

from __future__ import annotations

from tests.helpers.scripts import load_script

goodput_script = load_script("diloco_goodput")


def test_one_kill_every_n_rounds_mid_round_each_replica_once() -> None:
    assert goodput_script.kills(30, 8, 10) == [{"kind": "kill", "rank": 1, "step": 85},
                                               {"kind": "kill", "rank": 2, "step": 165},
                                               {"kind": "kill", "rank": 3, "step": 245}]
    assert goodput_script.kills(10, 8, 10) == []


def test_goodput_counts_committed_weights_and_a_killed_process_lost_steps() -> None:
    """2 replicas of the made-up job (the script's REPLICAS is 4: capacity counts 4), H = 10,
    a step of 1 s over 40 s: replica 1's first process commits 1 round, dies at step 15 and its
    restart commits 1; replica 0 commits 3 rounds, one of them carried."""
    events = [{"replica": 0, "event": "start", "restart": 0, "time": 100.0},
              {"replica": 1, "event": "start", "restart": 0, "time": 100.0},
              {"replica": 0, "event": "round", "committed": True, "weight": 1.0, "time": 110.0},
              {"replica": 1, "event": "round", "committed": True, "weight": 1.0, "time": 110.0},
              {"replica": 0, "event": "round", "committed": False, "weight": 0.0, "time": 120.0},
              {"replica": 0, "event": "carried", "time": 125.0},
              {"replica": 1, "event": "start", "restart": 1, "time": 126.0},
              {"replica": 0, "event": "round", "committed": True, "weight": 2.0, "time": 130.0},
              {"replica": 1, "event": "round", "committed": True, "weight": 1.0, "time": 138.0},
              {"replica": 0, "event": "done", "time": 140.0}, {"replica": 1, "event": "done", "time": 140.0}]
    numbers = goodput_script.goodput(events, [{"kind": "kill", "rank": 1, "step": 15}], 10, 1.0)
    assert numbers["useful"] == 50.0 and numbers["lost"] == 5.0 and numbers["wall_s"] == 40.0
    assert numbers["goodput"] == round(50 / (4 * 40), 4) and numbers["kept"] == round(50 / 55, 4)
    assert numbers["carried"] == 1 and numbers["discarded"] == 1
