"""Train a recipe with a synchronization strategy: ``python train.py [key=value ...]``.

    python train.py                                  # digits, 2 CPU processes, defaults
    python train.py strategy=ddp trainer.devices=4   # pick a strategy and world size
    python train.py -m strategy=ddp,atc              # one job per strategy, side by side
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \
        --rdzv-id myjob train.py trainer.accelerator=gpu trainer.devices=8   # one rank per process
    srun train.py ...                                # likewise, from SLURM's variables (docs/clusters.md)

Configuration lives in ``configs/`` (groups: strategy, recipe, trainer, logger, cluster); ``cluster=``
takes a shipped profile's name or the path of your own profile YAML (``cluster=./mine.yaml``).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from syncplane.runtime import external, forkserver

    if external.detect() is None:
        # this process launches the ranks: its fork server imports torch and Lightning while
        # this one imports them to validate the job, instead of after it
        forkserver.warm_up()
    from syncplane.cluster.emulator import EmulationError, say_if_left_up
    from syncplane.config import ConfigError
    from syncplane.runtime.launcher import LaunchError
    from syncplane.runtime.entry import run_job
    from syncplane.runtime.rendezvous import RendezvousTimeout

    try:
        with say_if_left_up(cfg.get("cluster") is not None):   # it stays up for the next run: say so
            run_job(cfg)
    except ConfigError as exc:
        print(f"syncplane: invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    except EmulationError as exc:
        print(f"syncplane: cannot run on the emulated cluster: {exc}", file=sys.stderr)
        sys.exit(2)
    except RendezvousTimeout as exc:
        print(f"syncplane: {exc}", file=sys.stderr)
        sys.exit(1)
    except LaunchError as exc:
        print(f"syncplane: training failed: {exc}", file=sys.stderr)
        sys.exit(1)


def accept_cluster_files() -> None:
    """Let ``cluster=./mine.yaml`` name a profile file (Hydra alone only finds shipped names)."""
    from syncplane.config import ConfigError
    from syncplane.runtime.cluster_files import rewrite_cluster_overrides

    try:
        sys.argv[1:] = rewrite_cluster_overrides(sys.argv[1:])
    except ConfigError as exc:
        print(f"syncplane: invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from syncplane.runtime.lifetime import skip_collection_at_exit

    skip_collection_at_exit()
    accept_cluster_files()
    main()
