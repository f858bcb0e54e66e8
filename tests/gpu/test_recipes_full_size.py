"""The recipes at full size on one GPU for a handful of steps: ResNet-50 (ImageNet preset:
224 px, 1000 classes, batch 32, bf16, channels_last) and BERT-large (phase-1 preset:
sequence 128, batch 64, bf16, LAMB), on data generated here (nothing downloaded).

Reports step time, samples/s and MFU from ``summary.json`` (printed; run with ``-s``).
Correctness only is asserted -- the run finishes, the losses are finite, the throughput
and MFU fields are filled -- never a speed."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
ONE_GPU = ["trainer.devices=1", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=5"]


def train(run_dir: Path, *overrides: str) -> dict:
    result = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def report(name: str, summary: dict) -> None:
    t = summary["throughput"]
    print(f"\nGPU-RESULT {name}: step_s_median={t['step_s_median']:.4f} samples_per_s={t['samples_per_s']:.1f} "
          f"mfu={t.get('mfu')} model_tflops={(t.get('model_flops_per_s') or 0) / 1e12:.1f} "
          f"steps={summary['steps']}", flush=True)


def check(summary: dict) -> None:
    t = summary["throughput"]
    assert summary["steps"] == STEPS and summary["world_size"] == 1
    assert t["samples_per_s"] > 0 and t["step_s_median"] > 0
    assert t.get("model_flops_per_s") and t["model_flops_per_s"] > 0
    assert t.get("mfu") is None or 0 < t["mfu"] < 1      # None only where Lightning knows no peak for the chip


def assert_finite_losses(run_dir: Path) -> None:
    """Every logged training loss (the CSV log, every ``log_every_n_steps``) is a finite number."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(v) for row in rows for k, v in row.items() if "loss" in k and k.startswith("train") and v]
    assert losses and all(math.isfinite(x) for x in losses), losses


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory) -> Path:
    """1,000 class folders of 224-ish JPEGs: the full model's 1000-way head, real decoding."""
    from PIL import Image

    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 2), ("val", 1)):
        for c in range(1000):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (256, 320, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{c}_{i}.JPEG", quality=85)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)] + "the a of and to in is was for on".split() * 50
    with open(path, "w") as f:
        for i in range(60_000):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + ".\n")
            if i % 40 == 39:
                f.write("\n")
    return path


@pytest.mark.parametrize("strategy", ["ddp", "atc"])
def test_resnet50_full_size_steps(strategy, imagenet_like, tmp_path):
    summary = train(tmp_path / "run", "+experiment=resnet50_b32", f"recipe.data_root={imagenet_like}",
                    f"strategy={strategy}", *ONE_GPU)
    report(f"resnet50_b32/{strategy}", summary)
    check(summary)
    assert_finite_losses(tmp_path / "run")


@pytest.mark.parametrize("strategy", ["ddp", "atc"])
def test_bert_large_full_size_steps(strategy, corpus, tmp_path):
    summary = train(tmp_path / "run", "+experiment=bert_large_phase1", f"recipe.data_files=[{corpus}]",
                    f"recipe.cache_dir={tmp_path / 'cache'}", "trainer.accumulate_grad_batches=1",
                    f"strategy={strategy}", *ONE_GPU)
    report(f"bert_large_phase1/{strategy}", summary)
    check(summary)
    assert_finite_losses(tmp_path / "run")
