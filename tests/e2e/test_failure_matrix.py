"""Every strategy loses a rank and ends fast and clean (issue 17's failure matrix).

Each case is one cell of ``syncplane chaos --matrix`` (the harness users run, in process): a
digits job on 4 ranks with default settings whose rank 2 fails after step 12, just after the
epoch-1 checkpoint (11 steps an epoch at 4 ranks): ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a
hung GPU, a swapping host) or ``raise`` on this machine, ``netdown`` on the emulated
``multi_nic`` (rank 2's host, ranks 2 and 3, takes both its NICs down). What is asserted is
the promise: every survivor's process ends within 30 s of the fault, the launcher exits
non-zero with an error naming a lost rank, nothing of the job is left running (in or out of
the emulator), the step-11 checkpoint loads with ``weights_only=True``, and every survivor's
own error names the lost rank: the heartbeat's verdict for a hung or cut-off rank (which
breaks nobody's collective), the census of the beats that a survivor whose collective broke
takes for a killed one (``Heartbeat.find_lost``).

Why per strategy: each has its own way of being stuck on a lost peer (DiLoCo's rounds,
Canary's exchange thread, DS-Sync's and FlexReduce's subgroups, the decentralized window
ops, DDP's reducer under torch's hooks), and every survivor must get out of it.

Every strategy runs here, each with one kind, so that every kind runs on several strategies
(a job costs 24-28 s here, the ranks forked from a preloaded server: the full 11 × 3 matrix
would add a quarter of an hour to the suite). The full matrix is ``syncplane chaos --matrix
trainer.devices=4``; its table is in docs/troubleshooting.md. ``tests/e2e/test_failures.py`` has ddp
under a hang with its checkpoint resumed, and the launcher's own signals;
``tests/dist/test_resume_every_strategy.py`` that every strategy resumes from such a
checkpoint bit-identically.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncplane import algorithms
from syncplane.cluster import emulator
from syncplane.experiments.chaos import matrix_plans, run_matrix
from tests.helpers.emulation import requires_emulation

DEADLINE_S = 30.0
FAULT_STEP = 12

#: row (a strategy, or a variant of its kwargs) -> the fault it is tested with here (each kind
#: on several strategies). ``diloco[replica=node]`` runs on ``multi_nic`` (two nodes of two
#: ranks): rank 2 is killed inside node 1, and node 0, training apart with no collective across
#: to break, must still end naming it (the store's host waits for it to read the verdict).
CELLS = {"ddp": "kill", "atc": "netdown", "awc": "stop", "h_atc": "stop", "h_awc": "kill", "ds_sync": "netdown",
         "diloco": "stop", "diloco[replica=node]": "kill", "flexreduce": "raise", "canary": "stop",
         "torch_fp16": "netdown", "torch_powersgd": "kill"}


def _on_cluster(row: str, kind: str) -> bool:
    return kind == "netdown" or "replica=node" in row


def test_every_strategy_has_a_cell() -> None:
    assert sorted({algorithms.variant(row)[0] for row in CELLS}) == sorted(algorithms.strategy_names())
    assert {"kill", "stop", "netdown"} <= set(CELLS.values())


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "kind"), [
    pytest.param(name, kind, marks=[requires_emulation] if _on_cluster(name, kind) else [], id=f"{name}-{kind}")
    for name, kind in CELLS.items()])
def test_a_lost_rank_ends_the_job_within_30_s_leaving_nothing(tmp_path: Path, strategy: str, kind: str) -> None:
    [plan] = matrix_plans([strategy], [kind], ["trainer.devices=4", "trainer.max_epochs=3", "seed=3"], tmp_path,
                          rank=2, step=FAULT_STEP)
    try:
        [row] = run_matrix([plan], deadline_s=DEADLINE_S, timeout_s=300, json_path=tmp_path / "matrix.json")
    finally:
        if _on_cluster(strategy, kind):
            emulator.down()
    report = json.loads((plan.run_dir / "chaos.json").read_text())
    survivors = [r for r in report["ranks"] if r["role"] == "survivor"]
    print(f"{strategy} {kind}: launcher out {row['launcher_out_s']} s after the fault; survivors "
          + ", ".join(f"rank {r['rank']} {r['exited_after_s']} s ({r['error']})" for r in survivors))
    assert row["ok"], row["problems"]
    assert row["lost"] == ([2, 3] if kind == "netdown" else [2])
    assert row["exit_code"] not in (0, None), report["launcher"]
    if kind == "kill":   # the launcher saw its child die and says which
        assert report["launcher"]["names_lost_rank"], report["launcher"]
    assert row["survivors_out_s"] is not None and row["survivors_out_s"] < DEADLINE_S, survivors
    if kind != "raise":   # each survivor says whom it lost (the heartbeat's verdict, or its census
        # of the beats once its collective broke); a rank that raised is alive, so nobody names it
        assert row["survivors_named"] == row["survivors"], survivors
    assert row["leftover"] == 0 and emulator.namespaces() == []
    assert report["checkpoint"]["ok"] and row["checkpoint_step"] == FAULT_STEP - 1, report["checkpoint"]
