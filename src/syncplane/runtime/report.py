"""What a run reports: per-epoch progress lines, ``history.jsonl`` and ``summary.json``.

``summary.json`` (``docs/reference/summary.md``, generated from ``SUMMARY_FIELDS``) is the contract benchmarks and comparisons read:
``{"strategy", "recipe", "world_size", "steps", "metrics": {"val_acc", "val_loss"},
"throughput": {"samples_per_s", "step_s_median"}, "comm": {"seconds",
"bytes_sent_per_rank", "evaluation_bytes_per_rank"}, "consensus_distance"}``: the sync's
bytes, and apart from them what showing validation the replicas' average cost. Throughput counts the samples of
*every* rank (all-reduced), not rank 0's times the world size; step time is the
median over steps of the slowest rank's step.

``timing`` says where the wall time outside the training steps goes (slowest rank):
``setup_s`` (the strategy's setup: process groups, initial broadcast, its own buffers),
``before_train_s`` (resume and the sanity-check validation), and, inside
``train_seconds`` but outside the epochs' ``epoch_s`` clock, ``outside_epochs_s`` and
the parts of it that ``checkpoint_s`` (the ``checkpoints`` saves between epochs) and
``before_first_epoch_s`` take;
``phases`` is the strategy's own breakdown (``SyncplaneStrategy.phases``) when it has one.

Optional extras a recipe's LightningModule can provide (added keys, never replacing
the contract's): ``batch_tokens(batch) -> int`` adds ``throughput.tokens_per_s``;
``train_flops_per_sample() -> float`` adds ``throughput.model_flops_per_s`` and, on
GPUs whose peak Lightning knows, ``throughput.mfu`` (null on CPU); every other ``val_*``
metric it logs (a language model's ``val_perplexity``) is added to ``metrics``.

``compute`` (emulated slow compute, ``syncplane.runtime.slowdown``): every rank's profile
``compute_speeds`` (null without a cluster) and the ``slowed`` ranks, each with its slowdown
(``base`` x ``factor`` from step ``from_step``) and the seconds it waited in all, and the
emulated accelerator's ``emulated_step_s`` (0: off) with all ranks' ``emulated_steps`` and
``overran_steps`` (batches whose real compute alone exceeded their nominal time).

``compute_utilization``: the share of the training wall time a rank's accelerator computed,
for the least busy rank (its compute seconds over its wall seconds; with homogeneous ranks the
slowest rank's). Compute is the emulated accelerator's busy time where there is one
(``trainer.emulated_step_s`` x the rank's slowdown per computed batch), else each batch's
measured forward and backward (batch start to the optimizer step; for DDP on CPU that includes
its wait for the gradient all-reduce at the end of backward, so without an emulated
accelerator DDP's share is an upper bound) plus a slowed rank's wait. The wall is
``train_seconds`` less the validation passes inside it (``timing.validation_s``): evaluation is
the run's choice, not the training's cost. ``time_to_target_s``: with
``trainer.target_val_loss`` set, the training seconds (validation left out, as above; the
slowest rank's) until the first validation at or below it; null when never reached or no
target (``target_val_loss`` repeats the target). Each ``history.jsonl`` record has that clock
at its validation as ``train_s`` (rank 0's).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from syncplane.algorithms.ddp.hook import metered_allreduce
from syncplane.comm import CommMeter, PhaseProfile, mean_and_distance
from syncplane.comm.process_groups import control_group
from syncplane.runtime.slowdown import ComputeReport, skipped


#: Every field of ``summary.json``, dotted (``[]``: each item of a list; ``*``: keys that vary by
#: strategy, recipe or profile), with its meaning: the one list that ``docs/reference/summary.md``
#: is generated from (``scripts/reference_docs.py``) and that ``tests/unit/test_summary_reference.py``
#: holds against a real run's summary, so a field added here or in ``on_fit_end`` without the other fails.
SUMMARY_FIELDS: dict[str, str] = {
    "strategy": "the strategy's registered name (`ddp`, ...; a peer's name for `syncplane compare` peers)",
    "label": "how comparisons name the run: the strategy, or a variant of its settings (`NAME[key=value]`)",
    "recipe": "the recipe (`digits`, `tiny_lm`, ...; what a plain script passes to `RunReport`)",
    "seed": "the run's seed (comparisons pair each run with DDP's of the same seed); null if none given",
    "world_size": "ranks in the job",
    "steps": "optimizer steps taken (`trainer.global_step`)",
    "metrics": "the last validation, on the whole validation set, of the consensus model (the replicas' "
               "average) for strategies whose replicas differ",
    "metrics.val_acc": "validation accuracy; null when the recipe logs none",
    "metrics.val_loss": "validation loss; null when the recipe logs none",
    "metrics.*": "every other `val_*` metric the recipe logs (`tiny_lm`'s `val_perplexity`)",
    "throughput": "speed over the training wall time",
    "throughput.samples_per_s": "every rank's samples (all-reduced) over `train_seconds`",
    "throughput.step_s_median": "median over steps of the slowest rank's step, seconds",
    "throughput.tokens_per_s": "tokens per second for a recipe whose module has `batch_tokens(batch)`; else null",
    "throughput.model_flops_per_s": "model FLOP/s for a module with `train_flops_per_sample()`; else null",
    "throughput.mfu": "model FLOPs utilization on GPUs whose peak Lightning knows; null on CPU",
    "comm": "what synchronizing cost",
    "comm.seconds": "seconds this rank had communication in flight (overlaps counted once), mean over ranks",
    "comm.bytes_sent_per_rank": "bytes the algorithm sent, mean over ranks (ring all-reduce: 2(n-1)/n x payload "
                                "per step)",
    "comm.evaluation_bytes_per_rank": "bytes spent showing validation the consensus model, counted apart",
    "consensus_distance": "mean ||x_i - mean x|| / ||mean x|| over the ranks at the end (0 for DDP)",
    "train_seconds": "the slowest rank's training wall time (fit's training, validation passes included)",
    "compute_utilization": "compute seconds over wall seconds (validation left out of both) of the least busy "
                           "rank: the emulated accelerator's busy time where there is one, else the measured "
                           "forward and backward (for DDP on CPU an upper bound: it includes the all-reduce wait)",
    "target_val_loss": "`trainer.target_val_loss` repeated; null without a target",
    "time_to_target_s": "training seconds (validation left out) until the first validation loss at or below "
                        "the target; null when not reached or no target",
    "timing": "where the wall time outside the training steps went (slowest rank)",
    "timing.setup_s": "the strategy's setup before training (process groups, initial broadcast, buffers)",
    "timing.before_train_s": "resume and the sanity-check validation",
    "timing.outside_epochs_s": "inside `train_seconds` but outside the epochs' clock; null before any epoch",
    "timing.checkpoint_s": "of it, the checkpoint saves between epochs",
    "timing.checkpoints": "how many saves those were",
    "timing.before_first_epoch_s": "of it, the training clock before the first epoch",
    "timing.validation_s": "the validation passes inside `train_seconds`",
    "timing.phases": "the strategy's own breakdown (`setup/*`, `checkpoint/*`, seconds); null without one",
    "timing.phases.*": "one phase's seconds",
    "strategy_details": "what the strategy records of itself (its layout, `late_peers`, Auto's choice under "
                        "`auto`, ...); empty for Lightning's own strategies",
    "strategy_details.*": "per strategy: see its page under docs/strategies/",
    "compute": "emulated compute (`syncplane.runtime.slowdown`); null when nothing is emulated or slowed",
    "compute.compute_speeds": "every rank's profile `compute_speed`; null without a cluster profile",
    "compute.slowed": "the ranks that ran slower than nominal",
    "compute.slowed[].rank": "the slowed rank",
    "compute.slowed[].base": "its slowdown from the profile's `compute_speed` (fastest host / its host)",
    "compute.slowed[].factor": "a `slow` fault's extra factor on top of `base`",
    "compute.slowed[].from_step": "the step the fault's factor starts at",
    "compute.slowed[].waited_s": "seconds it waited in all to run slower",
    "compute.emulated_step_s": "the emulated accelerator's nominal step (`trainer.emulated_step_s`; 0: off)",
    "compute.emulated_steps": "batches the emulated accelerator ran, all ranks",
    "compute.overran_steps": "of them, batches whose real compute alone exceeded their nominal time",
}


def attach_ddp_meter(model: DistributedDataParallel) -> CommMeter:
    """Measure DDP's gradient all-reduce with a comm hook around torch's default one.

    Lightning registers DDP comm hooks only on CUDA; on CPU we register this one
    ourselves. Each bucket counts as in flight from launch to completion.
    """
    meter = CommMeter()
    model.register_comm_hook(state=None, hook=metered_allreduce(meter))
    return meter


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    raise TypeError(f"cannot infer the batch size of a {type(batch).__name__}")


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class RunReport(Callback):
    """Measures the run and writes ``history.jsonl`` (per validation) and ``summary.json``.

    The collectives in ``on_fit_end`` run on every rank; only rank 0 writes files.
    """

    def __init__(self, run_dir: str | Path, strategy_name: str, recipe_name: str, seed: int | None = None,
                 label: str | None = None, compute: ComputeReport | None = None,
                 target_val_loss: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.target_val_loss = target_val_loss
        self.label = label or strategy_name   # how comparisons name the run (a variant of its strategy)
        self.compute = compute
        self.seed = seed   # recorded so comparisons pair each run with the DDP run of the same seed
        self.strategy_name, self.recipe_name = strategy_name, recipe_name
        self.step_times: list[float] = []
        self.samples = 0
        self.tokens = 0
        self.flops_per_sample: float | None = None
        self._step_start = 0.0
        self._fit_start = 0.0
        self._train_seconds = 0.0
        self._epoch_start = 0.0
        self._setup_start: float | None = None
        self._fit_started = 0.0
        self._setup_s = 0.0
        self._before_train_s = 0.0
        self._train_end = 0.0
        self._first_epoch_start: float | None = None
        self._epoch_seconds: list[float] = []
        self.meter: CommMeter | None = None
        self.summary: dict[str, Any] | None = None
        self.measured_compute_s = 0.0   # forward and backward of every batch (batch start -> optimizer step)
        self._computed: float | None = None
        self._validation_start: float | None = None
        self.validation_s = 0.0          # the validation passes inside the training clock
        self.time_to_target_s: float | None = None

    # -------------------------------------------------------------- measuring

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._setup_start = time.perf_counter()   # right before the strategy's setup

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = time.perf_counter()
        if self._setup_start is not None:
            self._setup_s = self._fit_started - self._setup_start
        if trainer.is_global_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)   # a user's script may name a new folder
        strategy_meter = getattr(trainer.strategy, "comm_meter", None)
        if isinstance(strategy_meter, CommMeter):
            self.meter = strategy_meter
        elif isinstance(trainer.strategy.model, DistributedDataParallel):
            self.meter = attach_ddp_meter(trainer.strategy.model)
        else:
            self.meter = CommMeter()  # single process: nothing is communicated
        count_flops = getattr(pl_module, "train_flops_per_sample", None)
        self.flops_per_sample = float(count_flops()) if callable(count_flops) else None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._before_train_s = self._fit_start - self._fit_started if self._fit_started else 0.0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        if self._first_epoch_start is None:
            self._first_epoch_start = self._epoch_start

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        self._computed = None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._computed = time.perf_counter()   # forward and backward done; the step (and a sync in it) follows

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = time.perf_counter()
        self.step_times.append(end - self._step_start)
        if skipped(outputs):
            return   # not processed (a replica whose round budget is spent): no samples or tokens, no compute
        self.measured_compute_s += (self._computed if self._computed is not None else end) - self._step_start
        self.samples += _batch_size(batch)
        count_tokens = getattr(pl_module, "batch_tokens", None)
        if callable(count_tokens):
            self.tokens += int(count_tokens(batch))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_end = time.perf_counter()
        self._train_seconds = self._train_end - self._fit_start

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = None if trainer.sanity_checking else time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self.validation_s += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        epoch_s = round(time.perf_counter() - self._epoch_start, 3)
        self._epoch_seconds.append(epoch_s)
        # the training clock at this validation, earlier validations left out (this rank's)
        train_s = (None if self._validation_start is None
                   else self._validation_start - self._fit_start - self.validation_s)
        if self.time_to_target_s is None and train_s is not None and \
                reached_loss(trainer.callback_metrics.get("val_loss"), self.target_val_loss):
            self.time_to_target_s = train_s   # every rank sees the same (synchronized) loss
        if not trainer.is_global_zero:
            return
        metrics = {k: _as_float(v) for k, v in trainer.callback_metrics.items()}
        record = {"epoch": trainer.current_epoch, "step": trainer.global_step, "epoch_s": epoch_s,
                  "train_s": None if train_s is None else round(train_s, 3), **metrics}
        with open(self.run_dir / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if v is not None)
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        print(f"epoch {trainer.current_epoch + 1}/{epochs}  step {trainer.global_step}  {shown}  "
              f"({record['epoch_s']:.1f} s)", flush=True)

    # -------------------------------------------------------------- reporting

    @staticmethod
    def _consensus_distance(strategy: Any, pl_module: pl.LightningModule) -> float:
        """Over the ranks that hold the same values: a syncplane strategy's own parameters (its
        shards under FSDP2) over its consensus group; else every rank's whole parameters."""
        if hasattr(strategy, "consensus_group"):
            return mean_and_distance(strategy.model_parameters(), strategy.consensus_group())
        return mean_and_distance([p.detach() for p in pl_module.parameters()])

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        world = trainer.world_size
        distributed = dist.is_available() and dist.is_initialized() and world > 1
        assert self.meter is not None
        evaluation = getattr(trainer.strategy, "evaluation_meter", None)
        totals = torch.tensor([float(self.samples), self.meter.seconds, float(self.meter.bytes_sent),
                               float(self.tokens),
                               float(evaluation.bytes_sent) if isinstance(evaluation, CommMeter) else 0.0],
                              dtype=torch.float64)
        saves = self._checkpoint_saves(trainer)
        # the slowest rank's: training wall time, setup, before training, checkpoint saves,
        # training clock before the first epoch
        before_first_epoch = (self._first_epoch_start or self._fit_start) - self._fit_start
        timings = torch.tensor([self._train_seconds, self._setup_s, self._before_train_s,
                                sum(seconds for _, seconds in saves), before_first_epoch, self.validation_s,
                                -1.0 if self.time_to_target_s is None else self.time_to_target_s,
                                -self._utilization()], dtype=torch.float64)   # negated: MAX gives the least busy
        steps = torch.tensor(self.step_times, dtype=torch.float64)
        waited = torch.tensor(self.compute.waits(world) if self.compute is not None else [0.0], dtype=torch.float64)
        if distributed:
            dist.all_reduce(totals, group=control_group())   # CPU tensors: never the NCCL group
            dist.all_reduce(waited, group=control_group())
            dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=control_group())
            # ranks normally run equally many steps (DistributedSampler pads the shards);
            # agree on the common prefix anyway so the all-reduce below cannot mismatch
            common = torch.tensor([len(steps)], dtype=torch.int64)
            dist.all_reduce(common, op=dist.ReduceOp.MIN, group=control_group())
            steps = steps[: int(common.item())].contiguous()
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=control_group())
        distance = self._consensus_distance(trainer.strategy, pl_module) if distributed else 0.0
        metrics = trainer.callback_metrics
        (train_seconds, setup_s, before_train_s, checkpoint_s, before_first_epoch_s, validation_s, to_target_s,
         idle) = timings.tolist()
        seconds = max(train_seconds, 1e-9)
        phases = getattr(trainer.strategy, "phases", None)
        counts_tokens = callable(getattr(pl_module, "batch_tokens", None))
        flops_per_s = None if self.flops_per_sample is None else float(totals[0]) * self.flops_per_sample / seconds
        self.summary = {
            "strategy": self.strategy_name,
            "label": self.label,
            "recipe": self.recipe_name,
            "seed": self.seed,
            "world_size": world,
            "steps": trainer.global_step,
            "metrics": validation_metrics(metrics),
            "throughput": {
                "samples_per_s": float(totals[0] / seconds),
                "step_s_median": statistics.median(steps.tolist()) if len(steps) else None,
                "tokens_per_s": float(totals[3] / seconds) if counts_tokens else None,
                "model_flops_per_s": flops_per_s,
                "mfu": _mfu(trainer, flops_per_s),
            },
            # the sync's bytes; the consensus model shown to validation is counted apart
            "comm": {"seconds": float(totals[1] / world), "bytes_sent_per_rank": float(totals[2] / world),
                     "evaluation_bytes_per_rank": float(totals[4] / world)},
            "consensus_distance": distance,
            "train_seconds": train_seconds,
            "compute_utilization": -idle,
            "target_val_loss": self.target_val_loss,
            "time_to_target_s": to_target_s if to_target_s >= 0 else None,
            "timing": {
                "setup_s": setup_s, "before_train_s": before_train_s,
                "outside_epochs_s": max(train_seconds - sum(self._epoch_seconds), 0.0)
                if self._epoch_seconds else None,
                "checkpoint_s": checkpoint_s, "checkpoints": len(saves), "before_first_epoch_s": before_first_epoch_s,
                "validation_s": validation_s,
                "phases": phases.as_dict() if isinstance(phases, PhaseProfile) else None,
            },
            "strategy_details": dict(getattr(trainer.strategy, "details", {})),
            "compute": self.compute.as_dict(waited.tolist()) if self.compute is not None else None,
        }
        if trainer.is_global_zero:
            path = self.run_dir / "summary.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
            tmp.replace(path)
            print_summary(self.summary, path)


    def _utilization(self) -> float:
        """This rank's compute seconds over its wall seconds (the module docstring), in [0, 1]."""
        wall = self._train_seconds - self.validation_s
        compute = (self.compute.compute_seconds(self.measured_compute_s) if self.compute is not None
                   else self.measured_compute_s)
        return min(max(compute / wall, 0.0), 1.0) if wall > 0 else 0.0

    def _checkpoint_saves(self, trainer: pl.Trainer) -> list[tuple[float, float]]:
        """(start, seconds) of the checkpoint saves inside the training clock (this rank):
        every checkpoint callback that times its saves (``LastCheckpoint.saves``)."""
        return [(start, seconds) for callback in trainer.checkpoint_callbacks
                for start, seconds in getattr(callback, "saves", ())
                if self._fit_start <= start < self._train_end]


