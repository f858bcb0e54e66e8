"""One rank of a training job: ``python -m syncplane.runtime.worker JOB.yaml``.

The launcher starts this with torchrun's environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); Lightning's
``TorchElasticEnvironment`` reads them, so Lightning joins the job instead of
launching processes of its own. The same worker runs unchanged under ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from syncplane.comm.basics import release_groups
from syncplane.config import ConfigError
from syncplane.job import JobContext
from syncplane.runtime import autopilot, rendezvous
from syncplane.runtime.lifetime import die_with_parent, skip_collection_at_exit
from syncplane.runtime.settings import JobSpec, StrategySpec, parse_job

JOB_FILE = "job.yaml"


def threads_per_rank(spec: JobSpec, local_world_size: int) -> int:
    """Torch threads for one rank: the job's ``trainer.threads_per_rank``, else the machine's
    cores shared by the ``local_world_size`` ranks on it."""
    if spec.trainer.threads_per_rank > 0:
        return spec.trainer.threads_per_rank
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def make_loggers(spec: JobSpec) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    loggers: list[Any] = []
    if spec.logger.csv:
        loggers.append(CSVLogger(save_dir=spec.run_dir, name="csv", version=""))
    if spec.logger.wandb:
        try:
            import wandb
        except ImportError:
            raise ConfigError("logger.wandb: Weights & Biases is an extra: pip install 'syncplane[wandb]' "
                              "(or log CSV only: logger=csv)") from None

        # Offline by default and no crash reports: a run must make no network calls
        # unless the user asked for mode=online.
        os.environ["WANDB_ERROR_REPORTING"] = "false"
        os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(WandbLogger(
            project=spec.logger.project, name=f"{spec.strategy.name}-{spec.job_name}",
            group=spec.logger.group, save_dir=spec.run_dir, tags=[spec.strategy.name, spec.recipe_name],
            settings=wandb.Settings(mode=spec.logger.mode, console="off"),
        ))
    return loggers


def configure_logging(rank: int) -> None:
    """syncplane's loggers (strategies, algorithms) to stdout: INFO on rank 0, warnings on
    the others -- what a strategy found at setup (DS-Sync's topology table, the pair-stream
    choice) is shown once, in the rank's log."""
    logger = logging.getLogger("syncplane")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def run(spec: JobSpec) -> dict[str, Any] | None:
    """Train ``spec`` as this rank; returns the run summary (every rank has it)."""
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch import Trainer, seed_everything

    from syncplane import recipes
    from syncplane.strategies import registry
    from syncplane.runtime.checkpoint_io import AtomicCheckpointIO, LastCheckpoint
    from syncplane.runtime.heartbeat_callback import HeartbeatCallback
    from syncplane.runtime.liveness import InjectFault
    from syncplane.runtime.report import RunReport
    from syncplane.runtime.settings import FAILING_KINDS
    from syncplane.runtime.slowdown import ComputeReport, SlowCompute, Slowdown, plan_slowdowns

    # the job's shape, read from the launcher once, here; everything below gets it as an argument
    job = JobContext.from_environment(run_dir=spec.run_dir)
    world_size = job.world_size
    replica = job.elastic.replica if job.elastic is not None else None
    if spec.elastic and replica is not None:
        spec = _as_replica(spec, replica, job.elastic.restarts if job.elastic is not None else 0)
        job = dataclasses.replace(job, run_dir=Path(spec.run_dir))
    # an elastic replica's rank in the job: replica·L + its rank in the replica's own job of L
    own_rank = job.rank if replica is None else replica * world_size + job.rank
    configure_logging(own_rank)
    local_world_size = job.local_world_size or world_size
    # an emulated cluster runs every rank on this one machine
    ranks_here = world_size if spec.cluster else local_world_size
    torch.set_num_threads(threads_per_rank(spec, ranks_here))
    # Same seed on every rank: identical initial weights (broadcast anyway) and a shared
    # shuffle; the DistributedSampler gives each rank its own shard.
    seed_everything(spec.seed, workers=True, verbose=False)

    # our own rendezvous (file store locally, missing ranks named on timeout); Lightning
    # then finds the group initialized and joins it
    rendezvous.join(spec.trainer.accelerator, spec.trainer.rendezvous_timeout_s)
    module, data = recipes.get(spec.recipe_name).build(spec.recipe)
    auto, replanner = None, None
    if spec.strategy.name == autopilot.AUTO:   # decided here, identically on every rank, then run as if named
        broadcast = autopilot.torch_broadcast()
        # the plan prices the ranks' CPU work where it runs on CPUs: the ranks on this machine share its cores
        sharing = ranks_here / len(os.sched_getaffinity(0)) if spec.trainer.accelerator == "cpu" else None
        auto = autopilot.choose_strategy(spec.strategy.kwargs, spec.cluster, module, data, broadcast, sharing,
                                         job.rank)
        replanner = autopilot.replanner(spec.strategy.kwargs, spec.cluster, auto, broadcast, job.rank)
        chosen = StrategySpec(auto["choice"]["strategy"], dict(auto["choice"]["kwargs"]))
        registry.validate(chosen.name, chosen.kwargs, job)
        spec = dataclasses.replace(spec, strategy=chosen)
    # a choice that a re-plan may switch to another strategy runs as a strategy that can switch
    strategy = (replanner.build(TorchElasticEnvironment(), job) if replanner is not None else None) or \
        registry.build(spec.strategy.name, spec.strategy.kwargs, TorchElasticEnvironment(), job=job)
    if auto is not None:
        if not isinstance(getattr(strategy, "details", None), dict):
            strategy.details = {}    # Lightning's own DDP keeps none
        strategy.details["auto"] = auto
    # emulated slow compute (profile compute_speed, fault.kind=slow): planned alike on every rank
    speeds = spec.cluster.compute_speeds() if spec.cluster is not None else None
    slowdowns = plan_slowdowns(speeds, spec.faults)
    nominal_s = spec.trainer.emulated_step_s   # an emulated accelerator: every rank waits, slowed or not
    slow = (SlowCompute(slowdowns.get(own_rank, Slowdown()), nominal_s=nominal_s)
            if own_rank in slowdowns or nominal_s > 0 else None)
    report = RunReport(spec.run_dir, spec.strategy.name, spec.recipe_name, spec.seed, spec.label,
                       compute=ComputeReport(speeds, slowdowns, own_rank, slow, nominal_s),
                       target_val_loss=spec.trainer.target_val_loss)
    checkpoints = LastCheckpoint(Path(spec.run_dir) / "checkpoints")
    trainer_cfg = spec.trainer
    # CPU processes may be spread unevenly over (emulated) hosts: present them to
    # Lightning as one node of world_size devices; ranks come from the environment.
    on_cpu = trainer_cfg.accelerator == "cpu"
    if not on_cpu and world_size % local_world_size:
        raise RuntimeError(f"{world_size} GPU processes cannot be split evenly into hosts of {local_world_size}")
    trainer = Trainer(
        accelerator=trainer_cfg.accelerator,
        devices=world_size if on_cpu else local_world_size,
        num_nodes=1 if on_cpu else world_size // local_world_size,
        strategy=strategy,
        max_epochs=trainer_cfg.max_epochs,
        max_steps=trainer_cfg.max_steps,
        precision=trainer_cfg.precision,  # type: ignore[arg-type]
        accumulate_grad_batches=trainer_cfg.accumulate_grad_batches,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        check_val_every_n_epoch=trainer_cfg.check_val_every_n_epoch,
        gradient_clip_val=trainer_cfg.gradient_clip_val,
        deterministic=trainer_cfg.deterministic,
        logger=make_loggers(spec) or False,
        # the slowdown first: the report's step times then include its wait, as a slower GPU's would
        callbacks=[*([slow] if slow is not None else []), report, checkpoints, *([replanner] if replanner else []),
                   # the launcher ends the job's processes itself: no reaping of a lost rank here
                   HeartbeatCallback(trainer_cfg.heartbeat_timeout_s, reap=False),
                   *(InjectFault(f) for f in spec.faults if f.kind in FAILING_KINDS)],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=spec.run_dir,
        enable_progress_bar=False,  # one line per epoch instead (logs are files, not TTYs)
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data, ckpt_path=spec.resume)
    return report.summary


