"""``syncplane chaos``: run a training job, fail chosen ranks or emulated hosts at chosen
steps, and report what the job did.

A fault is ``KIND:rank=N:step=S`` or ``KIND:host=N:step=S`` (``kill``: SIGKILL, ``stop``:
SIGSTOP -- a hung GPU or a swapping host, ``raise``: an exception, ``netdown``: the host's
NICs go down, emulated clusters only). A host is every rank of an emulated host (``cluster=``).
The faults become the job's ``fault`` list (``syncplane.runtime.liveness.InjectFault`` fires
them inside the ranks, after the training step), the job runs exactly as ``python train.py
OVERRIDES`` would, and while it runs this module watches it from outside, as an operator
would: the ranks' logs (when each fault fired, the first error each rank wrote after it),
the ranks' processes (when each ended), the launcher's exit code and error. Afterwards it
looks for what should not be there (a process of the job, a process inside the emulator's
namespaces) and for what should (the checkpoint written before the fault, loaded with
``weights_only=True``).

The verdict is the product's promise: a job that loses a rank ends within the
deadline, non-zero, with an error naming a lost rank, leaving nothing behind and its last
checkpoint intact -- and an elastic DiLoCo job goes on without the lost replica and exits 0.

This module imports no Lightning (``torch`` only, to load the checkpoint): the harness is the
operator's side of the job, not part of it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncplane.job import REPLICA_ENV
from syncplane.config import ConfigError, parse_variant
from syncplane.runtime.launcher import signals_stop_the_job
from syncplane.experiments.comparison import CONFIG_DIR, compose_job
from syncplane.runtime.settings import FAILING_KINDS, FaultSettings, JobSpec, parse_job

log = logging.getLogger(__name__)

TRAIN_PY = CONFIG_DIR.parent / "train.py"
#: the fault kinds that fail a rank (``slow`` only slows one: give it as the job's ``fault=`` to train.py)
KINDS: tuple[str, ...] = FAILING_KINDS
#: The line ``InjectFault`` logs on the rank as it fails.
FAULT_LINE = re.compile(r"fault: rank (\d+) fails \((\w+)\) after step (\d+)")
#: An error a rank writes as it stops: the heartbeat's ``syncplane: ...`` line, or the last
#: line of a Python traceback (``RuntimeError: ...``, ``torch.distributed.DistBackendError: ...``),
#: which torch prefixes with ``[rankN]: `` on a failed collective.
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(?:syncplane: .+|(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Timeout)(?:: .*)?)$")
#: What ``train.py`` writes on stderr when the job fails (its ``main``).
LAUNCHER_ERROR = re.compile(r"^syncplane: (?:training failed|invalid configuration|cannot run on the emulated "
                            r"cluster|rendezvous)[^\n]*", re.M)
#: A rank's log (its stdout): ``logs/rank<N>.log``.
RANK_LOG = re.compile(r"/rank(\d+)\.log$")

#: The launcher's own log records (restarts of elastic replicas), as Hydra's job logging writes them.
LAUNCHER_RECORD = re.compile(r"\[syncplane\.runtime\.launcher\]\[\w+\] - (.*)")


# ------------------------------------------------------------------ what to inject


@dataclass(frozen=True)
class FaultSpec:
    """One ``--fault`` as the user wrote it: a kind, a step, and a rank or a host."""

    text: str
    kind: str
    step: int
    rank: int | None = None
    host: int | None = None


def parse_fault(text: str) -> FaultSpec:
    """``kill:host=1:step=20`` -> FaultSpec; a ConfigError naming the spec and the bad part."""
    kind, *parts = text.strip().split(":")
    if kind not in KINDS:
        raise ConfigError(f"--fault {text!r}: unknown kind {kind!r}; allowed kinds: {', '.join(KINDS)}")
    values: dict[str, int] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "host", "step"):
            raise ConfigError(f"--fault {text!r}: {part!r} is not rank=N, host=N or step=N")
        if key in values:
            raise ConfigError(f"--fault {text!r}: {key} is given twice")
        if not value.isdigit():
            raise ConfigError(f"--fault {text!r}: {key} must be a whole number >= 0, got {value!r}")
        values[key] = int(value)
    if ("rank" in values) == ("host" in values):
        raise ConfigError(f"--fault {text!r}: name exactly one of rank=N (one rank) or host=N (every rank of an "
                          "emulated host)")
    if values.get("step", 0) < 1:
        raise ConfigError(f"--fault {text!r}: step=S (>= 1, the training step after which it fails) is missing")
    return FaultSpec(text=text, kind=kind, step=values["step"], rank=values.get("rank"), host=values.get("host"))


@dataclass
class PlannedFault:
    """A fault placed on the job: the ranks that inject it and the ranks the job loses by it
    (a netdown is injected by one rank and loses its whole host)."""

    spec: FaultSpec
    injected: list[int]
    lost: list[int]


def plan_faults(specs: list[FaultSpec], world_size: int, profile: Any = None) -> list[PlannedFault]:
    """Place each fault on ranks of a job of ``world_size`` (on ``profile``, a ClusterProfile,
    or this machine); refuse what cannot run, before anything starts."""
    if not specs:
        raise ConfigError("--fault: give at least one fault, e.g. --fault stop:rank=1:step=10")
    planned: list[PlannedFault] = []
    owner: dict[int, str] = {}
    for spec in specs:
        ranks = _ranks_of(spec, world_size, profile)
        if spec.kind == "netdown":
            host = profile.host_of_rank(ranks[0])
            injected, lost = ranks[:1], list(host.ranks)
        else:
            injected, lost = ranks, ranks
        for rank in lost:
            if rank in owner:
                raise ConfigError(f"--fault {spec.text!r}: rank {rank} is already failed by --fault {owner[rank]!r}; "
                                  "a rank fails once")
            owner[rank] = spec.text
        planned.append(PlannedFault(spec, injected, lost))
    if len(owner) >= world_size:
        raise ConfigError(f"--fault: these faults take every rank of the job of {world_size} down; leave at least one "
                          "rank to notice the loss")
    return planned


def _ranks_of(spec: FaultSpec, world_size: int, profile: Any) -> list[int]:
    if spec.kind == "netdown" and profile is None:
        raise ConfigError(f"--fault {spec.text!r}: netdown takes an emulated host's NICs down; it needs cluster=NAME "
                          "(never this machine's own interfaces)")
    if spec.host is None:
        assert spec.rank is not None
        if spec.rank >= world_size:
            raise ConfigError(f"--fault {spec.text!r}: rank {spec.rank} is not a rank of this job of {world_size} "
                              "(trainer.devices)")
        return [spec.rank]
    if profile is None:
        raise ConfigError(f"--fault {spec.text!r}: host=N names a host of an emulated cluster and this job runs on "
                          "this machine; add cluster=NAME, or name a rank=N")
    if spec.host >= len(profile.hosts):
        names = ", ".join(f"{h.index}={h.name}" for h in profile.hosts)
        raise ConfigError(f"--fault {spec.text!r}: host {spec.host} is not a host of cluster {profile.name!r} "
                          f"(hosts: {names})")
    return list(profile.hosts[spec.host].ranks)


def fault_config(planned: list[PlannedFault]) -> list[dict[str, Any]]:
    """The job's ``fault`` list: one entry per injecting rank."""
    return [{"kind": p.spec.kind, "rank": r, "step": p.spec.step} for p in planned for r in p.injected]


