"""The headline of issue 78: ``tiny_lm`` across a slow WAN of nodes (``cluster=wan_nodes``), every
row timed end to end on the emulated link with an emulated accelerator step, one command:

    python scripts/lm_wan.py                      # every row, 1 seed each (make lm-headline)
    python scripts/lm_wan.py --seeds 1 --seeds-for ddp=3,diloco_sparse3_overlap=3
    python scripts/lm_wan.py --quick --rows ddp,diloco_fp32_blocking   # a short check (minutes)
    python scripts/lm_wan.py --size small --rows diloco_muon_h100,ddp --muon-codec int8 --priced-steps 0 \
        --emulated-step-s 0                       # the scale trend (about 1.5 hours here)

Rows: ``ddp`` over all ranks; DiLoCo with one replica per site (``replica=node``, DDP inside):
fp32 blocking, then fp32, int8 and sparse at two densities with their exchange overlapped
(``overlap_steps``); the best codec again with a Muon inner optimizer (``recipe.optimizer=muon``;
the best is the finished codec row with the fewest bytes within 3 % of DDP's loss, else the
lowest loss, or ``--muon-codec``); ``torchft_diloco`` as the peer where it can run this recipe
(otherwise the row says why); ``ddp_muon``, DDP with the same Muon inner optimizer, so each
inner optimizer is judged against DDP with it (priced with ``ddp``'s step time on the link, which
sends the same gradients). The outer optimizer is the strategy's default, the paper's
Nesterov (lr 0.7, momentum 0.9).

``ddp`` is priced, not run to the end on the link (its full run there would take hours): its
loss, bytes and steps to the target come from the same training on loopback, its step time and
compute utilization from ``--priced-steps`` steps timed on the link; ``wall_s`` and
``time_to_target_s`` are those steps times that step time, and the row says so (``priced``).

H (``--sync-every``) is the same for every DiLoCo row; each row reports its measured sync seconds
per round and ``h_for_90pct``, the smallest H whose blocking rounds would leave compute 90 % of
the time (9 x the round's sync / the emulated step): the measurement to choose H from.

Resumable: each run has its own folder under ``--runs`` named by its row, seed and a hash of its
command; a folder with a ``summary.json`` is read, not run again, and the JSON is rewritten after
every run. A seed the JSON at ``--out`` already holds for the same command (and a priced row's
timing of the same command) is kept rather than run again, so a run continues from the committed
JSON on another checkout, where the run folders are gone (``--fresh`` ignores it). A row the current code refuses (a configuration error) is recorded as ``refused``
with the message, a failed run as ``failed`` with its log's tail; neither stops the others.
Writes ``--out`` (default ``docs/results/lm_wan.json``; ``--quick``: under ``outputs/``) with per
row ``name``, ``command`` (the ``python train.py`` command, from the repository root, of its
first seed), ``seeds`` (``seed``, ``val_loss``, ``bytes_per_rank``, ``wall_s``,
``time_to_target_s``, ``compute_utilization``; wall and time to target without the validations,
whose seconds are ``validation_s``), and beside it two charts: val loss against bytes
per rank (``*_bytes.png``) and against wall time (``*_wall.png``).

The scale trend (``--size small``, into ``docs/results/lm_wan_small.json``): the same rows with
``recipe.size=small`` (~8.8 M parameters). There ``--priced-steps 0`` leaves ``ddp`` unpriced (loss
and bytes only: one of its steps would take minutes on the link) and ``--emulated-step-s 0`` runs
the real CPU compute (a step of 4 ranks on this machine's 2 cores takes longer than the
emulated one), so such a file compares loss and bytes, and its times are this machine's, not an
accelerator's (no charts are drawn for it). ``--outer-lrs 0.4,0.7,1,1.4`` runs the chosen DiLoCo rows
with the outer Nesterov at each lr (into ``lm_wan_outer.json``): the loss does not depend on the
clock, so the tuning runs on the real compute too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("lm_wan")

PARITY = 0.03   # "within 3 % of DDP's loss": what makes a codec row a candidate for the best


@dataclass(frozen=True)
class Row:
    """One row of the table: its ``train.py`` overrides beyond the common ones."""

    name: str
    overrides: tuple[str, ...] = ()
    priced: bool = False          # ddp: loss on loopback, step time on the link
    peer: str | None = None       # a comparison peer (not a train.py strategy)
    muon: bool = False            # the best codec again, with recipe.optimizer=muon
    priced_as: str | None = None  # a priced row that takes its step time from this row's timing
    sync_every: int | None = None  # the row's own H (default: the run's)
    outer_lr: float | None = None  # the outer Nesterov's lr (default: the strategy's, the paper's 0.7)

    def with_outer_lr(self, lr: float) -> Row:
        """This row with the outer step at ``lr`` (momentum 0.9, Nesterov), named ``NAME_outer_lrLR``."""
        return dataclasses.replace(self, name=f"{self.name}_outer_lr{lr:g}", outer_lr=lr)

    @property
    def overlapped(self) -> bool:
        return "_overlap" in self.name or self.muon


def node_diloco(*extra: str) -> tuple[str, ...]:
    return ("strategy=diloco", "strategy.kwargs.replica=node", *extra)


CODECS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "int8": ("strategy.kwargs.compression=int8",),
    "sparse1": ("strategy.kwargs.compression=sparse", "strategy.kwargs.density=0.01"),
    "sparse3": ("strategy.kwargs.compression=sparse", "strategy.kwargs.density=0.03"),
}

ROWS: tuple[Row, ...] = (
    Row("ddp", ("strategy=ddp",), priced=True),
    Row("diloco_fp32_blocking", node_diloco()),
    *(Row(f"diloco_{codec}_overlap", node_diloco(*flags)) for codec, flags in CODECS.items()),
    Row("diloco_muon", node_diloco(), muon=True),
    # H doubled: half the bytes; Muon's loss at H = 50 was below DDP's, leaving room under the 3 % bar
    Row("diloco_muon_h100", node_diloco(), muon=True, sync_every=100),
    Row("ddp_muon", ("strategy=ddp", "recipe.optimizer=muon"), priced=True, priced_as="ddp"),
    Row("torchft_diloco", peer="torchft_diloco"),
)


@dataclass
class Settings:
    """The run's shape: what every row shares."""

    epochs: int = 6
    sync_every: int = 50
    overlap_steps: int = 8
    emulated_step_s: float = 2.5
    target_loss: float = 4.85
    priced_steps: int = 50
    cluster: str = "wan_nodes"
    devices: int = 4
    size: str = "tiny"            # recipe.size (named in the commands only when not the default)
    varied: str = ""              # what the rows vary, for the title (``--outer-lrs``: the outer lr)
    extra: tuple[str, ...] = ()   # further overrides for every row (--quick's smaller corpus)

    def common(self, seed: int, name: str) -> list[str]:
        return ["recipe=tiny_lm", f"trainer.devices={self.devices}", f"trainer.max_epochs={self.epochs}",
                f"trainer.target_val_loss={self.target_loss:g}", f"seed={seed}", f"label={name}",
                *([f"recipe.size={self.size}"] if self.size != "tiny" else []), *self.extra]

    def on_link(self) -> list[str]:
        """The link's overrides; an emulated step of 0 leaves the compute real."""
        return [f"cluster={self.cluster}",
                *([f"trainer.emulated_step_s={self.emulated_step_s:g}"] if self.emulated_step_s else [])]