def _as_replica(spec: JobSpec, replica: int, restart: int) -> JobSpec:
    """An elastic replica is a Lightning job of one process: replica 0 writes the job's
    summary and history in the run folder, the others their own in ``replica<i>/``; a
    restarted replica rendezvouses (with itself) on a fresh file store. ``resume`` names replica
    0's checkpoint (``<run>/checkpoints/x.ckpt``): replica i resumes from its own beside it
    (``<run>/replica<i>/checkpoints/x.ckpt``) where that exists, else from replica 0's."""
    if restart:
        os.environ[rendezvous.FILE_ENV] = f"{os.environ[rendezvous.FILE_ENV]}.restart{restart}"
    if replica == 0:
        return spec
    resume = spec.resume
    if resume is not None:
        given = Path(resume)
        own = given.parent.parent / f"replica{replica}" / given.parent.name / given.name
        resume = str(own) if own.is_file() else resume
    return dataclasses.replace(spec, run_dir=str(Path(spec.run_dir) / f"replica{replica}"), resume=resume)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m syncplane.runtime.worker RUN_DIR/job.yaml", file=sys.stderr)
        return 2
    die_with_parent()   # a launcher killed outright takes its ranks with it
    # torchft's Rust side logs every quorum at INFO to stderr; warnings are what a user needs
    os.environ.setdefault("RUST_LOG", "warn")
    job = yaml.safe_load(Path(args[0]).read_text())
    try:
        spec = parse_job(job["config"], run_dir=job["run_dir"], job_name=job.get("job_name", "train"))
        try:
            run(spec)
        finally:
            close_process_group()
    except ConfigError as exc:
        # a check only the running ranks can make (what this host has, what the ranks agree
        # on): one line naming the key on every rank, as train.py's own, not a traceback
        print(f"syncplane: rank {os.environ.get('RANK', '?')}: invalid configuration: {exc}", file=sys.stderr,
              flush=True)
        return 2
    return 0


def close_process_group() -> None:
    """Tear gloo down before the interpreter exits (``comm.basics.release_groups`` says why)."""
    release_groups()


if __name__ == "__main__":
    skip_collection_at_exit()   # a fresh process's exit (a fork of the server leaves with os._exit)
    sys.exit(main())
