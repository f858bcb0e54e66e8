"""``summary.json``'s field reference (``docs/reference/summary.md``) is generated from
``syncplane.runtime.report.SUMMARY_FIELDS``; here that list is held against the summary a real
run writes (one CPU process, with emulated compute and a slowed rank so that every optional
entry is filled): a field the report writes that the list does not name, or a field the list
names that no run writes, fails. That the page is current is ``test_results_page``'s
``test_generated_pages_are_current``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Trainer

from syncplane.runtime.report import SUMMARY_FIELDS, RunReport
from syncplane.runtime.slowdown import ComputeReport, SlowCompute, Slowdown
from tests.helpers.models import RegressionData, TinyRegressor


def fields(value: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted field of a summary, ``[]`` for the items of a list of objects."""
    for key, item in value.items():
        name = f"{prefix}{key}"
        yield name
        if isinstance(item, dict):
            yield from fields(item, f"{name}.")
        elif isinstance(item, list) and item and all(isinstance(x, dict) for x in item):
            for x in item:
                yield from fields(x, f"{name}[].")


def undocumented(summary: dict[str, Any]) -> list[str]:
    """The summary's fields that ``SUMMARY_FIELDS`` names neither exactly nor by a ``parent.*``."""
    return sorted({f for f in fields(summary) if f not in SUMMARY_FIELDS
                   and f"{f.rsplit('.', 1)[0]}.*" not in SUMMARY_FIELDS})


def real_summary(tmp_path) -> dict[str, Any]:
    slowed = SlowCompute(Slowdown(factor=1.5, from_step=2), wait=lambda seconds: None, nominal_s=0.01)
    report = RunReport(tmp_path, "single", "regression", seed=0, target_val_loss=1e6,
                       compute=ComputeReport([1.0], {0: slowed.slowdown}, rank=0, own=slowed, emulated_step_s=0.01))
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[slowed, report],
                      default_root_dir=tmp_path)
    trainer.fit(TinyRegressor(), RegressionData(n=32))
    return json.loads((tmp_path / "summary.json").read_text())


def test_every_field_a_run_writes_is_in_the_reference_and_every_listed_field_is_written(tmp_path):
    summary = real_summary(tmp_path)
    assert undocumented(summary) == [], "add them to SUMMARY_FIELDS, then run scripts/results.py"
    written = set(fields(summary))
    # the wildcards' children vary by strategy, recipe and profile (a plain strategy has no phases)
    never = sorted(f for f in SUMMARY_FIELDS if not f.endswith(".*") and f not in written)
    assert never == [], f"SUMMARY_FIELDS names fields no run writes: {never}"
    assert summary["compute"]["slowed"] and summary["time_to_target_s"] is not None   # the optional parts ran


def test_a_planted_field_is_caught():
    summary = {"strategy": "ddp", "metrics": {"val_acc": 0.9, "val_bleu": 1.0}, "comm": {"seconds": 1.0, "wire": 2},
               "compute": {"slowed": [{"rank": 1, "why": "x"}]}, "new": 0}
    assert undocumented(summary) == ["comm.wire", "compute.slowed[].why", "new"]


def test_the_summary_path_is_printed_on_one_line_however_long(tmp_path, capsys):
    from syncplane.runtime.report import print_summary

    summary = real_summary(tmp_path)
    capsys.readouterr()
    path = tmp_path / ("a-run-directory-deep-in-a-cluster-filesystem-" * 3) / "summary.json"
    print_summary(summary, path)
    assert f"summary written to {path}\n" in capsys.readouterr().out   # to copy, not cut at the table's width
