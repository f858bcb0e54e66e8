"""``scripts/lm_wan.py`` (issue 78's headline) with a fake runner: which ``train.py`` commands each
row runs, the priced DDP row's arithmetic, the Muon row's codec, refused and failed rows, the
resumption from finished run folders, and the JSON and charts it writes. No training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import lm_wan  # noqa: E402

#: (final val loss, bytes per rank, sync seconds) of a fake run, by its label
FAKE = {"ddp": (4.80, 3.0e9, 0.0), "diloco_fp32_blocking": (4.90, 8.0e7, 28.0), "diloco_fp32_overlap": (4.91, 8.0e7, 28.0),
        "diloco_int8_overlap": (4.93, 2.0e7, 7.0),
        "diloco_sparse3_overlap": (4.92, 3.0e6, 1.0), "diloco_sparse1_overlap": (5.30, 1.0e6, 0.5),
        "diloco_muon": (4.85, 3.0e6, 1.0), "diloco_muon_h100": (4.88, 1.5e6, 0.5), "ddp_muon": (4.70, 3.0e9, 0.0)}


class FakeRunner:
    """Writes what a finished ``train.py`` would: summary.json and history.jsonl."""

    def __init__(self, refuse: str | None = None, fail: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.refuse, self.fail = refuse, fail

    def __call__(self, overrides: list[str], run_dir: Path) -> lm_wan.RunResult:
        self.calls.append(overrides)
        label = next(o.split("=", 1)[1] for o in overrides if o.startswith("label="))
        if label == self.refuse:
            return lm_wan.RunResult(2, "syncplane: invalid configuration: strategy.kwargs.overlap_steps: not with nodes")
        if label == self.fail:
            return lm_wan.RunResult(1, "Traceback ...\nRuntimeError: boom")
        loss, sent, sync = FAKE[label.split("_outer_lr")[0]]
        timing = any(o.startswith("trainer.max_steps=") for o in overrides)
        steps = 5 if timing else 100
        run_dir.mkdir(parents=True)
        summary = {"strategy": "ddp" if label.startswith("ddp") else "diloco", "steps": steps,
                   "metrics": {"val_loss": None if timing else loss}, "comm": {"seconds": sync, "bytes_sent_per_rank": sent},
                   "train_seconds": 500.0, "timing": {"validation_s": 20.0}, "throughput": {"step_s_median": 25.0 if timing else 1.5},
                   "time_to_target_s": 200.0, "compute_utilization": 0.1 if timing else 0.95,
                   "compute": {"overran_steps": 0}}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        history = [{"step": 50, "val_loss": loss + 0.3}, {"step": 100, "val_loss": loss}]
        (run_dir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
        return lm_wan.RunResult(0, "")


def run(tmp_path: Path, runner: FakeRunner, *args: str) -> dict:
    out = tmp_path / "lm_wan.json"
    assert lm_wan.main(["--runs", str(tmp_path / "runs"), "--out", str(out), "--target-loss", "5.0", *args],
                       runner=runner) == 0
    return json.loads(out.read_text())


def test_every_row_runs_its_command_and_the_json_has_the_issues_fields(tmp_path):
    runner = FakeRunner()
    report = run(tmp_path, runner, "--seeds-for", "ddp=2")
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == [r.name for r in lm_wan.ROWS]
    for row in rows.values():
        if row["name"] != "torchft_diloco":
            assert row["status"] == "ok" and row["command"].startswith("python train.py recipe=tiny_lm ")
            for seed in row["seeds"]:
                assert {"seed", "val_loss", "bytes_per_rank", "wall_s", "time_to_target_s",
                        "compute_utilization"} <= set(seed)
    # DiLoCo rows: one replica per site, on the link with the emulated step; overlap where named
    blocking, sparse = rows["diloco_fp32_blocking"]["command"], rows["diloco_sparse1_overlap"]["command"]
    for flag in ("strategy.kwargs.replica=node", "cluster=wan_nodes", "trainer.emulated_step_s=2.5",
                 "strategy.kwargs.sync_every=50", "trainer.target_val_loss=5"):
        assert flag in blocking and flag in sparse
    assert "overlap_steps" not in blocking and "strategy.kwargs.overlap_steps=8" in sparse
    assert "strategy.kwargs.compression=sparse strategy.kwargs.density=0.01" in sparse
    # ddp: the loss on loopback (no cluster, no emulated step), the step time timed on the link
    ddp = rows["ddp"]
    assert "cluster=" not in ddp["command"] and "emulated_step_s" not in ddp["command"]
    assert "cluster=wan_nodes" in ddp["priced"]["timing_command"] and "max_steps=50" in ddp["priced"]["timing_command"]
    assert [s["seed"] for s in ddp["seeds"]] == [1, 2]
    seed = ddp["seeds"][0]
    assert seed["wall_s"] == 100 * 25.0 and seed["loopback_wall_s"] == 500.0
    assert rows["diloco_int8_overlap"]["seeds"][0]["wall_s"] == 500.0 - 20.0   # validation left out
    # the target 5.0 is first reached at step 100 (5.1 at step 50): 100 steps of the link's 25 s
    assert seed["time_to_target_s"] == 100 * 25.0 and seed["compute_utilization"] == 0.1
    # Muon: the codec with the fewest bytes within 3 % of DDP's 4.80 (sparse3 at 4.92; sparse1 is 10 % off)
    assert rows["diloco_muon"]["codec"] == "sparse3"
    assert "recipe.optimizer=muon" in rows["diloco_muon"]["command"] and "density=0.03" in rows["diloco_muon"]["command"]
    # a row of its own H: its command, its JSON entry, and its rounds counted by it (100 steps = 1 round)
    h100 = rows["diloco_muon_h100"]
    assert "strategy.kwargs.sync_every=100" in h100["command"] and h100["sync_every"] == 100
    assert "recipe.optimizer=muon" in h100["command"] and h100["seeds"][0]["sync_s_per_round"] == 0.5
    # H by measurement: 9 x the round's sync seconds / the emulated step (100 steps = 2 rounds of 50)
    assert rows["diloco_fp32_blocking"]["seeds"][0]["h_for_90pct"] == 51   # ceil(9 x 14 / 2.5)
    # the peer: tiny_lm is no recipe it can replay; the row says why
    assert rows["torchft_diloco"]["status"] in ("refused", "not_run") and rows["torchft_diloco"]["message"]
    assert (tmp_path / "lm_wan_bytes.png").stat().st_size > 0 and (tmp_path / "lm_wan_wall.png").stat().st_size > 0
    # ddp + Muon: its own training on loopback, priced with ddp's timing (the same gradients, the same link)
    ddp_muon = rows["ddp_muon"]
    assert "recipe.optimizer=muon" in ddp_muon["command"] and "cluster=" not in ddp_muon["command"]
    assert ddp_muon["priced"]["step_s"] == ddp["priced"]["step_s"] and "ddp's timing" in ddp_muon["priced"]["note"]
    assert ddp_muon["seeds"][0]["wall_s"] == 100 * 25.0 and ddp_muon["seeds"][0]["val_loss"] == 4.70
    assert len(runner.calls) == 1 + 2 + 7 + 1   # ddp's timing and 2 seeds, 7 DiLoCo rows, ddp_muon's 1 seed


def test_a_row_priced_as_another_needs_that_row(tmp_path):
    report = run(tmp_path, FakeRunner(), "--rows", "ddp_muon")
    (row,) = report["rows"]
    assert row["status"] == "failed" and "--rows ddp,ddp_muon" in row["message"] and not row["seeds"]


def test_finished_runs_are_read_not_run_again(tmp_path):
    first = FakeRunner()
    run(tmp_path, first, "--rows", "ddp,diloco_int8_overlap")
    again = FakeRunner()
    report = run(tmp_path, again, "--rows", "ddp,diloco_int8_overlap,diloco_sparse3_overlap")
    assert len(again.calls) == 1 and "label=diloco_sparse3_overlap" in again.calls[0]
    assert [r["name"] for r in report["rows"]] == ["ddp", "diloco_int8_overlap", "diloco_sparse3_overlap"]


def test_a_refused_and_a_failed_row_are_recorded_and_the_others_still_run(tmp_path):
    runner = FakeRunner(refuse="diloco_int8_overlap", fail="diloco_sparse3_overlap")
    report = run(tmp_path, runner, "--rows", "diloco_int8_overlap,diloco_sparse3_overlap,diloco_fp32_blocking")
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["diloco_int8_overlap"]["status"] == "refused"
    assert rows["diloco_int8_overlap"]["message"] == "strategy.kwargs.overlap_steps: not with nodes"
    assert rows["diloco_sparse3_overlap"]["status"] == "failed" and "RuntimeError: boom" in \
        rows["diloco_sparse3_overlap"]["message"]
    assert rows["diloco_fp32_blocking"]["status"] == "ok" and rows["diloco_fp32_blocking"]["seeds"]
    # no codec row finished: the Muon row falls back to fp32 unless told
    assert lm_wan.best_codec(report["rows"]) is None


def test_quick_mode_shrinks_the_run_and_bad_options_are_named(tmp_path):
    runner = FakeRunner()
    report = run(tmp_path, runner, "--quick", "--rows", "diloco_int8_overlap")
    command = report["rows"][0]["command"]
    assert "recipe.train_mb=0.3" in command and "trainer.max_epochs=1" in command
    assert "strategy.kwargs.sync_every=5" in command and "strategy.kwargs.overlap_steps=2" in command
    with pytest.raises(SystemExit):
        lm_wan.main(["--rows", "nope", "--out", str(tmp_path / "x.json")], runner=runner)
    with pytest.raises(SystemExit, match="--seeds-for: NAME=N"):
        lm_wan.main(["--seeds-for", "ddp=0", "--out", str(tmp_path / "x.json")], runner=runner)


def test_a_run_continues_from_the_json_when_the_run_folders_are_gone(tmp_path):
    import shutil

    first = run(tmp_path, FakeRunner(), "--rows", "ddp,diloco_int8_overlap", "--seeds-for", "ddp=2")
    shutil.rmtree(tmp_path / "runs")                 # another checkout: only the committed JSON is left
    again = FakeRunner()
    second = run(tmp_path, again, "--rows", "ddp,diloco_int8_overlap", "--seeds-for", "ddp=2")
    assert again.calls == [] and second["rows"] == first["rows"]
    more = FakeRunner()                              # a third seed runs; the first two are kept
    third = run(tmp_path, more, "--rows", "ddp,diloco_int8_overlap", "--seeds-for", "ddp=3")
    assert [next(o for o in c if o.startswith("seed=")) for c in more.calls] == ["seed=3"]
    assert third["rows"][0]["seeds"][:2] == first["rows"][0]["seeds"]
    one = FakeRunner()                               # a row at a time: the others stay in the table
    grown = run(tmp_path, one, "--rows", "diloco_sparse3_overlap")
    assert [r["name"] for r in grown["rows"]] == ["ddp", "diloco_int8_overlap", "diloco_sparse3_overlap"]
    assert len(one.calls) == 1
    changed = FakeRunner()                           # another command (H) is another run
    run(tmp_path, changed, "--rows", "diloco_int8_overlap", "--sync-every", "20")
    assert len(changed.calls) == 1 and "strategy.kwargs.sync_every=20" in changed.calls[0]
    only = json.loads((tmp_path / "lm_wan.json").read_text())["rows"]   # other settings: the old rows go
    assert [r["name"] for r in only] == ["diloco_int8_overlap"]
    fresh = FakeRunner()
    shutil.rmtree(tmp_path / "runs")
    run(tmp_path, fresh, "--rows", "diloco_int8_overlap", "--sync-every", "20", "--fresh")
    assert len(fresh.calls) == 1


def test_the_scale_trend_and_the_outer_lr_are_rows_of_their_own_files(tmp_path):
    """``--size small``: every command names the size, ``--priced-steps 0`` leaves ddp untimed
    (loss and bytes, no wall), ``--emulated-step-s 0`` runs the real compute; ``--outer-lrs``: each
    chosen DiLoCo row once per outer lr, its Nesterov set to it. The default table's commands are
    unchanged by either (a resume keeps its seeds)."""
    runner = FakeRunner()
    report = run(tmp_path, runner, "--size", "small", "--rows", "ddp,diloco_muon_h100", "--muon-codec", "int8",
                 "--priced-steps", "0", "--emulated-step-s", "0")
    rows = {r["name"]: r for r in report["rows"]}
    assert len(runner.calls) == 2 and all("recipe.size=small" in call for call in runner.calls)
    assert "emulated_step_s" not in rows["diloco_muon_h100"]["command"] and "size=small" in report["title"]
    assert rows["ddp"]["seeds"][0]["wall_s"] is None and rows["ddp"]["seeds"][0]["val_loss"] == 4.80
    assert "h_for_90pct" not in rows["diloco_muon_h100"]["seeds"][0] and report["settings"]["size"] == "small"
    tuned = FakeRunner()
    report = run(tmp_path / "outer", tuned, "--rows", "ddp,diloco_muon_h100", "--outer-lrs", "0.4,1")
    assert [r["name"] for r in report["rows"]] == ["diloco_muon_h100_outer_lr0.4", "diloco_muon_h100_outer_lr1"]
    assert "strategy.kwargs.outer_kwargs={lr:0.4,momentum:0.9,nesterov:true}" in tuned.calls[0]
    assert "strategy.kwargs.overlap_steps=8" in tuned.calls[1] and "outer step" in report["title"]
    default = lm_wan.Settings()
    assert "recipe.size" not in " ".join(default.common(1, "ddp")) and "size" not in lm_wan.Headline(
        default, tmp_path, tmp_path / "x.json").settings_dict()
    with pytest.raises(SystemExit):
        lm_wan.main(["--rows", "ddp", "--outer-lrs", "0.4", "--out", str(tmp_path / "x.json")], runner=runner)