QUICK = dict(epochs=1, sync_every=5, overlap_steps=2, priced_steps=5,
             extra=("recipe.train_mb=0.3", "recipe.val_mb=0.05"))


@dataclass
class RunResult:
    returncode: int
    log_tail: str


#: runs ``python train.py OVERRIDES`` with its outputs in the folder; the test's fake writes them itself
Runner = Callable[[list[str], Path], RunResult]


def train_py_runner(overrides: list[str], run_dir: Path) -> RunResult:
    """``python train.py`` in a subprocess from the repository root, its output in ``run.log``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ}
    env.setdefault("SYNCPLANE_EMULATOR_PREFIX", "lmwan-")
    with open(run_dir / "run.log", "w") as out:
        rc = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    lines = (run_dir / "run.log").read_text(errors="replace").splitlines()
    return RunResult(rc, "\n".join(lines[-15:]))


def command_of(overrides: Sequence[str]) -> str:
    return "python train.py " + shlex.join(overrides)


def run_dir_for(runs: Path, name: str, seed: int, overrides: Sequence[str]) -> Path:
    digest = hashlib.sha1(command_of(overrides).encode()).hexdigest()[:8]
    return runs / f"{name}-s{seed}-{digest}"


def refusal(tail: str) -> str | None:
    """The configuration error a refused run printed (``invalid configuration: ...``), if any."""
    for line in reversed(tail.splitlines()):
        if "invalid configuration" in line:
            return line.split("invalid configuration:", 1)[-1].strip()
    return None


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    history_path = run_dir / "history.jsonl"
    history = [json.loads(line) for line in history_path.read_text().splitlines()] if history_path.exists() else []
    return summary, history


def seed_entry(seed: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON's per-seed record of a run timed end to end: its wall is the training's, the
    validations left out (as ``time_to_target_s`` and a priced row's; they are ``validation_s``)."""
    validation_s = float((summary.get("timing") or {}).get("validation_s") or 0.0)
    return {"seed": seed, "val_loss": summary["metrics"]["val_loss"],
            "bytes_per_rank": summary["comm"]["bytes_sent_per_rank"],
            "wall_s": summary["train_seconds"] - validation_s, "validation_s": validation_s,
            "time_to_target_s": summary.get("time_to_target_s"),
            "compute_utilization": summary.get("compute_utilization"), "steps": summary["steps"],
            "overran_steps": (summary.get("compute") or {}).get("overran_steps")}


