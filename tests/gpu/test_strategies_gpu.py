"""Every registered strategy trains a few steps with the model on the GPU, through
``train.py`` (``trainer.accelerator=gpu``, one device): the real worker, Lightning's
GPU accelerator and NCCL process group, our kernels on CUDA tensors.

One GPU is one rank: NCCL refuses two ranks on one device, so the multi-rank NCCL
exchange itself is not exercised here (docs/clusters.md says what remains unrun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

def _registered() -> list[str]:
    from syncplane.strategies import registry

    return registry.names()


#: every registered strategy: a new one is exercised on the GPU without editing this file
STRATEGIES = _registered()


def train(run_dir: Path, *overrides: str, timeout: float = 600) -> dict:
    result = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_on_one_gpu(strategy, tmp_path):
    summary = train(tmp_path / "run", f"strategy={strategy}", "recipe=digits", "trainer.accelerator=gpu",
                    "trainer.devices=1", "trainer.max_epochs=2", "trainer.log_every_n_steps=5")
    print(f"{strategy}: {json.dumps(summary['metrics'])} {json.dumps(summary['throughput'])}")
    assert summary["world_size"] == 1 and summary["steps"] > 0
    assert summary["metrics"]["val_acc"] > 0.5, summary["metrics"]   # 10 classes: chance is 0.1
