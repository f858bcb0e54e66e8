"""The language-model headline's own command, shortened (``scripts/lm_wan.py --quick``), really
trained: a sparse DiLoCo row with one replica per site on the emulated ``wan_nodes`` (3 Mbit/s
between its two 2-rank hosts), its exchange overlapped, timed end to end. The table's row holds
what the published JSON holds (its ``train.py`` command, one seed's loss, bytes, wall and compute
utilization), the charts are written, and the peer the recipe cannot replay is listed as refused
with its reason. The full run (``make lm-headline``) is a benchmark, not a test."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from syncplane.cluster import emulator
from tests.helpers.emulation import requires_emulation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import lm_wan  # noqa: E402

pytestmark = [requires_emulation, pytest.mark.slow]


def test_the_shortened_headline_trains_a_sparse_node_row_across_the_slow_link(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(emulator.PREFIX_ENV, "lmq-")    # not the cluster of a headline running beside it
    out = tmp_path / "lm_wan.json"
    try:
        code = lm_wan.main(["--quick", "--rows", "diloco_sparse3_overlap,torchft_diloco", "--emulated-step-s", "0.5",
                            "--runs", str(tmp_path / "runs"), "--out", str(out)])
    finally:
        emulator.down()
    assert code == 0
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    sparse = rows["diloco_sparse3_overlap"]
    assert sparse["status"] == "ok", sparse.get("message")
    command = sparse["command"]
    for flag in ("python train.py recipe=tiny_lm", "cluster=wan_nodes", "strategy.kwargs.replica=node",
                 "strategy.kwargs.compression=sparse", "strategy.kwargs.overlap_steps=2", "trainer.emulated_step_s=0.5"):
        assert flag in command, (flag, command)
    (seed,) = sparse["seeds"]
    assert seed["seed"] == 1 and seed["steps"] > 5
    assert math.isfinite(seed["val_loss"]) and seed["val_loss"] < math.log(4096)   # below a uniform guess
    assert seed["bytes_per_rank"] > 0 and seed["sync_s_per_round"] > 0
    assert 0 < seed["compute_utilization"] <= 1
    assert 0 < seed["wall_s"] and seed["h_for_90pct"] >= 1
    run_dir = next((tmp_path / "runs").glob("diloco_sparse3_overlap-s1-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy_details"]["replica"] == "node" and summary["strategy_details"]["ranks_per_replica"] == [2, 2]
    assert summary["compute"]["emulated_step_s"] == 0.5
    peer = rows["torchft_diloco"]
    assert peer["status"] == "refused" and peer["seeds"] == [] and "recipe" in peer["message"]
    assert (tmp_path / "lm_wan_bytes.png").stat().st_size > 0 and (tmp_path / "lm_wan_wall.png").stat().st_size > 0