def steps_to_target(history: Sequence[Mapping[str, Any]], target: float) -> int | None:
    return next((int(r["step"]) for r in history if r.get("val_loss") is not None and r["val_loss"] <= target), None)


def priced_entry(seed: int, summary: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                 step_s: float | None, utilization: float | None, target: float) -> dict[str, Any]:
    """A priced row's seed: loss and bytes of its loopback run, times its steps x the link's step
    (no times when the row was not timed on the link: ``step_s`` None)."""
    reached = steps_to_target(history, target)
    return {**seed_entry(seed, summary), "wall_s": None if step_s is None else summary["steps"] * step_s,
            "time_to_target_s": None if reached is None or step_s is None else reached * step_s,
            "compute_utilization": utilization,
            "loopback_wall_s": summary["train_seconds"]}


def best_codec(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The finished codec row (``diloco_<codec>_overlap``) with the fewest bytes within ``PARITY``
    of DDP's mean loss, else the one with the lowest loss; None when none has finished."""
    def mean(row: Mapping[str, Any], key: str) -> float:
        return statistics.fmean(s[key] for s in row["seeds"])

    ddp = next((r for r in rows if r["name"] == "ddp" and r["seeds"]), None)
    done = [r for r in rows if r["name"].endswith("_overlap") and r["seeds"]]
    if not done:
        return None
    close = [r for r in done if ddp is not None and mean(r, "val_loss") <= (1 + PARITY) * mean(ddp, "val_loss")]
    best = (min(close, key=lambda r: mean(r, "bytes_per_rank")) if close
            else min(done, key=lambda r: mean(r, "val_loss")))
    return best["name"].removeprefix("diloco_").removesuffix("_overlap")


def row_overrides(row: Row, settings: Settings, codec: str | None) -> list[str]:
    """The row's own overrides: H, τ for the overlapped rows, the codec of the Muon row."""
    extra = list(row.overrides)
    if row.overrides[:1] == ("strategy=diloco",):
        extra.append(f"strategy.kwargs.sync_every={row.sync_every or settings.sync_every}")
        if row.overlapped:
            extra.append(f"strategy.kwargs.overlap_steps={settings.overlap_steps}")
        if row.outer_lr is not None:
            extra.append(f"strategy.kwargs.outer_kwargs={{lr:{row.outer_lr:g},momentum:0.9,nesterov:true}}")
    if row.muon:
        extra += [*CODECS[codec or "fp32"], "recipe.optimizer=muon"]
    return extra


def peer_refusal(peer: str, overrides: list[str]) -> str | None:
    """Why ``peer`` cannot train this job (its own checks, before anything runs); None if it can."""
    import tempfile

    from syncplane.config import ConfigError
    from syncplane.experiments.comparison import compose_job
    from syncplane.experiments.peers import BASE_STRATEGY, export, unavailable_reason

    reason = unavailable_reason(peer)
    if reason is not None:
        return reason
    try:
        container = compose_job([f"strategy={BASE_STRATEGY[peer]}", *overrides], f"the {peer} peer")
        with tempfile.TemporaryDirectory() as tmp:
            export(container, peer, Path(tmp))
    except ConfigError as exc:
        return str(exc)
    return None


@dataclass
class Headline:
    """Runs the rows and keeps the JSON up to date; ``runner`` trains one job."""

    settings: Settings
    runs: Path
    out: Path
    runner: Runner = train_py_runner
    muon_codec: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    previous: Mapping[str, Any] = field(default_factory=dict)   # the JSON at ``out`` before this run
    started: float = field(default_factory=time.monotonic)
    durations: list[float] = field(default_factory=list)

    def run(self, chosen: Sequence[Row], seeds: Mapping[str, int]) -> dict[str, Any]:
        timed = [r for r in chosen if r.priced and r.priced_as is None and self.settings.priced_steps]
        total = sum(seeds[r.name] for r in chosen if r.peer is None) + len(timed)
        self.done = 0
        for row in chosen:
            self.rows.append(self.run_row(row, seeds[row.name], total))
            self.write()
        return self.report()

    def progress(self, what: str, total: int) -> None:
        eta = ""
        if self.durations:
            eta = f", about {statistics.fmean(self.durations) * (total - self.done) / 60:.0f} min left"
        log.info("[%d/%d] %s (%.0f min so far%s)", self.done + 1, total, what,
                 (time.monotonic() - self.started) / 60, eta)

    def train(self, name: str, seed: int, overrides: list[str], total: int) -> tuple[Path, RunResult | None]:
        """One run (or the folder of an earlier one that finished): its folder and result."""
        run_dir = run_dir_for(self.runs, name, seed, overrides)
        if (run_dir / "summary.json").exists():
            log.info("%s seed %d: done before, read from %s", name, seed, run_dir)
            self.done += 1
            return run_dir, None
        self.progress(f"{name} seed {seed}: {command_of(overrides)}", total)
        start = time.monotonic()
        result = self.runner(overrides, run_dir)
        self.durations.append(time.monotonic() - start)
        self.done += 1
        log.info("%s seed %d: exit %d after %.0f s", name, seed, result.returncode, self.durations[-1])
        return run_dir, result

    def run_row(self, row: Row, n_seeds: int, total: int) -> dict[str, Any]:
        s = self.settings
        if row.peer is not None:
            common = [*s.common(1, row.name), *s.on_link()]
            reason = peer_refusal(row.peer, common)
            why = reason or "the peer runs through `syncplane compare --strategies torchft_diloco`, not train.py"
            log.info("%s: not run: %s", row.name, why)
            return {"name": row.name, "command": None, "status": "refused" if reason else "not_run",
                    "message": why, "seeds": []}
        codec = (self.muon_codec or best_codec(self.report()["rows"]) or "fp32") if row.muon else None
        own = row_overrides(row, s, codec)
        out: dict[str, Any] = {"name": row.name, "status": "ok", "seeds": [], **({"codec": codec} if codec else {}),
                               **({"sync_every": row.sync_every} if row.sync_every else {})}
        step_s = utilization = None   # a priced row's step on the link, and its compute utilization there
        before = next((r for r in self.previous.get("rows", []) if r["name"] == row.name), {})
        first = command_of([*s.common(1, row.name), *own, *([] if row.priced else s.on_link())])
        kept = {e["seed"]: e for e in before.get("seeds", [])} if before.get("command") == first else {}
        if row.priced_as is not None:
            source = next((r for r in self.known_rows() if r["name"] == row.priced_as and "priced" in r), None)
            if source is None:
                return {**out, "status": "failed", "message": f"priced with {row.priced_as}'s step time: run "
                        f"{row.priced_as} first (--rows {row.priced_as},{row.name})"}
            out["priced"] = {**source["priced"], "note": f"step time from {row.priced_as}'s timing, which sends the "
                             "same gradients over the same link; loss, bytes and steps from its own training on "
                             "loopback"}
        elif row.priced and not s.priced_steps:
            out["priced"] = {"steps_timed": 0, "step_s": None, "utilization": None,
                             "note": "loss, bytes and steps from its training on loopback; not timed on the link "
                                     "(--priced-steps 0), so no wall or time to target"}
        elif row.priced:
            timing = [*s.common(1, row.name), *own, *s.on_link(), f"trainer.max_steps={s.priced_steps}"]
            if (before.get("priced") or {}).get("timing_command") == command_of(timing):
                out["priced"] = dict(before["priced"])
                self.done += 1
                log.info("%s: its timing kept from %s", row.name, self.out)
            else:
                run_dir, result = self.train(f"{row.name}-timing", 1, timing, total)
                if not (run_dir / "summary.json").exists():
                    return self.failed(out, result)
                summary, _ = read_run(run_dir)
                out["priced"] = {"steps_timed": summary["steps"], "step_s": summary["throughput"]["step_s_median"],
                                 "utilization": summary.get("compute_utilization"),
                                 "timing_command": command_of(timing),
                                 "note": "loss, bytes and steps from the same training on loopback; wall and time "
                                         "to target are its steps times the step time on the link"}
        if "priced" in out:
            step_s, utilization = out["priced"]["step_s"], out["priced"].get("utilization")
        for seed in range(1, n_seeds + 1):
            overrides = [*s.common(seed, row.name), *own, *([] if row.priced else s.on_link())]
            out.setdefault("command", command_of(overrides))
            if seed in kept:
                out["seeds"].append(kept[seed])
                self.done += 1
                log.info("%s seed %d: kept from %s", row.name, seed, self.out)
                continue
            run_dir, result = self.train(row.name, seed, overrides, total)
            if not (run_dir / "summary.json").exists():
                return self.failed(out, result)
            summary, history = read_run(run_dir)
            if row.priced:
                out["seeds"].append(priced_entry(seed, summary, history, step_s, utilization, s.target_loss))
            else:
                out["seeds"].append({**seed_entry(seed, summary),
                                     **self.round_costs(summary, row.sync_every or s.sync_every)})
        return out

    def round_costs(self, summary: Mapping[str, Any], sync_every: int) -> dict[str, Any]:
        """A DiLoCo run's sync seconds per round (of ``sync_every`` steps) and the H that would keep
        compute at 90 %."""
        if summary["strategy"] != "diloco" or not summary["steps"]:
            return {}
        rounds = max(1, summary["steps"] // sync_every)
        per_round = summary["comm"]["seconds"] / rounds
        step_s = self.settings.emulated_step_s
        return {"sync_s_per_round": per_round,
                **({"h_for_90pct": max(1, math.ceil(9 * per_round / step_s))} if step_s else {})}

    @staticmethod
    def failed(out: dict[str, Any], result: RunResult | None) -> dict[str, Any]:
        tail = result.log_tail if result is not None else ""
        message = refusal(tail)
        out.update(status="refused" if message else "failed", message=message or tail)
        log.warning("%s: %s: %s", out["name"], out["status"], out["message"])
        return out

    def known_rows(self) -> list[dict[str, Any]]:
        """This run's rows, and the rows of the JSON before it that this run did not choose, when
        it was made with the same settings (a table grows a row at a time), in the table's order."""
        rows = list(self.rows)
        if self.previous.get("settings") == self.settings_dict():
            ran = {r["name"] for r in rows}
            rows += [r for r in self.previous["rows"] if r["name"] not in ran]
        order = [r.name for r in ROWS]
        return sorted(rows, key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))

    def report(self) -> dict[str, Any]:
        """The JSON: the known rows (``known_rows``) and how they were made."""
        s = self.settings
        rows = self.known_rows()
        size = "" if s.size == "tiny" else f" size={s.size}"
        compute = (f"every batch an emulated accelerator step of {s.emulated_step_s:g} s" if s.emulated_step_s
                   else "every batch computed on this machine's CPUs (no emulated step)")
        ddp = ("" if not any(r["name"] == "ddp" for r in rows) else "; `ddp` priced (its `priced` entry)"
               if s.priced_steps else "; `ddp` trained on loopback for its loss and bytes, not timed on the link")
        varied = f": {s.varied}" if s.varied else ""
        return {"title": f"A language model across a slow WAN of nodes (`tiny_lm`{size}, `{s.cluster}`){varied}",
                "created": datetime.date.today().isoformat(), "commit": git_commit(),
                "command": "python scripts/lm_wan.py " + shlex.join(sys.argv[1:]),
                "about": (f"`tiny_lm`{size} on {s.devices} ranks of `{s.cluster}` (2 sites of one 2-rank host, a slow "
                          f"site link), {compute}, "
                          f"{s.epochs} epochs, DiLoCo H = {s.sync_every} where a row names no other (`rows[].sync_every`; "
                          f"overlap τ = {s.overlap_steps}), "
                          f"target val loss {s.target_loss:g}. "
                          + (f"Every DiLoCo row timed end to end on the link{ddp}." if s.emulated_step_s else
                             "Loss and bytes only: the times are this machine's CPUs', not an accelerator's, so the "
                             f"table leaves them out{ddp}.")),
                "settings": self.settings_dict(), "rows": rows}

    def settings_dict(self) -> dict[str, Any]:
        s = self.settings
        return {"epochs": s.epochs, "sync_every": s.sync_every, "overlap_steps": s.overlap_steps,
                "emulated_step_s": s.emulated_step_s, "target_val_loss": s.target_loss,
                "priced_steps": s.priced_steps, "cluster": s.cluster, "extra": list(s.extra),
                **({"size": s.size} if s.size != "tiny" else {}), **({"varied": s.varied} if s.varied else {})}

    def write(self) -> None:
        report = self.report()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(self.out)
        if self.settings.emulated_step_s:   # real CPU compute: its wall times are not the charts' story
            charts(report, self.out)


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def chart_paths(out: Path) -> tuple[Path, Path]:
    """Where :func:`charts` writes, beside the JSON ``out``: val loss against bytes, against wall."""
    return out.with_name(f"{out.stem}_bytes.png"), out.with_name(f"{out.stem}_wall.png")


def charts(report: Mapping[str, Any], out: Path) -> list[Path]:
    """Val loss against bytes per rank and against wall time, one point per row (its seeds'
    mean, their range as bars), log x; at :func:`chart_paths` of ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["seeds"]]
    written = []
    for (key, label), path in zip((("bytes_per_rank", "sync bytes per rank"), ("wall_s", "wall time (s)")),
                                  chart_paths(out)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for row in rows:
            timed = [s for s in row["seeds"] if s.get(key) is not None]   # an untimed row has no wall
            if not timed:
                continue
            xs, ys = [s[key] for s in timed], [s["val_loss"] for s in timed]
            x, y = statistics.fmean(xs), statistics.fmean(ys)
            ax.errorbar([x], [y], xerr=[[x - min(xs)], [max(xs) - x]], yerr=[[y - min(ys)], [max(ys) - y]],
                        fmt="o", capsize=3, label=row["name"] + (" (priced)" if "priced" in row else ""))
        if rows:
            ax.set_xscale("log")
            ax.legend(fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("final validation loss")
        ax.set_title(f"tiny_lm on {report['settings']['cluster']}: val loss vs {label}", fontsize=9)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def parse_seeds_for(text: str, names: Sequence[str]) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        if name not in names or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--seeds-for: NAME=N with NAME one of {', '.join(names)} and N >= 1, got {item!r}")
        out[name] = int(count)
    return out


def main(argv: list[str] | None = None, runner: Runner = train_py_runner) -> int:
    names = [r.name for r in ROWS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(names),
                        help=f"comma-separated, run in this order (the table keeps its own), of: {', '.join(names)}")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1..N for every row")
    parser.add_argument("--seeds-for", default="", help="NAME=N,...: another count for some rows")
    parser.add_argument("--quick", action="store_true",
                        help="a short check: 1 epoch of 0.3 MB, H 5, τ 2, ddp priced over 5 steps")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--sync-every", type=int, help="DiLoCo's H for every DiLoCo row")
    parser.add_argument("--overlap-steps", type=int, help="τ of the overlapped rows")
    parser.add_argument("--emulated-step-s", type=float, help="the emulated accelerator step (0: real compute)")
    parser.add_argument("--target-loss", type=float)
    parser.add_argument("--priced-steps", type=int,
                        help="ddp's steps timed on the link (the issue: >= 50; 0: not timed, loss and bytes only)")
    parser.add_argument("--size", choices=("tiny", "small", "base"), default="tiny",
                        help="recipe.size of every row (not tiny: the JSON and runs are named by it)")
    parser.add_argument("--outer-lrs", default="",
                        help="LR,...: the chosen DiLoCo rows at these outer lrs instead (rows NAME_outer_lrLR; "
                             "the JSON and runs named lm_wan_outer)")
    parser.add_argument("--muon-codec", choices=sorted(CODECS), help="the Muon row's codec (default: the best)")
    parser.add_argument("--runs", type=Path, help="run folders (default outputs/lm_wan[_quick])")
    parser.add_argument("--out", type=Path, help="the JSON (default docs/results/lm_wan.json; --quick: outputs/)")
    parser.add_argument("--fresh", action="store_true", help="run every seed again, ignoring what --out holds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    by_name = {r.name: r for r in ROWS}
    chosen = [by_name[n] for n in dict.fromkeys(args.rows.split(",")) if n in by_name]   # in --rows' order
    unknown = set(args.rows.split(",")) - set(names)
    if unknown or not chosen:
        parser.error(f"--rows: unknown {sorted(unknown)}; allowed: {', '.join(names)}")
    try:
        outer_lrs = [float(lr) for lr in filter(None, args.outer_lrs.split(","))]
    except ValueError:
        parser.error(f"--outer-lrs: numbers separated by commas, got {args.outer_lrs!r}")
    if outer_lrs:
        chosen = [row.with_outer_lr(lr) for row in chosen if row.overrides[:1] == ("strategy=diloco",)
                  for lr in outer_lrs]
        if not chosen:
            parser.error("--outer-lrs varies DiLoCo rows: choose some with --rows")
    settings = Settings(**(QUICK if args.quick else {}), size=args.size,
                        varied="the outer step's learning rate" if outer_lrs else "")
    for key in ("epochs", "sync_every", "overlap_steps", "emulated_step_s", "target_loss", "priced_steps"):
        if getattr(args, key) is not None:
            setattr(settings, key, getattr(args, key))
    seeds = {r.name: args.seeds for r in chosen} | parse_seeds_for(args.seeds_for, names)
    name = "lm_wan" + ("" if args.size == "tiny" else f"_{args.size}") + ("_outer" if outer_lrs else "")
    suffix = "_quick" if args.quick else ""
    runs = args.runs or ROOT / "outputs" / f"{name}{suffix}"
    out = args.out or (ROOT / "outputs" / f"{name}_quick" / f"{name}.json" if args.quick
                       else ROOT / "docs" / "results" / f"{name}.json")
    previous = {} if args.fresh or not out.exists() else json.loads(out.read_text())
    headline = Headline(settings, runs, out, runner=runner, muon_codec=args.muon_codec, previous=previous)
    report = headline.run(chosen, seeds)
    for row in report["rows"]:
        seeds_text = ", ".join(f"{s['val_loss']:.4f}" for s in row["seeds"]) or row.get("message", "")
        log.info("%-24s %-8s %s", row["name"], row["status"], seeds_text)
    log.info("wrote %s (%.0f min in all)", out, (time.monotonic() - headline.started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
