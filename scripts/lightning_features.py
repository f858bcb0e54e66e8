"""A user's own Lightning programs, written without syncplane in mind, with every syncplane
strategy: Lightning's ``BoringModel`` (its SGD and per-epoch ``StepLR``, its validate, test and
predict loaders) trained with gradient accumulation, clipping, a checkpoint callback and a
callback of the user's, then validated, tested, predicted, resumed from its checkpoint, and a
manually optimized variant, each scenario checked on every rank.

Worker (one job; every strategy named runs every scenario in turn, in the same processes)::

    python -m torch.distributed.run --nproc-per-node 2 --standalone scripts/lightning_features.py \\
        --strategies atc,diloco --out /tmp/features      # under torchrun
    python scripts/lightning_features.py --devices 2 --strategies atc --out /tmp/features   # Lightning's launcher

Each rank writes ``OUT/rank<R>.json``: ``{strategy: {scenario: "ok" or the error}}``; the job
exits 1 after the first failing scenario (its peers could not follow it into the next).

The whole matrix (every strategy, both launchers, one job per cell), written to
``docs/results/lightning/features.json``, which ``scripts/results.py`` shows in ``docs/lightning.md``
(its ``lightning_features`` block)::

    python scripts/lightning_features.py --matrix --out docs/results/lightning/features.json

The suite runs a subset (``tests/e2e/test_lightning_features.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("lightning_features")

ROOT = Path(__file__).resolve().parents[1]
#: every strategy a user can name, with Lightning's own ``ddp`` as the baseline and the planner (``auto``)
STRATEGIES = ("ddp", "atc", "awc", "h_atc", "h_awc", "ds_sync", "diloco", "flexreduce", "canary", "torch_fp16",
              "torch_powersgd", "auto")
SCENARIOS = ("fit", "evaluate", "resume", "manual", "precision")
#: the network ``auto`` plans for and the shape-reading strategies take as ``cluster=``: two slow hosts
PROFILE = {"name": "two_slow_hosts",
           "racks": [{"name": "r0", "hosts": [{"name": "h0", "nic_mbit": 5, "ranks": 1},
                                              {"name": "h1", "nic_mbit": 5, "ranks": 1}]}]}
EPOCHS, BATCHES, ACCUMULATE, CLIP = 2, 8, 2, 0.05


def make_strategy(name: str, profile: Path) -> Any:
    """The strategy as a user passes it: by name where its defaults fit a one-machine job, an
    object with the cluster's shape as an argument where the strategy reads it."""
    import syncplane
    import syncplane.strategies  # noqa: F401  (registers the names)

    if name == "auto":
        return syncplane.Auto(cluster=str(profile), accept="approximate", compute_ms=5.0, strategies="diloco,atc,ddp")
    if name == "ds_sync":
        from syncplane.strategies.ds_sync import DSSyncStrategy

        return DSSyncStrategy(cluster=str(profile))
    return name


def boring_model(manual: bool = False) -> Any:
    """Lightning's ``BoringModel``, recording the gradient norm after its clipping (Lightning's
    ``configure_gradient_clipping`` hook) so that clipping can be checked; ``manual``: the same
    model optimized by hand (``automatic_optimization = False``)."""
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.norms: list[tuple[float, float]] = []   # (before, after) clipping, each optimizer step
            self.automatic_optimization = not manual

        def grad_norm(self) -> float:
            return float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]))

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            before = self.grad_norm()
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.norms.append((before, self.grad_norm()))

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return super().training_step(batch, batch_idx)
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = self.step(batch)
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            optimizer.step()
            return loss

        def on_train_epoch_end(self) -> None:
            if not self.automatic_optimization:
                self.lr_schedulers().step()

    return Model()


