"""DiLoCo at H = 10 reaches DDP's accuracy on ``digits`` within a margin taken from the
measured spread, end to end (4 ranks, 15 epochs, 359 validation images: 1 image = 0.28 points).

Measured spread of DiLoCo − DDP (validation accuracy, points): seed 42: −1.11, seed 1: −0.28,
seed 2: −1.11 (this machine, AVX-512); seed 42 with ``ATEN_CPU_CAPABILITY=avx2``: −1.11; seed 42
on the machine of issue 18: −1.67 (DiLoCo 0.9750). DDP gave 0.9917 in all of them. Mean −1.06,
standard deviation 0.50 over these 5 runs, so the margin is mean − 3 sd ≈ −2.6 points: the old
1.5-point margin sat inside the spread. On one machine a run is bit-identical whatever the load
(``tests/dist/test_determinism.py``); between machines the CPU's vector ISA changes fp32 rounding,
which after 15 epochs moves DiLoCo by a few images -- the spread above covers that.
A DiLoCo that does not average (or steps the wrong way) loses far more than 2.6 points.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_train import train

#: mean − 3 sd of DiLoCo − DDP over the runs in the module docstring
MARGIN = 0.026


@pytest.mark.slow
def test_diloco_h10_matches_ddp_on_digits_with_4_ranks(tmp_path):
    accuracy, sent = {}, {}
    for strategy in ("ddp", "diloco"):
        run_dir = tmp_path / strategy
        result = train(f"strategy={strategy}", "trainer.devices=4", "seed=42", f"hydra.run.dir={run_dir}",
                       *(["strategy.kwargs.sync_every=10"] if strategy == "diloco" else []), timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["strategy"] == strategy
        accuracy[strategy] = summary["metrics"]["val_acc"]
        sent[strategy] = summary["comm"]["bytes_sent_per_rank"]
    assert accuracy["ddp"] > 0.9, accuracy
    assert accuracy["diloco"] >= accuracy["ddp"] - MARGIN, accuracy
    # Δ travels once per 10 steps (validation's consensus average is counted apart)
    assert sent["diloco"] < sent["ddp"] / 4, sent