def fault_override(planned: list[PlannedFault]) -> str:
    """The same list as a Hydra override for ``train.py``."""
    items = ",".join("{" + ",".join(f"{k}:{v}" for k, v in f.items()) + "}" for f in fault_config(planned))
    return f"fault=[{items}]"


@dataclass
class ChaosPlan:
    """A validated chaos run: the job (as ``train.py`` composes and checks it) and its faults."""

    overrides: list[str]
    job: JobSpec
    faults: list[PlannedFault]
    run_dir: Path


def prepare(overrides: list[str], faults: list[str], run_dir: Path) -> ChaosPlan:
    """Compose the job, place the faults and validate everything, as ``train.py`` would
    before its first worker starts; nothing runs yet."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key == "fault" or key.startswith("fault."):
            raise ConfigError(f"{override!r}: give faults with --fault KIND:rank=N:step=S, not as a job override")
        if key.startswith("hydra."):
            raise ConfigError(f"{override!r}: syncplane chaos sets the run directory itself (--out)")
    run_dir = run_dir.resolve()
    if (run_dir / "job.yaml").exists():   # its old logs would be read as this run's
        raise ConfigError(f"--out {run_dir}: holds a run already; give a fresh directory")
    specs = [parse_fault(text) for text in faults]
    container = compose_job(list(overrides), "the job")
    devices = (container.get("trainer") or {}).get("devices", 2)
    profile = None
    if container.get("cluster") is not None:
        from syncplane.cluster import parse_profile

        profile = parse_profile(container["cluster"])
    if not isinstance(devices, int):
        raise ConfigError(f"trainer.devices: expected an integer, got {devices!r}")
    planned = plan_faults(specs, devices, profile)
    container["fault"] = fault_config(planned)
    job = parse_job(container, run_dir=str(run_dir))
    return ChaosPlan(list(overrides), job, planned, run_dir)


# ------------------------------------------------------------------ watching the job


@dataclass
class RankSeen:
    """What the watcher saw of one rank, in seconds since the job started."""

    fired_at: float | None = None         # its fault's log line appeared
    errors: list[tuple[float, str]] = field(default_factory=list)   # error lines, when they appeared
    alive: bool = False                   # a process of it is running now
    exited_at: float | None = None        # its process (the first start's) ended
    restarted: bool = False               # a process of it appeared again after it ended (elastic)


@dataclass
class Observation:
    """Everything seen from outside while the job ran (``JobWatch.poll``) and after it ended."""

    ranks: dict[int, RankSeen]
    ended_at: float | None = None         # the launcher exited
    exit_code: int | None = None
    output: str = ""                      # the launcher's stdout and stderr
    stopped_by_chaos: bool = False        # the launcher ran past --timeout-s and was stopped
    leftover: list[dict[str, Any]] = field(default_factory=list)   # processes found after it exited


def job_processes(job_file: Path) -> dict[int, int | None]:
    """pid -> rank of every process whose command line names this job's file (its ranks;
    with ``ip netns exec`` the wrapper execs the rank, one process). The rank is the elastic
    replica, else ``RANK``, read from the process's environment; a rank forked by the
    launcher (whose environment the kernel does not show) is read from the log its stdout
    writes, ``rank<N>.log``. None where neither is readable."""
    marker = str(job_file).encode()
    found: dict[int, int | None] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "cmdline").read_bytes():
                continue
            env = dict(item.partition(b"=")[::2] for item in (entry / "environ").read_bytes().split(b"\0") if item)
        except OSError:
            continue
        rank = env.get(REPLICA_ENV.encode(), env.get(b"RANK"))
        if rank is None or not rank.isdigit():
            try:
                log = RANK_LOG.search(os.readlink(entry / "fd" / "1"))
            except OSError:
                log = None
            rank = log.group(1).encode() if log else None
        found[int(entry.name)] = int(rank) if rank is not None else None
    return found


class JobWatch:
    """Follows a running job's rank logs and processes, every ``poll``."""

    def __init__(self, run_dir: Path, world_size: int, started: float) -> None:
        self.logs = run_dir / "logs"
        self.job_file = run_dir / "job.yaml"
        self.started = started
        self.ranks = {r: RankSeen() for r in range(world_size)}
        self._offsets = {r: 0 for r in range(world_size)}
        self._partial = {r: "" for r in range(world_size)}

    def poll(self) -> None:
        now = time.monotonic() - self.started
        for rank, seen in self.ranks.items():
            for line in self._new_lines(rank):
                if seen.fired_at is None and FAULT_LINE.search(line):
                    seen.fired_at = now
                elif ERROR_LINE.match(line.strip()):
                    seen.errors.append((now, line.strip()))
        running = {r for r in job_processes(self.job_file).values() if r is not None}
        for rank, seen in self.ranks.items():
            if rank in running and not seen.alive:
                seen.restarted = seen.exited_at is not None
                seen.alive = True
            elif rank not in running and seen.alive:
                seen.alive = False
                if seen.exited_at is None:
                    seen.exited_at = now

    def _new_lines(self, rank: int) -> list[str]:
        path = self.logs / f"rank{rank}.log"
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets[rank])
                data = f.read()
        except OSError:
            return []
        self._offsets[rank] += len(data)
        *lines, self._partial[rank] = (self._partial[rank] + data.decode(errors="replace")).split("\n")
        return lines