class Counter:
    """A user's callback: counts the hooks Lightning calls on it."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl

        class _Counter(pl.Callback):
            def __init__(self) -> None:
                self.batches = self.validations = 0

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.batches += 1

            def on_validation_end(self, trainer, pl_module):
                if not trainer.sanity_checking:
                    self.validations += 1

        return _Counter()


def trainer(strategy: Any, devices: int, out: Path, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0, **kwargs)


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def lr(module: Any) -> float:
    return float(module.trainer.optimizers[0].param_groups[0]["lr"])


def run_strategy(name: str, devices: int, out: Path, profile: Path) -> dict[str, str]:
    """Every scenario with strategy ``name``, in order (``evaluate`` and ``resume`` use ``fit``'s
    trainer and checkpoint); the first failure ends the list (returned with the error). Also
    ``ran``: the class of the strategy that trained (``auto``'s choice)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    results: dict[str, str] = {}
    state: dict[str, Any] = {}
    ckpt_dir = out / name / "checkpoints"

    def fit() -> None:
        counter, model = Counter(), boring_model()
        fitted = trainer(make_strategy(name, profile), devices, out / name, max_epochs=EPOCHS,
                         limit_train_batches=BATCHES, limit_val_batches=2, accumulate_grad_batches=ACCUMULATE,
                         gradient_clip_val=CLIP, callbacks=[counter, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
        before = [p.detach().clone() for p in model.parameters()]
        fitted.fit(model)
        state.update(trainer=fitted, model=model)
        expect(fitted.global_step == EPOCHS * BATCHES // ACCUMULATE,
               f"{fitted.global_step} optimizer steps, not {EPOCHS * BATCHES // ACCUMULATE} (accumulation)")
        expect(counter.batches == EPOCHS * BATCHES, f"the user's callback saw {counter.batches} batches")
        expect(counter.validations == EPOCHS, f"{counter.validations} validations, not one an epoch")
        expect(len(model.norms) == fitted.global_step and max(a for _, a in model.norms) <= CLIP * 1.001
               and max(b for b, _ in model.norms) > CLIP, f"gradient norms before and after clipping: {model.norms}")
        expect(abs(lr(model) - 0.1 * 0.1 ** EPOCHS) < 1e-9, f"lr {lr(model)}: the StepLR did not step once an epoch")
        expect(any(not (a == b).all() for a, b in zip(before, model.parameters())), "the parameters did not move")
        expect((ckpt_dir / "last.ckpt").exists(), "no last.ckpt")

    def evaluate() -> None:
        fitted, model = state["trainer"], state["model"]
        for stage in ("validate", "test"):
            metrics = getattr(fitted, stage)(model, verbose=False)
            expect(isinstance(metrics, list) and len(metrics) == 1, f"{stage} returned {metrics}")
        predictions = fitted.predict(model)
        # RandomDataset(32, 64), batch 1, shared out over the ranks
        expect(len(predictions) == 64 // fitted.world_size and tuple(predictions[0].shape) == (1, 2),
               f"predict gave {len(predictions)} batches")

    def resume() -> None:
        model = boring_model()
        resumed = trainer(make_strategy(name, profile), devices, out / name, max_epochs=EPOCHS + 1,
                          limit_train_batches=BATCHES, limit_val_batches=2, accumulate_grad_batches=ACCUMULATE,
                          gradient_clip_val=CLIP, enable_checkpointing=False)
        resumed.fit(model, ckpt_path=str(ckpt_dir / "last.ckpt"))
        expect(resumed.global_step == (EPOCHS + 1) * BATCHES // ACCUMULATE,
               f"resumed to step {resumed.global_step}, not {(EPOCHS + 1) * BATCHES // ACCUMULATE}")
        expect(abs(lr(model) - 0.1 * 0.1 ** (EPOCHS + 1)) < 1e-12, f"lr {lr(model)} after resuming: the scheduler's "
               "state was not restored")

    def manual() -> None:
        model = boring_model(manual=True)
        fitted = trainer(make_strategy(name, profile), devices, out / name / "manual", max_epochs=EPOCHS,
                         limit_train_batches=BATCHES, limit_val_batches=0, enable_checkpointing=False)
        fitted.fit(model)
        expect(fitted.global_step == EPOCHS * BATCHES, f"{fitted.global_step} manual steps, not {EPOCHS * BATCHES}")
        expect(abs(lr(model) - 0.1 * 0.1 ** EPOCHS) < 1e-9, f"lr {lr(model)}: the manual scheduler step was lost")

    def precision() -> None:
        import torch

        model = boring_model()
        fitted = trainer(make_strategy(name, profile), devices, out / name / "bf16", max_epochs=1,
                         limit_train_batches=BATCHES, limit_val_batches=1, precision="bf16-mixed",
                         enable_checkpointing=False)
        fitted.fit(model)
        expect(fitted.global_step == BATCHES, f"{fitted.global_step} bf16-mixed steps, not {BATCHES}")
        expect(all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in model.parameters()),
               "bf16-mixed left non-finite or non-float32 parameters")

    steps: dict[str, Callable[[], None]] = {"fit": fit, "evaluate": evaluate, "resume": resume, "manual": manual,
                                            "precision": precision}
    for scenario in SCENARIOS:
        started = time.perf_counter()
        try:
            steps[scenario]()
        except Exception as exc:  # noqa: BLE001  (the matrix records every kind of failure)
            log.error("%s %s failed:\n%s", name, scenario, traceback.format_exc())
            results[scenario] = f"{type(exc).__name__}: {exc}"
            break
        results[scenario] = "ok"
        log.info("%s %s ok (%.1f s)", name, scenario, time.perf_counter() - started)
    if "trainer" in state:
        results["ran"] = type(state["trainer"].strategy).__name__
    return results


def worker(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    out = args.out.resolve()
    profile = out / "two_slow_hosts.yaml"
    out.mkdir(parents=True, exist_ok=True)
    profile.write_text(json.dumps(PROFILE))   # YAML is a superset of JSON
    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, dict[str, str]] = {}
    failed = False
    for name in args.strategies.split(","):
        results[name] = run_strategy(name, args.devices, out, profile)
        # the rank number is only known for certain once Lightning has launched every rank
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", rank)))
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1) + "\n")
        if any(results[name].get(scenario) != "ok" for scenario in SCENARIOS):
            failed = True
            break
    return 1 if failed else 0


