"""The Hydra side of ``train.py``: validate, launch the ranks, report.

This runs in the process Hydra created for one job (one per multirun job). It never
initializes torch.distributed itself; it validates the whole config first (so a typo
fails before any worker starts), writes the resolved config as ``job.yaml`` in the
run directory, and starts one worker per rank with ``syncplane.launcher``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from syncplane.launcher import launch, launch_on_cluster, local_ranks
from syncplane.training.job import parse_job
from syncplane.training.worker import JOB_FILE


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run one composed job; returns its summary. Raises ConfigError or LaunchError."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    container: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    job_name = f"job{hydra_cfg.job.num}" if multirun else "train"
    if multirun and not (container.get("logger") or {}).get("group"):
        # one W&B run per strategy, grouped per comparison
        sweep = Path(hydra_cfg.sweep.dir)
        container.setdefault("logger", {})["group"] = f"{sweep.parent.name}-{sweep.name}"
    spec = parse_job(container, run_dir=str(run_dir), job_name=job_name)

    job_file = run_dir / JOB_FILE
    job_file.write_text(yaml.safe_dump({"config": container, "run_dir": str(run_dir), "job_name": job_name},
                                       sort_keys=False))
    world_size = spec.trainer.devices
    where = f"emulated cluster {spec.cluster.name!r}" if spec.cluster else "this machine"
    print(f"syncplane: {spec.strategy.name} on {spec.recipe_name} with {world_size} processes on {where}; "
          f"run dir {run_dir}", flush=True)
    command = [sys.executable, "-m", "syncplane.training.worker", str(job_file)]
    if spec.cluster is None:
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local job: gloo listens on loopback only
        launch(command, local_ranks(world_size), run_dir / "logs", env=env)
    else:
        launch_on_cluster(command, spec.cluster, run_dir / "logs")
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the job finished but wrote no {summary_path}; see {run_dir / 'logs'}")
    return json.loads(summary_path.read_text())