def run_job(plan: ChaosPlan, timeout_s: float, poll_s: float = 0.1) -> Observation:
    """Run the job through ``train.py`` (its own launcher, as a user would) and watch it."""
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    output_path = run_dir / "launcher.log"
    command = [sys.executable, str(TRAIN_PY), *plan.overrides, fault_override(plan.faults), f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    watch = JobWatch(run_dir, plan.job.trainer.devices, started)
    stopped = False
    # SIGTERM or SIGHUP to chaos end the job too (train.py ends its ranks on the SIGTERM it gets)
    with open(output_path, "wb") as output, signals_stop_the_job():
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while job.poll() is None:
                watch.poll()
                if time.monotonic() - started > timeout_s and not stopped:
                    log.warning("the job ran past --timeout-s=%.0f: stopping it (SIGTERM)", timeout_s)
                    stopped = True
                    job.terminate()
                time.sleep(poll_s)
        finally:
            if job.poll() is None:
                job.terminate()
                try:
                    job.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
    ended = time.monotonic() - started
    watch.poll()   # the last lines, and the ranks the launcher ended on its way out
    leftover = [{"pid": pid, "rank": rank} for pid, rank in job_processes(run_dir / "job.yaml").items()]
    if plan.job.cluster is not None:
        leftover += _namespace_processes()
    return Observation(ranks=watch.ranks, ended_at=ended, exit_code=job.returncode,
                       output=output_path.read_text(errors="replace"), stopped_by_chaos=stopped, leftover=leftover)


def _namespace_processes() -> list[dict[str, Any]]:
    """Processes still running inside the emulator's namespaces (the cluster itself stays up
    between jobs by design; what runs in it must not)."""
    from syncplane.cluster import emulator

    found = []
    for ns in emulator.namespaces():
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        found += [{"pid": int(pid), "namespace": ns} for pid in pids]
    return found


def clean_up(plan: ChaosPlan, observation: Observation) -> list[str]:
    """End what the job left behind (after it was reported), and take the emulated cluster
    down after a netdown (the host's NICs stay down otherwise, and the next job on it would
    fail for that). Returns what was done, for the report."""
    done = []
    for item in observation.leftover:
        try:
            os.kill(item["pid"], signal.SIGKILL)
            done.append(f"killed leftover pid {item['pid']}")
        except ProcessLookupError:
            pass
    if plan.job.cluster is not None and any(p.spec.kind == "netdown" for p in plan.faults):
        from syncplane.cluster import emulator

        removed = emulator.down()
        done.append(f"took the emulated cluster down after netdown ({len(removed)} namespaces)")
    return done


# ------------------------------------------------------------------ what the job did


def check_checkpoint(run_dir: Path, fault_step: int) -> dict[str, Any]:
    """Is the checkpoint written before the fault there, and does it load with
    ``weights_only=True``? ``history.jsonl`` says which step the last validation before the
    fault ended at (checkpoints are written after validation); with none, none is due."""
    import torch

    history = run_dir / "history.jsonl"
    steps = []
    if history.exists():
        for line in history.read_text().splitlines():
            record = json.loads(line)
            if "event" not in record and isinstance(record.get("step"), int):
                steps.append(record["step"])
    due = max((s for s in steps if s <= fault_step), default=None)
    path = run_dir / "checkpoints" / "last.ckpt"
    result: dict[str, Any] = {"path": str(path), "due_step": due, "exists": path.is_file(), "loads": None,
                              "global_step": None, "error": None}
    if not path.is_file():
        result["ok"] = due is None
        if due is not None:
            result["error"] = f"no checkpoint, although validation ended at step {due} before the fault"
        return result
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        result["loads"] = True
        result["global_step"] = int(checkpoint.get("global_step", -1))
    except Exception as exc:   # any failure to load is the finding itself
        result["loads"] = False
        result["error"] = f"does not load with weights_only=True: {type(exc).__name__}: {exc}"
    step = result["global_step"]
    if result["loads"] and not (step <= fault_step and (due is None or step >= due)):
        result["error"] = f"holds step {step}; expected the one written at step {due} before the fault at {fault_step}"
    result["ok"] = result["loads"] is True and result["error"] is None
    return result


def _names(text: str, ranks: list[int]) -> bool:
    return any(re.search(rf"\brank {r}\b", text) for r in ranks)


def analyse(plan: ChaosPlan, seen: Observation, checkpoint: dict[str, Any] | None, deadline_s: float) -> dict[str, Any]:
    """The report: faults, every rank's reaction, the launcher's, leftovers, the checkpoint,
    and the verdict. Times are seconds after the first fault fired (``*_after_s``) or after
    the job started (``fired_at_s``)."""
    lost = sorted({r for p in plan.faults for r in p.lost})
    fired = [seen.ranks[r].fired_at for p in plan.faults for r in p.injected if seen.ranks[r].fired_at is not None]
    first = min(fired) if fired else None

    def after(t: float | None) -> float | None:
        return None if t is None or first is None else round(t - first, 2)

    faults = []
    for p in plan.faults:
        times = {r: seen.ranks[r].fired_at for r in p.injected}
        faults.append({"spec": p.spec.text, "kind": p.spec.kind, "step": p.spec.step, "injected_by": p.injected,
                       "lost": p.lost, "fired": all(t is not None for t in times.values()),
                       "fired_at_s": {str(r): None if t is None else round(t, 2) for r, t in times.items()}})
    ranks = []
    for rank, rank_seen in sorted(seen.ranks.items()):
        errors = [(t, line) for t, line in rank_seen.errors if first is not None and t >= first]
        error_t, error = errors[0] if errors else (None, None)
        ranks.append({"rank": rank, "role": "lost" if rank in lost else "survivor", "error": error,
                      "error_after_s": after(error_t), "names_lost_rank": error is not None and _names(error, lost),
                      "exited_after_s": after(rank_seen.exited_at), "restarted": rank_seen.restarted})
    launcher_error = LAUNCHER_ERROR.search(seen.output)
    error_block = seen.output[launcher_error.start():] if launcher_error else ""
    report = {
        "job": {"strategy": plan.job.strategy.name, "label": plan.job.label, "recipe": plan.job.recipe_name,
                "world_size": plan.job.trainer.devices, "elastic": plan.job.elastic,
                "cluster": plan.job.cluster.name if plan.job.cluster is not None else None,
                "overrides": plan.overrides, "run_dir": str(plan.run_dir),
                "heartbeat_timeout_s": plan.job.trainer.heartbeat_timeout_s},
        "deadline_s": deadline_s, "faults": faults, "lost_ranks": lost, "ranks": ranks,
        "launcher": {"exit_code": seen.exit_code, "ended_after_s": after(seen.ended_at),
                     "stopped_by_chaos": seen.stopped_by_chaos,
                     "error": launcher_error.group(0) if launcher_error else None,
                     "names_lost_rank": _names(error_block, lost),
                     "records": LAUNCHER_RECORD.findall(seen.output)},
        "leftover": seen.leftover, "checkpoint": checkpoint,
    }
    report["problems"] = problems(report)
    report["ok"] = not report["problems"]
    return report


def problems(report: dict[str, Any]) -> list[str]:
    """Where the job broke the product's promise; empty when it kept it."""
    found = []
    if not any(f["fired"] for f in report["faults"]):
        found.append("no fault fired: the job ended before the step it was to fail at")
    launcher, lost = report["launcher"], report["lost_ranks"]
    if launcher["stopped_by_chaos"]:
        found.append("the job did not end on its own: syncplane chaos stopped it at --timeout-s")
    if report["job"]["elastic"]:
        if launcher["exit_code"] != 0:
            found.append(f"the elastic job exited {launcher['exit_code']}; it should have gone on without the lost "
                         f"replica(s) {lost}")
    else:
        if launcher["exit_code"] == 0:
            found.append(f"the job exited 0 although it lost rank(s) {lost}")
        ended = launcher["ended_after_s"]
        if ended is not None and ended > report["deadline_s"]:
            found.append(f"the job ended {ended:.1f} s after the fault; the deadline is {report['deadline_s']:g} s")
        named = launcher["names_lost_rank"] or any(r["names_lost_rank"] for r in report["ranks"])
        if any(f["fired"] for f in report["faults"]) and not named:
            found.append(f"no error names the lost rank(s) {lost}")
        checkpoint = report["checkpoint"]
        if checkpoint is not None and not checkpoint["ok"]:
            found.append(f"checkpoint {checkpoint['path']}: {checkpoint['error']}")
    if report["leftover"]:
        found.append(f"{len(report['leftover'])} process(es) left running after the launcher exited: "
                     + ", ".join(str(p["pid"]) for p in report["leftover"]))
    return found


def run_chaos(plan: ChaosPlan, deadline_s: float, timeout_s: float, json_path: Path) -> dict[str, Any]:
    """Run the planned job, write the report to ``json_path`` and return it."""
    log.info("syncplane chaos: %s on %s, %d ranks; faults %s; run dir %s", plan.job.strategy.name,
             plan.job.recipe_name, plan.job.trainer.devices, ", ".join(p.spec.text for p in plan.faults), plan.run_dir)
    seen = run_job(plan, timeout_s)
    fired_steps = [p.spec.step for p in plan.faults]
    checkpoint = None if plan.job.elastic else check_checkpoint(plan.run_dir, min(fired_steps))
    report = analyse(plan, seen, checkpoint, deadline_s)
    report["cleaned_up"] = clean_up(plan, seen)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict[str, Any], json_path: Path) -> None:
    """The report as tables (rich; plain text when not on a terminal)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=140)
    job = report["job"]
    where = f"emulated cluster {job['cluster']!r}" if job["cluster"] else "this machine"
    faults = Table(title=f"chaos: {escape(job.get('label') or job['strategy'])} on {job['recipe']}, {job['world_size']} ranks on {where}")
    for col in ("fault", "injected by", "ranks lost", "fired (s after start)"):
        faults.add_column(col)
    for f in report["faults"]:
        times = ", ".join(f"{r}: {t:.1f}" if t is not None else f"{r}: never" for r, t in f["fired_at_s"].items())
        faults.add_row(f["spec"], str(f["injected_by"]), str(f["lost"]), times)
    console.print(faults)
    ranks = Table(title="what each rank did (seconds after the first fault)")
    for col in ("rank", "role", "error after", "exited after", "names lost"):
        ranks.add_column(col, justify="right" if col.endswith("after") else "left", no_wrap=True)
    ranks.add_column("its first error after the fault", no_wrap=True, overflow="ellipsis", max_width=60)
    for r in report["ranks"]:
        survivor = r["role"] == "survivor"
        ranks.add_row(str(r["rank"]), r["role"] + (" (restarted)" if r["restarted"] else ""), _seconds(r["error_after_s"]),
                      _seconds(r["exited_after_s"]), ("yes" if r["names_lost_rank"] else "no") if survivor else "-",
                      r["error"] or "-")
    console.print(ranks)
    launcher = report["launcher"]
    console.print(f"launcher: exit code {launcher['exit_code']}, ended {_seconds(launcher['ended_after_s'])} s after "
                  f"the first fault{' (stopped by chaos)' if launcher['stopped_by_chaos'] else ''}")
    if launcher["error"]:
        console.print(f"  {launcher['error'][:200]}", markup=False, highlight=False)
    for record in launcher["records"]:
        console.print(f"  launcher: {record}", markup=False, highlight=False)
    console.print(f"left over: {len(report['leftover'])} process(es)")
    checkpoint = report["checkpoint"]
    if checkpoint is not None:
        state = ("loads (weights_only), step " + str(checkpoint["global_step"]) if checkpoint["loads"]
                 else "none due (no validation ended before the fault)" if checkpoint["ok"] else checkpoint["error"])
        console.print(f"checkpoint: {state}", markup=False, highlight=False)
    for item in report.get("cleaned_up", []):
        console.print(f"cleaned up: {item}")
    if report["ok"]:
        console.print("[green]verdict: the job kept the promise[/]")
    else:
        console.print("[red]verdict: the job broke the promise[/]")
        for problem in report["problems"]:
            console.print(f"  - {problem}", markup=False, highlight=False)
    console.print(f"report written to {json_path}", soft_wrap=True)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"



# ------------------------------------------------------------------ every strategy × every fault


#: Where a ``netdown`` cell, or a row whose replica is a node, runs when the job names no
#: cluster: two hosts of two ranks and two NICs each, so a netdown takes one whole host (its
#: ranks) off the network, and ``diloco[replica=node]`` has two nodes of two ranks.
NETDOWN_CLUSTER = "multi_nic"
#: ``strategy.kwargs.replica`` values that make a node (the ranks of a host) one replica:
#: such a row needs hosts of several ranks, which a job on this machine (one host) lacks.
NODE_REPLICAS = ("node", "auto")


def cell_overrides(item: str) -> list[str]:
    """A row's job overrides: ``NAME`` or ``NAME[key=value,...]`` (a variant of its
    ``strategy.kwargs``, as in ``syncplane compare``), labelled by the whole item."""
    name, options = parse_variant(item)
    return [f"strategy={name}", *([f"label='{item}'"] if options else []),
            *(f"strategy.kwargs.{key}={value}" for key, value in options)]


def cell_dir(item: str, kind: str) -> str:
    """A cell's run directory name: ``diloco[replica=node]`` x kill -> ``diloco-replica-node-kill``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", item).strip("-") + f"-{kind}"