def reached_loss(logged: Any, target: float | None) -> bool:
    """Whether a logged validation loss is at or below ``target`` (False without either)."""
    value = _as_float(logged)
    return target is not None and value is not None and value <= target


def validation_metrics(logged: Any) -> dict[str, float | None]:
    """The contract's ``val_acc`` and ``val_loss`` (None when not logged), then every other
    ``val_*`` metric the recipe logs (``tiny_lm``'s ``val_perplexity``)."""
    metrics = {"val_acc": _as_float(logged.get("val_acc")), "val_loss": _as_float(logged.get("val_loss"))}
    metrics.update({k: _as_float(v) for k, v in sorted(logged.items()) if k.startswith("val_") and k not in metrics})
    return metrics


def _mfu(trainer: pl.Trainer, flops_per_s: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of every device.

    GPU only (a CPU has no meaningful tensor-core peak) and only for chips whose peak
    Lightning's table knows, at the compute dtype the precision setting implies.
    """
    from lightning.fabric.utilities.throughput import get_available_flops

    device = trainer.strategy.root_device
    if flops_per_s is None or device.type != "cuda":
        return None
    precision = str(trainer.precision)
    dtype = (torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16")
             else torch.float64 if precision.startswith("64") else torch.float32)
    peak = get_available_flops(device, dtype)
    return None if not peak else flops_per_s / (peak * trainer.world_size)


def auto_line(auto: dict[str, Any]) -> str:
    """What ``strategy=auto`` ran, in a line: its choice, then each re-planned switch."""
    line = f"chose {auto['choice']['label']}"
    for replan in auto.get("replans", []):
        line += f", {replan['best']['label']} from step {replan['step']}"
    return line


def print_summary(summary: dict[str, Any], path: Path) -> None:
    """A rich table of the run's headline numbers, then where the full record is."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = Table(title=f"syncplane run: {summary['strategy']} on {summary['recipe']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    auto = (summary.get("strategy_details") or {}).get("auto")
    rows = [
        *([("strategy=auto", auto_line(auto))] if auto else []),
        ("world size", str(summary["world_size"])),
        ("optimizer steps", str(summary["steps"])),
        ("val accuracy", fmt(summary["metrics"]["val_acc"], ".4f")),
        ("val loss", fmt(summary["metrics"]["val_loss"], ".4f")),
        *([("val perplexity", fmt(summary["metrics"]["val_perplexity"], ",.2f"))]
          if summary["metrics"].get("val_perplexity") is not None else []),
        ("samples/s (all ranks)", fmt(summary["throughput"]["samples_per_s"], ",.1f")),
        ("step time, median (s)", fmt(summary["throughput"]["step_s_median"], ".4f")),
        *([("tokens/s (all ranks)", fmt(summary["throughput"]["tokens_per_s"], ",.0f"))]
          if summary["throughput"].get("tokens_per_s") is not None else []),
        *([("model TFLOP/s (all ranks)", fmt(summary["throughput"]["model_flops_per_s"] / 1e12, ".4f"))]
          if summary["throughput"].get("model_flops_per_s") is not None else []),
        *([("MFU", fmt(summary["throughput"]["mfu"], ".3f"))] if summary["throughput"].get("mfu") is not None else []),
        ("comm time per rank (s)", fmt(summary["comm"]["seconds"], ".3f")),
        ("bytes sent per rank", fmt(summary["comm"]["bytes_sent_per_rank"], ",.0f")),
        ("consensus distance", fmt(summary["consensus_distance"], ".2e")),
        *((f"slowed rank {slow['rank']} (x, waited s)", f"{slow['base'] * slow['factor']:.2f}, {slow['waited_s']:.1f}")
          for slow in (summary.get("compute") or {}).get("slowed", [])),
        ("training wall time (s)", fmt(summary["train_seconds"], ".1f")),
        ("compute utilization", fmt(summary.get("compute_utilization"), ".3f")),
        *([(f"time to val loss {summary['target_val_loss']:g} (s)", fmt(summary.get("time_to_target_s"), ".1f"))]
          if summary.get("target_val_loss") is not None else []),
        ("  of which checkpoints (s)", fmt(summary["timing"]["checkpoint_s"], ".1f")),
        ("setup before training (s)", fmt(summary["timing"]["setup_s"], ".1f")),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console(width=100)
    console.print(table)
    console.print(f"summary written to {path}", soft_wrap=True)   # a long path stays one line to copy
