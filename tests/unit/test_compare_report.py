"""The comparison report's time to target, compute/comm ratio and rows for runs that did not happen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncplane.bench.compare import build_comparison, compute_comm_ratio, load_run, per_strategy, time_to_target


def _run(folder: Path, strategy: str, seed: int, accs: list[float], epoch_s: float, comm_s: float,
         timing: dict | None = None, label: str | None = None) -> Path:
    folder.mkdir(parents=True)
    history = [{"epoch": i, "step": 10 * (i + 1), "epoch_s": epoch_s, "val_acc": a} for i, a in enumerate(accs)]
    (folder / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    summary = {"strategy": strategy, **({"label": label} if label else {}), "recipe": "digits", "seed": seed, "world_size": 2, "steps": 10 * len(accs),
               "metrics": {"val_acc": accs[-1], "val_loss": 0.5},
               "throughput": {"samples_per_s": 100.0, "step_s_median": 0.1},
               "comm": {"seconds": comm_s, "bytes_sent_per_rank": 2**20 * len(accs)},
               "consensus_distance": 0.0, "train_seconds": epoch_s * len(accs) + (timing or {}).get("checkpoint_s", 0.0),
               **({"timing": timing} if timing else {})}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_time_to_target_is_the_first_validation_reaching_it():
    history = [{"epoch_s": 2.0, "val_acc": 0.5}, {"epoch_s": 3.0, "val_acc": 0.9}, {"epoch_s": 4.0, "val_acc": 0.95}]
    assert time_to_target(history, 0.9) == 5.0
    assert time_to_target(history, 0.5) == 2.0
    assert time_to_target(history, 0.96) is None     # not reached: not the total 9 s


def test_compute_comm_ratio():
    base = {"comm": {"seconds": 2.0}, "train_seconds": 10.0}
    assert compute_comm_ratio(base) == 4.0
    assert compute_comm_ratio(base, [{"epoch_s": 3.0}, {"epoch_s": 3.0}]) == 2.0   # the epoch clock when known
    assert compute_comm_ratio({"comm": {"seconds": 0.0}, "train_seconds": 10.0}) is None


def test_report_rows_seeds_and_missing_peer(tmp_path):
    runs = [_run(tmp_path / "a", "ddp", 1, [0.6, 0.8], 10.0, 5.0), _run(tmp_path / "b", "ddp", 2, [0.7, 0.9], 10.0, 5.0),
            _run(tmp_path / "c", "diloco", 1, [0.85, 0.9], 4.0, 1.0, {"checkpoint_s": 3.0, "setup_s": 0.5}),
            _run(tmp_path / "d", "diloco", 2, [0.5, 0.6], 4.0, 1.0)]
    report = build_comparison(runs, tmp_path / "out", target_acc=0.8,
                              missing=[{"strategy": "horovod", "seed": 1, "status": "not available: run x"}])
    rows = report["runs"]
    assert [(r["strategy"], r["status"]) for r in rows] == [("ddp", "ok")] * 2 + [("diloco", "ok")] * 2 + [
        ("horovod", "not available: run x")]
    assert [r["time_to_target_s"] for r in rows[:4]] == [20.0, 20.0, 4.0, None]
    assert [r["compute_comm_ratio"] for r in rows[:4]] == [3.0, 3.0, 7.0, 7.0]
    assert [r["outside_epochs_s"] for r in rows[:4]] == [0.0, 0.0, 3.0, 0.0]
    # what the run's timing says that time outside the epochs was (None: not recorded)
    assert [(r["checkpoint_s"], r["setup_s"]) for r in rows[:4]] == [(None, None)] * 2 + [(3.0, 0.5), (None, None)]
    assert rows[2]["val_acc_minus_ddp"] == 0.9 - 0.8      # paired with DDP of the same seed
    assert rows[3]["val_acc_minus_ddp"] == 0.6 - 0.9
    by = {a["strategy"]: a for a in report["by_strategy"]}
    assert (by["ddp"]["reached"], by["ddp"]["runs"], by["ddp"]["time_to_target_mean_s"]) == (2, 2, 20.0)
    assert (by["diloco"]["reached"], by["diloco"]["time_to_target_mean_s"]) == (1, 4.0)
    assert by["horovod"]["status"] == "not available: run x" and by["horovod"]["runs"] == 0
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "| diloco | 2 | 2 | not reached |" in md
    assert "| outside epochs s | ckpt s | setup s |" in md and "| 7.00 | 3.0 | 3.0 | 0.5 |" in md
    assert "| horovod | not available: run x |" in md
    assert "| diloco | 1/2 | 4.0 ± 0.0 [4.0, 4.0] |" in md


def test_plot_groups_seeds_per_strategy(tmp_path):
    """The chart draws one bar per strategy over its seeds (not one per run), and a
    strategy none of whose runs reached the target still gets its row."""
    dirs = [_run(tmp_path / "a", "ddp", 1, [0.6, 0.8], 10.0, 5.0), _run(tmp_path / "b", "diloco", 1, [0.5, 0.6], 4.0, 1.0),
            _run(tmp_path / "c", "ddp", 2, [0.85, 0.9], 10.0, 5.0), _run(tmp_path / "d", "diloco", 2, [0.5, 0.7], 4.0, 1.0)]
    runs = [load_run(d) for d in dirs]
    assert per_strategy(runs, lambda r: time_to_target(r["history"], 0.8)) == [("ddp", [20.0, 10.0]),
                                                                               ("diloco", [None, None])]
    assert per_strategy(runs, lambda r: r["summary"]["seed"]) == [("ddp", [1, 2]), ("diloco", [1, 2])]
    build_comparison(dirs, tmp_path / "out", target_acc=0.8)
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 1000


def test_a_loss_target_is_reached_going_down(tmp_path):
    """``target_loss`` (a language model's): the first validation at or below it; the
    report names the target and its final metric, and plots the loss."""
    from syncplane.bench.compare import Target, make_target

    history = [{"epoch_s": 2.0, "val_loss": 4.0}, {"epoch_s": 3.0, "val_loss": 3.0}, {"epoch_s": 4.0, "val_loss": 3.5}]
    assert time_to_target(history, Target("val_loss", 3.0)) == 5.0
    assert time_to_target(history, Target("val_loss", 4.5)) == 2.0
    assert time_to_target(history, Target("val_loss", 2.9)) is None
    assert make_target(None, None) is None and make_target(0.8) == Target("val_acc", 0.8)
    with pytest.raises(ValueError, match="not both"):
        make_target(0.8, 3.0)
    runs = []
    for name, seed, losses in (("ddp", 1, [4.0, 3.0]), ("diloco", 1, [4.5, 3.5])):
        folder = _run(tmp_path / name, name, seed, [0.1, 0.2], 10.0, 1.0)
        (folder / "history.jsonl").write_text("".join(
            json.dumps({"epoch": i, "step": i, "epoch_s": 10.0, "val_acc": 0.1, "val_loss": v}) + "\n"
            for i, v in enumerate(losses)))
        summary = json.loads((folder / "summary.json").read_text())
        summary["metrics"]["val_loss"] = losses[-1]
        (folder / "summary.json").write_text(json.dumps(summary))
        runs.append(folder)
    report = build_comparison(runs, tmp_path / "out", target_loss=3.2)
    assert report["target"] == {"metric": "val_loss", "value": 3.2} and report["target_loss"] == 3.2
    assert "target_acc" not in report
    assert [r["time_to_target_s"] for r in report["runs"]] == [20.0, None]
    assert report["runs"][1]["val_loss_minus_ddp"] == pytest.approx(0.5)
    by = {a["strategy"]: a for a in report["by_strategy"]}
    assert (by["ddp"]["reached"], by["ddp"]["val_loss_mean"], by["diloco"]["reached"]) == (1, 3.0, 0)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "time to val loss 3.2 (s)" in md and "| final val loss |" in md and "| diloco | 0/1 | not reached |" in md
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 1000


def test_variants_of_one_strategy_are_rows_of_their_own(tmp_path):
    runs = [_run(tmp_path / "a", "ddp", 1, [0.5, 0.9], 2.0, 1.0),
            _run(tmp_path / "b", "diloco", 1, [0.6, 0.9], 1.0, 0.1),
            _run(tmp_path / "c", "diloco", 1, [0.4, 0.8], 1.0, 0.05, label="diloco[compression=int8]")]
    report = build_comparison(runs, tmp_path / "out", target_acc=0.85)
    assert [a["strategy"] for a in report["by_strategy"]] == ["ddp", "diloco", "diloco[compression=int8]"]
    assert [r["time_to_target_s"] for r in report["runs"]] == [4.0, 2.0, None]
    assert "| diloco[compression=int8] |" in (tmp_path / "out" / "comparison.md").read_text()