def _needs_hosts(item: str) -> bool:
    return dict(parse_variant(item)[1]).get("replica") in NODE_REPLICAS


def matrix_plans(strategies: list[str], kinds: list[str], overrides: list[str], out_dir: Path, *, rank: int,
                 step: int) -> list[ChaosPlan]:
    """One plan per row × kind (the same job otherwise), all validated before any runs: a
    typo in the 30th cell fails now, not after half an hour. A row is a strategy or a variant
    ``NAME[key=value,...]`` (``diloco[replica=node]``); a netdown cell and a node-replica row
    run on ``NETDOWN_CLUSTER`` unless the job names a cluster."""
    for override in overrides:
        if override.lstrip("+~").partition("=")[0] in ("strategy", "label"):
            raise ConfigError(f"{override!r}: --matrix sets the strategy per cell; give --strategies instead "
                              "(NAME[key=value,...] for a variant)")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ConfigError(f"--kinds: unknown {', '.join(unknown) or '(none given)'}; allowed kinds: {', '.join(KINDS)}")
    own_cluster = any(o.lstrip("+").startswith("cluster=") for o in overrides)
    plans = []
    for item in strategies:
        for kind in kinds:
            job = [*cell_overrides(item), *overrides]
            if (kind == "netdown" or _needs_hosts(item)) and not own_cluster:
                job.append(f"cluster={NETDOWN_CLUSTER}")
            plans.append(prepare(job, [f"{kind}:rank={rank}:step={step}"], out_dir / cell_dir(item, kind)))
    return plans


