"""The Hydra side of ``train.py``: validate, launch the ranks, report.

This runs in the process Hydra created for one job (one per multirun job). It never
initializes torch.distributed itself; it validates the whole config first (so a typo
fails before any worker starts), writes the resolved config as ``job.yaml`` in the
run directory, and starts one worker per rank with ``syncplane.runtime.launcher``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import yaml
from omegaconf import DictConfig, OmegaConf

from syncplane import launch as launch_env
from syncplane.job import JobContext
from syncplane.config import ConfigError
from syncplane.runtime.launcher import cluster_session, launch, launch_on_cluster, local_ranks
from syncplane.runtime.lifetime import die_with_parent
from syncplane.runtime import external, forkserver, rendezvous
from syncplane.runtime.settings import JobSpec, parse_job
from syncplane.runtime.lighthouse import lighthouse_process
from syncplane.runtime.worker import JOB_FILE


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run one composed job; returns its summary. Raises ConfigError or LaunchError."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    container: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    launched = external.detect()
    if launched is not None:   # torchrun / srun started this process: it is one rank, not a launcher
        user_dir = run_dir if any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra) else None
        return run_as_rank(container, launched, user_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    job_name = f"job{hydra_cfg.job.num}" if multirun else "train"
    if multirun and not (container.get("logger") or {}).get("group"):
        # one W&B run per strategy, grouped per comparison
        sweep = Path(hydra_cfg.sweep.dir)
        container.setdefault("logger", {})["group"] = f"{sweep.parent.name}-{sweep.name}"
    return launch_job(container, run_dir, job_name)


def launch_job(container: dict[str, Any], run_dir: Path, job_name: str = "train", *,
               echo_to: IO[str] | None = None) -> dict[str, Any]:
    """Validate a composed config, start its ranks (locally or on its emulated cluster),
    wait, and return the summary. What ``train.py`` does per job, and ``syncplane compare``
    per run (``echo_to`` receives rank 0's output instead of stdout)."""
    spec = parse_job(container, run_dir=str(run_dir), job_name=job_name)
    forkserver.warm_up()
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir / JOB_FILE
    job_file.write_text(yaml.safe_dump({"config": container, "run_dir": str(run_dir), "job_name": job_name},
                                       sort_keys=False))
    world_size = spec.trainer.devices
    where = f"emulated cluster {spec.cluster.name!r}" if spec.cluster else "this machine"
    print(f"syncplane: {spec.strategy.name} on {spec.recipe_name} with {world_size} processes on {where}; "
          f"run dir {run_dir}", file=echo_to or sys.stdout, flush=True)
    command = [sys.executable, "-m", "syncplane.runtime.worker", str(job_file)]
    if spec.cluster is None:
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local job: gloo listens on loopback only
        store_file = run_dir / "rendezvous.store"   # a file store: no TCP listener at all
        store_file.unlink(missing_ok=True)
        env[rendezvous.FILE_ENV] = str(store_file.resolve())
        if spec.elastic:
            launch_elastic(command, spec, run_dir, env, echo_to=echo_to)
        else:
            launch(command, local_ranks(world_size), run_dir / "logs", env=env, echo_to=echo_to)
    elif spec.elastic:
        launch_elastic(command, spec, run_dir, dict(os.environ), echo_to=echo_to)
    else:
        launch_on_cluster(command, spec.cluster, run_dir / "logs", echo_to=echo_to)
    summary_path = run_dir / "summary.json"
    if spec.elastic and not summary_path.exists():
        # replica 0 was lost for good: the lowest replica that finished reports
        for path in sorted(run_dir.glob("replica*/summary.json")):
            summary_path.write_text(path.read_text())
            break
    if not summary_path.exists():
        raise RuntimeError(f"the job finished but wrote no {summary_path}; see {run_dir / 'logs'}")
    return dict(json.loads(summary_path.read_text()))


def launch_elastic(command: list[str], spec: JobSpec, run_dir: Path, env: dict[str, str],
                   echo_to: IO[str] | None = None) -> None:
    """Start the quorum service, then one independent replica per rank (each a Lightning job
    of one process with its own file-store rendezvous), or per host where the strategy's
    family asks for it (``ElasticLaunch.per_host``: a Lightning job of the host's ranks, which
    fail and restart together), restarting a failed replica up to ``trainer.max_restarts``
    times. The service lives as long as this launcher: in this process on loopback for a local job; on an emulated cluster, as a process on host 0
    bound to that host's first NIC (``syncplane.runtime.lighthouse``), and each replica's
    own servers bind its host's first NIC. The service, its timeouts and a local job's bind
    address are the strategy's family's (``AlgorithmSpec.elastic``)."""
    elastic = spec.elastic_launch
    if elastic is None:
        raise ValueError(f"strategy {spec.strategy.name} with {dict(spec.strategy.kwargs)} is not an elastic job")
    kwargs = spec.strategy.kwargs
    timeouts = elastic.timeouts(kwargs)
    replicas = spec.trainer.devices
    (run_dir / "elastic_fingerprint.json").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "elastic_ready", ignore_errors=True)
    shutil.rmtree(run_dir / "elastic_rounds", ignore_errors=True)
    (run_dir / "elastic_done").unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if spec.cluster is None:
            places = local_ranks(replicas)
            binds = [elastic.bind(kwargs)] * replicas
            service = elastic.start(binds[0], **timeouts)
            stack.callback(service.shutdown)
            address = service.address
        else:
            from syncplane.cluster import emulator

            places = stack.enter_context(cluster_session(spec.cluster, run_dir / "logs"))
            binds = [spec.cluster.host_of_rank(r).address(0) for r in range(replicas)]
            address = stack.enter_context(lighthouse_process(
                emulator.rank_prefix(spec.cluster, 0), binds[0], strategy=spec.strategy.name,
                log_file=run_dir / "logs" / "lighthouse.log", env=env, **timeouts))
        hosts = [list(h.ranks) for h in spec.cluster.hosts] if spec.cluster is not None else [list(range(replicas))]
        groups = hosts if elastic.per_host(kwargs, [len(h) for h in hosts]) else [[r] for r in range(replicas)]
        ranks = []
        for replica, members in enumerate(groups):
            store = run_dir / f"rendezvous.replica{replica}.store"
            store.unlink(missing_ok=True)
            for local, rank in enumerate(members):
                place, size = places[rank], str(len(members))
                ranks.append(replace(place, local_rank=local, local_world_size=len(members), replica=replica, env={
                    **place.env, "RANK": str(local), "LOCAL_RANK": str(local), "WORLD_SIZE": size,
                    "LOCAL_WORLD_SIZE": size, rendezvous.FILE_ENV: str(store.resolve()),
                    launch_env.REPLICA_ENV: str(replica), launch_env.REPLICAS_ENV: str(len(groups)),
                    launch_env.LIGHTHOUSE_ENV: address, launch_env.BIND_ENV: binds[rank],
                    launch_env.ELASTIC_DIR_ENV: str(run_dir.resolve())}))
        launch(command, ranks, run_dir / "logs", env=env, max_restarts=spec.trainer.max_restarts,
               restart_delay_s=spec.trainer.restart_delay_s, echo_to=echo_to)


