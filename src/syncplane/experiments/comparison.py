"""``syncplane compare``: train one recipe with several strategies and peers, one after
another on the same (emulated) network, and write one comparison report.

Every run is composed from ``configs/`` exactly as ``python train.py strategy=NAME
recipe=R cluster=C seed=S [overrides]`` would compose it (Hydra's compose API), so any
override that works for ``train.py`` works here. Strategies run through the same
launcher as ``train.py``; peers (``horovod``, ``torchft_diloco``: see
``syncplane.experiments.peers``) run the same recipe in their own framework. A peer that
is not installed, or a run that fails, becomes a row saying so. The report is
``syncplane.bench.compare``'s (time to the target accuracy, throughput, bytes, final
accuracy, compute/comm ratio, accuracy-vs-time curves; with ``--target-loss``, time to
a validation loss and loss-vs-time curves); all runs share one W&B group
(offline unless ``logger.mode=online``).
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncplane.bench.matrix import git_commit
from syncplane.config import ConfigError, parse_list, parse_variant

log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"


@dataclass
class CompareSettings:
    """What ``syncplane compare`` runs; ``overrides`` are Hydra overrides for every run."""

    recipe: str
    strategies: list[str]
    cluster: str | None = None
    target_acc: float | None = None
    target_loss: float | None = None   # lower is better: a language model's validation loss
    seeds: list[int] = field(default_factory=lambda: [42])
    devices: int | None = None
    overrides: list[str] = field(default_factory=list)
    out: Path = Path("comparisons")
    wandb: bool = True
    wandb_mode: str = "offline"

    def validate(self) -> None:
        from syncplane.strategies import registry

        from syncplane.experiments.peers import PEERS

        if not self.strategies:
            raise ConfigError("--strategies: give at least one strategy or peer")
        known = [*registry.names(), *PEERS]
        for item in self.strategies:
            name, options = parse_variant(item)
            if name not in known:
                raise ConfigError(f"--strategies: unknown strategy or peer {name!r}; allowed values: "
                                  f"{', '.join(known)}")
            if options and name in PEERS:
                raise ConfigError(f"--strategies: {item!r}: a peer takes no [key=value] options")
        if len(set(self.strategies)) != len(self.strategies):
            raise ConfigError(f"--strategies: {','.join(self.strategies)} names a strategy twice")
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:
            raise ConfigError(f"--target-acc: must be in (0, 1], got {self.target_acc}")
        if self.target_loss is not None and not self.target_loss > 0.0:
            raise ConfigError(f"--target-loss: must be positive, got {self.target_loss}")
        if self.target_acc is not None and self.target_loss is not None:
            raise ConfigError("--target-acc, --target-loss: give one target, not both")
        if not self.seeds:
            raise ConfigError("--seeds: give at least one seed")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"--devices: must be at least 1, got {self.devices}")
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"--wandb-mode: offline, online or disabled, got {self.wandb_mode!r}")


def compose_job(overrides: list[str], what: str) -> dict[str, Any]:
    """The job config ``python train.py OVERRIDES`` composes, as plain resolved containers
    (no ``hydra`` key); a bad override is a ConfigError naming ``what`` was composed."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from syncplane.runtime.cluster_files import rewrite_cluster_overrides

    overrides = rewrite_cluster_overrides(overrides)   # cluster=./mine.yaml: the user's own profile
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose("config", overrides=overrides)
    except HydraException as exc:
        raise ConfigError(f"composing {what}: {exc}") from None
    container: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    container.pop("hydra", None)
    return container


def compose(settings: CompareSettings, name: str, seed: int, group: str) -> dict[str, Any]:
    """The job config ``train.py`` would compose for run ``name`` (a strategy, a variant
    ``NAME[key=value,...]`` of its kwargs, or a peer: a peer takes its base strategy's
    config, so torchft's DiLoCo gets our DiLoCo's H and outer optimizer)."""
    from syncplane.experiments.peers import BASE_STRATEGY

    base, options = parse_variant(name)
    overrides = [f"strategy={BASE_STRATEGY.get(base, base)}", f"recipe={settings.recipe}", f"seed={seed}",
                 *([f"label='{name}'"] if options else []), *(f"strategy.kwargs.{key}={value}" for key, value in options),
                 *([f"cluster={settings.cluster}"] if settings.cluster else []),
                 f"logger={'wandb' if settings.wandb else 'csv'}", f"logger.group={group}",
                 *([f"logger.mode={settings.wandb_mode}"] if settings.wandb else []),
                 *([f"trainer.devices={settings.devices}"] if settings.devices else []),
                 *settings.overrides]
    container = compose_job(overrides, name)
    if container.get("cluster") is not None and settings.devices is None \
            and not any(o.startswith("trainer.devices=") for o in settings.overrides):
        from syncplane.cluster import parse_profile

        container["trainer"]["devices"] = parse_profile(container["cluster"]).world_size   # one rank per slot
    return container


class _Progress(io.TextIOBase):
    """Rank 0's progress lines (its epochs, the job's start, errors), each tagged with the
    run it belongs to and the time since the comparison started:
    ``[3/9 atc seed 42 | 00:02:41] epoch 2/5 ...``. Everything else rank 0 prints (a
    peer's own chatter, the per-run table) stays in the run's ``logs/rank0.log``."""

    SHOWN = ("epoch ", "syncplane", "Traceback", "Error", "error:")

    def __init__(self, tag: str, started: float) -> None:
        self.tag, self.started, self._pending = tag, started, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if not line.lstrip().startswith(self.SHOWN):
                continue
            elapsed = time.strftime("%H:%M:%S", time.gmtime(time.perf_counter() - self.started))
            log.info("[%s | %s] %s", self.tag, elapsed, line)
        return len(text)