def launch(launcher: str, strategies: str, out: Path, devices: int, timeout: float) -> tuple[int, float, str]:
    """One job of the worker: (exit status, seconds, output tail)."""
    script = [str(Path(__file__).resolve()), "--strategies", strategies, "--out", str(out)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices), "--standalone",
                   "--max-restarts", "0", *script]
    else:
        command = [sys.executable, *script, "--devices", str(devices)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return code, time.perf_counter() - started, output[-4000:] if isinstance(output, str) else ""


def cell(results_dir: Path, name: str, code: int, seconds: float) -> str:
    """``4/4 (21 s)``, or the scenarios that failed, from every rank's results."""
    per_rank = [json.loads(p.read_text()).get(name, {}) for p in sorted(results_dir.glob("rank*.json"))]
    bad = sorted({f"{scenario}: {ranks[scenario]}"[:120] for ranks in per_rank for scenario in SCENARIOS
                  if ranks.get(scenario, "ok") != "ok"})
    passed = min((sum(ranks.get(s) == "ok" for s in SCENARIOS) for ranks in per_rank), default=0)
    ran = {ranks.get("ran") for ranks in per_rank} - {None}
    text = f"{passed}/{len(SCENARIOS)} ({seconds:.0f} s" + (f", ran {', '.join(sorted(ran))})" if name == "auto" else ")")
    if bad or code != 0:
        text += " — " + ("; ".join(bad) or f"exit {code}")
    return text


def about(devices: int) -> str:
    """What the matrix's cells mean, for its report."""
    return (f"Lightning's `BoringModel`, {devices} CPU gloo ranks on the shared 2-core development machine, one "
            f"job per cell. Scenarios: `fit` ({EPOCHS} epochs of {BATCHES} batches, accumulation {ACCUMULATE}, "
            f"clipping to norm {CLIP}, its `StepLR`, validation each epoch, `ModelCheckpoint` and a user callback), "
            "`evaluate` (validate, test, predict), `resume` (from `last.ckpt`: steps and scheduler continue), "
            "`manual` (manual optimization with clipping and a scheduler), `precision` (an epoch in `bf16-mixed`). "
            "`ds_sync` and `auto` take a two-host profile as `cluster=`; the others are named. A cell: scenarios "
            "passed on every rank (the job's wall seconds, launch included).")


def matrix(args: argparse.Namespace) -> int:
    """Every strategy under both launchers, one job each; writes the generic results JSON."""
    from syncplane.bench.matrix import git_commit

    commit = git_commit(ROOT)   # what runs: the checkout as the matrix starts
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightning-features-") as tmp:
        for name in args.strategies.split(","):
            row = [f"`{name}`"]
            for launcher in ("torchrun", "lightning"):
                run_dir = Path(tmp) / f"{launcher}-{name}"
                run_dir.mkdir()
                code, seconds, output = launch(launcher, name, run_dir, args.devices, args.timeout)
                row.append(cell(run_dir, name, code, seconds))
                log.info("%s under %s: %s", name, launcher, row[-1])
                if code != 0:
                    log.info("%s", output)
            rows.append(row)
    data = {"title": "Lightning's features in a plain script, every strategy",
            "created": datetime.date.today().isoformat(), "commit": commit,
            "command": "python scripts/lightning_features.py --matrix --out docs/results/lightning/features.json",
            "about": about(args.devices),
            "columns": ["Trainer(strategy=)", "torchrun", "Lightning's launcher"], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0 if all(" — " not in c for row in rows for c in row[1:]) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    parser.add_argument("--out", type=Path, default=Path("lightning_features"))
    parser.add_argument("--matrix", action="store_true", help="every strategy under both launchers; --out is the JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="--matrix: seconds a job may take")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return matrix(args) if args.matrix else worker(args)


if __name__ == "__main__":
    sys.exit(main())