def run_as_rank(container: dict[str, Any], launched: external.ExternalLaunch, user_dir: Path | None) -> dict[str, Any]:
    """Train as the one rank ``launched`` describes; rank 0 returns the summary, others {}.

    Validation runs here on every rank before anything distributed happens, with the
    same errors as a local job, plus the launch's own checks (devices per node, a run
    directory every rank agrees on and can write)."""
    from syncplane.runtime import worker

    die_with_parent()   # torchrun's agent (or srun) killed outright takes this rank with it
    strategy = str((container.get("strategy") or {}).get("name"))
    run_dir = external.run_dir_for(launched, user_dir, strategy)
    spec = parse_job(container, run_dir=str(run_dir),
                     world=JobContext.from_environment(rank=launched.rank, world_size=launched.world_size))
    if spec.cluster is not None:
        raise ConfigError("cluster: an emulated cluster starts its own ranks; leave cluster unset under "
                          f"{launched.launcher} (rank {launched.rank})")
    external.check_devices(spec.trainer.devices, launched)
    external.check_writable(run_dir, launched.rank)
    external.adopt(launched, os.environ)
    if launched.rank == 0:
        (run_dir / JOB_FILE).write_text(yaml.safe_dump({"config": container, "run_dir": str(run_dir),
                                                        "job_name": "train"}, sort_keys=False))
        print(f"syncplane: {spec.strategy.name} on {spec.recipe_name}, rank 0 of {launched.world_size} "
              f"started by {launched.launcher}; run dir {run_dir}", flush=True)
    try:
        summary = worker.run(spec)
    finally:
        worker.close_process_group()
    return (summary or {}) if launched.rank == 0 else {}
