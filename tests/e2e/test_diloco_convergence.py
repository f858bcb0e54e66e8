"""DiLoCo at H = 10 reaches DDP's accuracy on ``digits`` (within 1.5 points), end to end."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_train import train


@pytest.mark.slow
def test_diloco_h10_matches_ddp_on_digits_with_4_ranks(tmp_path):
    accuracy, sent = {}, {}
    for strategy in ("ddp", "diloco"):
        run_dir = tmp_path / strategy
        result = train(f"strategy={strategy}", "trainer.devices=4", f"hydra.run.dir={run_dir}",
                       *(["strategy.kwargs.sync_every=10"] if strategy == "diloco" else []), timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["strategy"] == strategy
        accuracy[strategy] = summary["metrics"]["val_acc"]
        sent[strategy] = summary["comm"]["bytes_sent_per_rank"]
    assert accuracy["ddp"] > 0.9, accuracy
    assert accuracy["diloco"] >= accuracy["ddp"] - 0.015, accuracy
    # Δ travels once per 10 steps (validation's consensus averaging adds a little)
    assert sent["diloco"] < sent["ddp"] / 4, sent
