"""Hydra callback: when a multirun ends, write a comparison report beside its runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class ComparisonReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from syncplane.bench.compare import build_comparison, runs_under

        sweep_dir = Path(config.hydra.sweep.dir)
        runs = runs_under(sweep_dir)
        if runs:
            build_comparison(runs, sweep_dir)
            print(f"syncplane: comparison of {len(runs)} runs written to {sweep_dir}/comparison.{{md,json,png}}")