def matrix_row(report: dict[str, Any]) -> dict[str, Any]:
    """One cell of the matrix: what a user compares across strategies and faults."""
    survivors = [r for r in report["ranks"] if r["role"] == "survivor"]
    exits = [r["exited_after_s"] for r in survivors]
    checkpoint = report["checkpoint"]
    return {"strategy": report["job"].get("label") or report["job"]["strategy"], "kind": report["faults"][0]["kind"],
            "cluster": report["job"]["cluster"], "ok": report["ok"], "lost": report["lost_ranks"],
            "survivors_out_s": None if None in exits or not exits else max(exits),
            "launcher_out_s": report["launcher"]["ended_after_s"], "exit_code": report["launcher"]["exit_code"],
            "survivors_named": sum(r["names_lost_rank"] for r in survivors), "survivors": len(survivors),
            "leftover": len(report["leftover"]),
            "checkpoint_step": None if checkpoint is None else checkpoint.get("global_step"),
            "problems": report["problems"]}


def run_matrix(plans: list[ChaosPlan], deadline_s: float, timeout_s: float, json_path: Path) -> list[dict[str, Any]]:
    """Run every cell in turn (one job at a time: the deadline is a wall-clock promise, and a
    netdown cell holds the emulated cluster); write the rows to ``json_path`` as they come."""
    rows: list[dict[str, Any]] = []
    for i, plan in enumerate(plans):
        log.info("syncplane chaos --matrix: cell %d of %d", i + 1, len(plans))
        report = run_chaos(plan, deadline_s, timeout_s, plan.run_dir / "chaos.json")
        rows.append(matrix_row(report))
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"deadline_s": deadline_s, "cells": rows}, indent=1))
    return rows


def print_matrix(rows: list[dict[str, Any]], deadline_s: float, json_path: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=140)
    table = Table(title=f"chaos matrix: seconds after the fault until every survivor / the launcher was gone "
                        f"(deadline {deadline_s:g} s)")
    for col in ("strategy", "fault", "lost", "survivors out", "launcher out", "survivors naming it", "left over",
                "checkpoint", "verdict"):
        table.add_column(col, justify="right" if "out" in col else "left")
    for row in rows:
        where = f" ({row['cluster']})" if row["cluster"] else ""
        table.add_row(escape(row["strategy"]), row["kind"] + where, str(row["lost"]), _seconds(row["survivors_out_s"]),
                      _seconds(row["launcher_out_s"]), f"{row['survivors_named']}/{row['survivors']}",
                      str(row["leftover"]), "-" if row["checkpoint_step"] is None else f"step {row['checkpoint_step']}",
                      "[green]kept[/]" if row["ok"] else "[red]broken[/]: " + "; ".join(row["problems"]))
    console.print(table)
    broken = [r for r in rows if not r["ok"]]
    console.print(f"{len(rows) - len(broken)} of {len(rows)} cells kept the promise; rows written to {json_path}",
                  soft_wrap=True)
