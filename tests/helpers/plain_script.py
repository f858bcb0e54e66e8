"""A plain Lightning script, as a user has one (Lightning's ``BoringModel``), with a syncplane
strategy by name: ``python -m torch.distributed.run --nproc-per-node N tests/helpers/plain_script.py
--strategy atc`` (or without torchrun, ``--devices N``: Lightning's own launcher).

``--strategy auto:CLUSTER``: the planner, ``syncplane.Auto(cluster=CLUSTER)``. ``--strategy-kwargs
JSON``: the named strategy's arguments (``'{"elastic": true}'``: elastic DiLoCo, one torchrun job
per replica group). ``--report DIR``: syncplane's run report (``summary.json``, ``history.jsonl``)
in DIR. ``--step-s S``: each training step also waits S seconds (a job that lasts).

``--fault stop|kill --fault-rank R --fault-step S``: rank R stops (SIGSTOP) or dies (SIGKILL)
after step S, first writing the time (``time.time()``) to ``--mark`` -- what a test times the
job's end from; a process that torchrun restarted (``TORCHELASTIC_RESTART_COUNT``) does not fail
again and removes the mark as it starts training. ``--hold-step H --hold-file F``: from step H on,
each step waits while F exists (a survivor that waits for a restarted peer, however slow its start).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import syncplane
import syncplane.strategies  # noqa: F401  (registers the strategy names)
from syncplane.strategies.registry import strategy_class


class Pace(pl.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class Hold(pl.Callback):
    def __init__(self, step: int, file: Path, timeout_s: float = 120.0) -> None:
        self.step, self.file, self.timeout_s = step, file, timeout_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        deadline = time.monotonic() + self.timeout_s
        while trainer.global_step >= self.step and self.file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class Fault(pl.Callback):
    def __init__(self, kind: str, rank: int, step: int, mark: Path | None) -> None:
        self.kind, self.rank, self.step, self.mark = kind, rank, step, mark

    def on_train_start(self, trainer, pl_module):
        if self.mark is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            self.mark.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.mark is not None:
                self.mark.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP if self.kind == "stop" else signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="atc")
    parser.add_argument("--strategy-kwargs", type=json.loads, default={}, help="the strategy's arguments (JSON)")
    parser.add_argument("--step-s", type=float, default=0.0, help="seconds each training step also waits")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    parser.add_argument("--num-nodes", type=int, help="Trainer's num_nodes (default: torchrun's nodes, else 1)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--fault", choices=["stop", "kill"])
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--mark", type=Path)
    parser.add_argument("--hold-step", type=int)
    parser.add_argument("--hold-file", type=Path)
    parser.add_argument("--out", type=Path, default=Path("plain_run"))
    parser.add_argument("--report", type=Path)
    parser.add_argument("--accept", default="exact", help="Auto's accept: exact or approximate")
    parser.add_argument("--candidates", help="Auto's strategies to choose among (a,b; default: every one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = [Fault(args.fault, args.fault_rank, args.fault_step, args.mark)] if args.fault else []
    if args.step_s:
        callbacks.append(Pace(args.step_s))
    if args.hold_file is not None:
        callbacks.append(Hold(args.hold_step or 0, args.hold_file))
    if args.report is not None:
        callbacks.append(syncplane.RunReport(args.report, args.strategy.split(":")[0], "boring"))
    strategy = (syncplane.Auto(cluster=args.strategy.split(":", 1)[1], accept=args.accept, compute_ms=5.0,
                               strategies=args.candidates)
                if args.strategy.startswith("auto:")
                else strategy_class(args.strategy)(**args.strategy_kwargs) if args.strategy_kwargs else args.strategy)
    nodes = args.num_nodes or int(os.environ.get("GROUP_WORLD_SIZE", "1"))   # torchrun's agents
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, num_nodes=nodes,
                         max_steps=args.max_steps,
                         max_epochs=-1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=args.out)
    trainer.fit(BoringModel())
    if trainer.global_rank == 0:
        chosen = getattr(trainer.strategy, "details", {}).get("auto", {}).get("choice", {}).get("strategy")
        print(f"plain script: trained {trainer.global_step} steps with {args.strategy}"
              + (f" (Auto chose {chosen}, ran {type(trainer.strategy).__name__})" if chosen else ""))


if __name__ == "__main__":
    main()