def run_comparison(settings: CompareSettings) -> dict[str, Any]:
    """Run every (strategy or peer, seed) in turn; write and return the report."""
    from syncplane.bench.compare import build_comparison
    from syncplane.runtime.launcher import LaunchError
    from syncplane.runtime.entry import launch_job
    from syncplane.runtime.settings import parse_job
    from syncplane.experiments.peers import PEERS, run_peer, unavailable_reason

    settings.validate()
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    group = f"compare-{settings.recipe}-{settings.cluster or 'local'}-{time.strftime('%Y%m%d-%H%M%S')}"
    # compose and validate every run before the first one starts: a typo fails in seconds, not an hour in
    plan = []
    for name in settings.strategies:
        for seed in settings.seeds:
            container = compose(settings, name, seed, group)
            parse_job(container, run_dir=str(out))
            plan.append((name, seed, container))
    missing: list[dict[str, Any]] = []
    run_dirs: list[Path] = []
    started = time.perf_counter()
    for index, (name, seed, container) in enumerate(plan, 1):
        tag = f"{index}/{len(plan)} {name} seed {seed}"
        reason = unavailable_reason(name) if name in PEERS else None   # asked now: a build may finish meanwhile
        if reason:
            log.warning("[%s] skipped: %s", tag, reason)
            missing.append({"strategy": name, "seed": seed, "status": reason})
            continue
        run_dir = (out / f"{index:02d}-{dir_name(name)}-s{seed}").resolve()
        log.info("[%s] starting in %s", tag, run_dir)
        progress = _Progress(tag, started)
        run_start = time.perf_counter()
        try:
            if name in PEERS:
                summary = run_peer(name, container, run_dir, echo_to=progress)
                if settings.wandb:
                    _log_to_wandb(run_dir, container, name, seed)
            else:
                summary = launch_job(container, run_dir, f"s{seed}", echo_to=progress)
        except (LaunchError, RuntimeError, ConfigError) as exc:
            log.error("[%s] failed: %s", tag, exc)
            missing.append({"strategy": name, "seed": seed, "status": f"failed: {str(exc).splitlines()[0][:160]}",
                            "run_dir": str(run_dir)})
            continue
        log.info("[%s] done in %.0f s: val_acc %s, val_loss %s, %.0f samples/s", tag, time.perf_counter() - run_start,
                 summary["metrics"]["val_acc"], summary["metrics"]["val_loss"], summary["throughput"]["samples_per_s"])
        run_dirs.append(run_dir)
    meta = {"created": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(Path(__file__).resolve().parent), "command": shlex.join(["syncplane", *sys.argv[1:]]),
            "recipe": settings.recipe, "cluster": settings.cluster, "strategies": settings.strategies,
            "seeds": settings.seeds, "overrides": settings.overrides, "wandb_group": group,
            "world_size": plan[0][2]["trainer"]["devices"]}
    report = build_comparison(run_dirs, out, target_acc=settings.target_acc, target_loss=settings.target_loss,
                              missing=missing, meta=meta)
    return report


def _log_to_wandb(run_dir: Path, container: dict[str, Any], name: str, seed: int) -> None:
    """A peer's run in the comparison's W&B group: its history and summary, as measured
    (the peer's own loop cannot log: Horovod's venv has no wandb)."""
    import os

    import wandb

    logger_cfg = container.get("logger") or {}
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=logger_cfg.get("project", "syncplane"), group=logger_cfg.get("group"),
                     name=f"{name}-s{seed}", dir=str(run_dir), tags=[name, container["recipe"]["name"]],
                     settings=wandb.Settings(mode=logger_cfg.get("mode", "offline"), console="off"), reinit=True)
    try:
        history = (run_dir / "history.jsonl").read_text().splitlines()
        for line in history:
            record = json.loads(line)
            run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))
        summary = json.loads((run_dir / "summary.json").read_text())
        run.summary.update({"samples_per_s": summary["throughput"]["samples_per_s"],
                            "comm_seconds": summary["comm"]["seconds"],
                            "bytes_sent_per_rank": summary["comm"]["bytes_sent_per_rank"],
                            "train_seconds": summary["train_seconds"],
                            # where the time outside the steps went (runs of RunReport; peers have none)
                            **{f"timing/{k}": v for k, v in (summary.get("timing") or {}).items()
                               if isinstance(v, (int, float))}})
    finally:
        run.finish()


def settings_from_args(args: Any) -> CompareSettings:
    """``syncplane compare``'s parsed arguments as settings (not yet validated)."""
    return CompareSettings(
        recipe=args.recipe, strategies=parse_list(args.strategies, "--strategies"), cluster=args.cluster,
        target_acc=args.target_acc, target_loss=args.target_loss, seeds=parse_seeds(args.seeds), devices=args.devices,
        overrides=args.overrides,
        out=Path(args.out) if args.out else Path("comparisons") / f"{args.recipe}-{args.cluster or 'local'}",
        wandb=not args.no_wandb, wandb_mode=args.wandb_mode)


def dir_name(item: str) -> str:
    """A run folder's name for a comparison row: ``diloco[compression=int8]`` -> ``diloco-compression-int8``."""
    return "-".join(part for part in re.split(r"[^A-Za-z0-9_.]+", item) if part)


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in parse_list(text, "--seeds")]
    except ValueError:
        raise ConfigError(f"--seeds: comma-separated integers, got {text!r}") from None


def print_report(out: Path) -> None:
    """The markdown table on the terminal (rich), then where the files are."""
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(width=160)
    console.print(Markdown((out / "comparison.md").read_text()))
    console.print(f"comparison written to {out}/comparison.{{json,md,png}}")
