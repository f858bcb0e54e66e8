"""Train a recipe with a synchronization strategy: ``python train.py [key=value ...]``.

    python train.py                                  # digits, 2 CPU processes, defaults
    python train.py strategy=ddp trainer.devices=4   # pick a strategy and world size
    python train.py -m strategy=ddp,atc              # one job per strategy, side by side

Configuration lives in ``configs/`` (groups: strategy, recipe, trainer, logger).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from syncplane.cluster.emulator import EmulationError
    from syncplane.config import ConfigError
    from syncplane.launcher import LaunchError
    from syncplane.training.entry import run_job

    try:
        run_job(cfg)
    except ConfigError as exc:
        print(f"syncplane: invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    except EmulationError as exc:
        print(f"syncplane: cannot run on the emulated cluster: {exc}", file=sys.stderr)
        sys.exit(2)
    except LaunchError as exc:
        print(f"syncplane: training failed: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
