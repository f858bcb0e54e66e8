"""Start one process per rank, collect their logs, and fail fast as a group.

Why our own launcher: Lightning's ``ddp`` launcher re-executes ``sys.argv`` for ranks
1..N-1, which breaks Hydra multirun; ``ddp_spawn`` pickles everything and returns only
rank 0's state. Here the Hydra job (one per multirun job) starts N workers with
torchrun's environment variables, so Lightning sees externally created processes
(``TorchElasticEnvironment``) and never relaunches. The same mechanism will run ranks
inside network namespaces (the cluster emulator) by prefixing their command. A ``python -m``
rank is forked from a server that has imported torch and Lightning once
(``syncplane.runtime.forkserver``), not started as a fresh interpreter.

Failure policy: the first rank that exits non-zero is named, the others get
``grace_s`` seconds to exit on their own (a broken collective usually ends them), then
SIGTERM, then SIGKILL -- the launcher never waits forever. Nothing is orphaned: SIGTERM or
SIGHUP to the launcher ends its ranks the same way before it exits, and a rank whose launcher
dies without that chance (SIGKILL) is killed by the kernel (``lifetime.die_with_parent``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from syncplane.launch import CLUSTER_ENV
from syncplane.job import RESTART_ENV
from syncplane.runtime import forkserver
from syncplane.runtime.lifetime import PARENT_ENV
from syncplane.runtime.heartbeat import LOST_PEER_EXIT
from syncplane.net import free_port

if TYPE_CHECKING:
    from syncplane.cluster import ClusterProfile

log = logging.getLogger(__name__)

#: Elastic jobs: how long the other replicas get to finish once one has finished.
_ELASTIC_FINISH_GRACE_S = 120.0


class _Rank(Protocol):
    """A started rank: a ``subprocess.Popen``, or a ``forkserver.ForkedRank``."""

    pid: int

    def poll(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...


class LaunchError(RuntimeError):
    """A rank failed (or the job timed out); the message names the rank and its log."""


class JobStopped(LaunchError):
    """The launcher was told to stop (SIGTERM, SIGHUP) and ended the ranks: nothing failed,
    so a caller that runs several jobs (``bench --matrix``) stops too instead of going on."""


@dataclass
class RankSpec:
    """How to start one rank: its torchrun-style identity, and the network namespace it runs in
    (an emulated host's; None: this machine's)."""

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int = 0
    namespace: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    #: elastic jobs: the replica this rank is part of (None: the rank is one); a replica's
    #: ranks are one job: one failing ends the others, and they restart together
    replica: int | None = None


def local_ranks(world_size: int) -> list[RankSpec]:
    """All ranks on this host (one node)."""
    return [RankSpec(rank=r, local_rank=r, local_world_size=world_size) for r in range(world_size)]


def cluster_ranks(profile: "ClusterProfile") -> list[RankSpec]:
    """Every rank of an emulated cluster, each inside its host's network namespace."""
    from syncplane.cluster import emulator

    specs = []
    for host in profile.hosts:
        for local, rank in enumerate(host.ranks):
            specs.append(RankSpec(rank=rank, local_rank=local, local_world_size=host.spec.ranks,
                                  node_rank=host.index, namespace=emulator.rank_namespace(profile, rank),
                                  env=emulator.rank_env(profile, rank)))
    return specs


@contextlib.contextmanager
def cluster_session(profile: "ClusterProfile", log_dir: Path) -> Iterator[list[RankSpec]]:
    """Bring the emulated cluster up (if it is not) and run the profile's background flows
    while the caller launches; yields every rank's spec, each inside its host and told which
    cluster it runs on (topology-aware strategies read it: ``syncplane.cluster.probe``)."""
    from syncplane.cluster import emulator

    import yaml

    log_dir.mkdir(parents=True, exist_ok=True)
    profile_file = log_dir / "cluster.yaml"
    profile_file.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
    ranks = [replace(s, env={**s.env, CLUSTER_ENV: str(profile_file.resolve())}) for s in cluster_ranks(profile)]
    with emulator.in_use(profile), emulator.background_flows(profile, log_dir):
        yield ranks


def launch_on_cluster(command: Sequence[str], profile: "ClusterProfile", log_dir: Path, **kwargs: object) -> None:
    """Launch every rank in its host of the emulated cluster, rendezvousing on rank 0's NIC."""
    from syncplane.cluster import emulator

    forkserver.warm_up(kwargs.get("env"))  # type: ignore[arg-type]   # its imports overlap the cluster's bring-up
    with cluster_session(profile, log_dir) as ranks:
        launch(command, ranks, log_dir, master_addr=emulator.master_addr(profile),
               master_port=29500, **kwargs)  # type: ignore[arg-type]


def _tee(stream: IO[bytes], log_file: IO[bytes], echo: IO[str]) -> None:
    for line in iter(stream.readline, b""):
        log_file.write(line)
        log_file.flush()
        echo.write(line.decode(errors="replace"))
        echo.flush()


def _follow(path: Path, stop: threading.Event, echo: IO[str]) -> None:
    """Echo the lines a forked rank writes to its log, until ``stop`` and the end of the file."""
    pending = b""
    with open(path, "rb") as log_file:
        while True:
            chunk = log_file.readline()
            if chunk:
                pending += chunk
                if pending.endswith(b"\n"):
                    echo.write(pending.decode(errors="replace"))
                    echo.flush()
                    pending = b""
                continue
            if stop.is_set():
                break
            stop.wait(0.05)
    if pending:
        echo.write(pending.decode(errors="replace"))
        echo.flush()


def _fork(module: str, args: list[str], *, env: Mapping[str, str], log_path: Path,
          namespace: str | None) -> _Rank | None:
    """The rank forked from the server; None, with a warning, when the server cannot fork it
    (it died, or failed to import its preload): the rank then starts as a fresh process."""
    try:
        return forkserver.start(module, args, env=env, log_path=log_path, namespace=namespace)
    except (OSError, EOFError) as exc:
        log.warning("the fork server could not start %s (%s: %s); starting it as a fresh process",
                    log_path.stem, type(exc).__name__, exc)
        return None


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def launch(
    command: Sequence[str],
    ranks: Sequence[RankSpec],
    log_dir: Path,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    echo_rank0: bool = True,
    grace_s: float = 15.0,
    timeout_s: float | None = None,
    max_restarts: int | None = None,
    restart_delay_s: float = 0.0,
    echo_to: IO[str] | None = None,
    fork_server: bool | None = None,
) -> None:
    """Run ``command`` once per rank and wait; raise LaunchError if any rank fails.

    Each rank's stdout/stderr goes to ``log_dir/rank<i>.log``; rank 0's is also echoed
    to this process's stdout (progress and the summary table), or to ``echo_to`` (a
    caller running many jobs tags each line with the job it belongs to).

    ``max_restarts`` (elastic jobs, whose ranks are independent replicas): a rank that
    fails is started again, up to that many times per rank (``RESTART_ENV`` tells it which
    start it is; its log goes on in the same file), and the others are left running. The job
    then fails only if no rank finishes cleanly; ranks lost for good are logged.
    ``restart_delay_s``: how long a failed rank stays down before its restart -- a crash loop
    does not spin, and its peers have time to notice the loss and go on without it, rather
    than racing a replica that comes straight back.

    ``fork_server``: start each ``python -m`` rank as a fork of a server that has imported
    torch and Lightning once (``syncplane.runtime.forkserver``); by default yes, unless
    ``SYNCPLANE_FORK_SERVER=0`` is in ``env``. Other commands start as fresh processes.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    world_size = len(ranks)
    base_env = dict(os.environ if env is None else env)
    base_env[PARENT_ENV] = str(os.getpid())
    port = master_port or free_port(master_addr)
    procs: list[tuple[RankSpec, _Rank, Path]] = []
    threads: list[threading.Thread] = []
    stop_following = threading.Event()
    use_fork_server = forkserver.enabled(base_env) if fork_server is None else fork_server
    logs: list[IO[bytes]] = []
    with signals_stop_the_job():
        try:
            def start(spec: RankSpec, restart: int) -> tuple[RankSpec, _Rank, Path]:
                rank_env = dict(base_env)
                rank_env.update(
                    RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(spec.local_world_size), GROUP_RANK=str(spec.node_rank),
                    NODE_RANK=str(spec.node_rank), MASTER_ADDR=master_addr, MASTER_PORT=str(port),
                    PYTHONUNBUFFERED="1",
                )
                rank_env.update(spec.env)
                rank_env[RESTART_ENV] = str(restart)
                log_path = log_dir / f"rank{spec.rank}.log"
                log_file = open(log_path, "ab" if restart else "wb")
                logs.append(log_file)
                echo = echo_rank0 and spec.rank == 0 and restart == 0
                fork = forkserver.forkable(command) if use_fork_server else None
                proc = None if fork is None else _fork(*fork, env=rank_env, log_path=log_path,
                                                       namespace=spec.namespace)
                echo_from: tuple[Callable[..., None], tuple[object, ...]]
                if proc is not None:   # it writes its log itself; rank 0's is followed for the echo
                    echo_from = (_follow, (log_path, stop_following))
                else:
                    from syncplane.cluster.emulator import netns_exec

                    proc = popen = subprocess.Popen(
                        [*netns_exec(spec.namespace), *command], env=rank_env, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE if echo else log_file, stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: we can end it and its children
                    )
                    echo_from = (_tee, (popen.stdout, log_file))
                if echo:
                    reader, sources = echo_from
                    t = threading.Thread(target=reader, args=(*sources, echo_to or sys.stdout), daemon=True)
                    t.start()
                    threads.append(t)
                return spec, proc, log_path

            procs.extend(start(spec, 0) for spec in ranks)
            if max_restarts is None:
                _wait_all(procs, grace_s=grace_s, timeout_s=timeout_s)
            else:
                _wait_elastic(procs, start, max_restarts=max_restarts, timeout_s=timeout_s,
                              restart_delay_s=restart_delay_s)
        finally:
            _terminate([p for _, p, _ in procs])
            stop_following.set()
            for t in threads:
                t.join(timeout=5)
            for log_file in logs:
                log_file.close()


def _wait_all(procs: list[tuple[RankSpec, _Rank, Path]], *, grace_s: float,
              timeout_s: float | None) -> None:
    start = time.monotonic()
    failure: tuple[RankSpec, int, Path] | None = None
    failed_at = 0.0
    while True:
        running = [(s, p, path) for s, p, path in procs if p.poll() is None]
        if failure is None:
            for s, p, path in procs:
                if p.returncode not in (None, 0):
                    failure, failed_at = (s, p.returncode, path), time.monotonic()
                    break
        if not running:
            break
        now = time.monotonic()
        # a rank that left because a peer was lost (heartbeat) says the job is over: the
        # others have read the same verdict, and the lost one may be hung, never to exit
        grace = min(grace_s, _LOST_PEER_GRACE_S) if failure is not None and failure[1] == LOST_PEER_EXIT else grace_s
        if failure is not None and now - failed_at > grace:
            if failure[1] == LOST_PEER_EXIT:
                # what still runs is the lost rank itself (stopped, or cut off from the network):
                # it cannot act on SIGTERM, so the polite stop would only add its wait to the job's end
                _terminate([p for _, p, _ in running], signals=(signal.SIGKILL,))
            break
        if timeout_s is not None and now - start > timeout_s:
            stuck = ", ".join(str(s.rank) for s, _, _ in running)
            raise LaunchError(f"job exceeded its {timeout_s:.0f} s limit; ranks still running: {stuck}")
        time.sleep(0.1)
    if failure is not None:
        spec, code, failed_log = failure
        reason = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise LaunchError(
            f"rank {spec.rank} failed ({reason}); the other ranks were stopped. Its log: {failed_log}\n"
            f"--- last lines of rank {spec.rank} ---\n{_tail(failed_log)}"
        )


def _wait_elastic(procs: list[tuple[RankSpec, _Rank, Path]],
                  start: Callable[[RankSpec, int], tuple[RankSpec, _Rank, Path]], *,
                  max_restarts: int, timeout_s: float | None, finish_grace_s: float = _ELASTIC_FINISH_GRACE_S,
                  restart_delay_s: float = 0.0) -> None:
    """Wait for independent replicas: restart a failed one (up to ``max_restarts`` times,
    ``restart_delay_s`` after it failed), never stop the others for it (a replica restarted
    after the job's work is done finds that out itself and exits cleanly). A replica of several
    ranks (``RankSpec.replica``) fails as one: its other ranks are ended, and all restart
    together. Once one replica has finished, the rest get ``finish_grace_s`` to finish too
    (replicas end at the same round); one still running then (a hung replica the others left
    behind) is ended with the job. ``procs`` is updated in place (the caller ends what runs)."""
    began = time.monotonic()
    first_finish: float | None = None

    def replica(spec: RankSpec) -> int:
        return spec.rank if spec.replica is None else spec.replica

    restarts = {replica(spec): 0 for spec, _, _ in procs}
    lost: dict[int, str] = {}
    finished: set[int] = set()
    due: dict[int, float] = {}   # index in procs -> when its restart starts
    while True:
        for i, (spec, p, rank_log) in enumerate(list(procs)):
            if i in due:
                if time.monotonic() >= due[i]:
                    del due[i]
                    procs[i] = start(spec, restarts[replica(spec)])
                continue
            code = p.poll()
            if code is None or spec.rank in finished or spec.rank in lost:
                continue
            if code == 0:
                finished.add(spec.rank)
                first_finish = first_finish or time.monotonic()
                continue
            reason = f"signal {-code}" if code < 0 else f"exit code {code}"
            group = [j for j, (s, _, _) in enumerate(procs) if replica(s) == replica(spec)]
            others = [procs[j][0].rank for j in group if j != i]
            also = f" with the other rank(s) {others} of its replica" if others else ""
            _terminate([procs[j][1] for j in group if j != i])   # a replica of several ranks goes as one
            if restarts[replica(spec)] < max_restarts:
                restarts[replica(spec)] += 1
                log.warning("rank %d failed (%s); restart %d of %d%s%s", spec.rank, reason, restarts[replica(spec)],
                            max_restarts, f" in {restart_delay_s:g} s" if restart_delay_s else "", also)
                due.update({j: time.monotonic() + restart_delay_s for j in group})
            else:
                lost.update({procs[j][0].rank: reason for j in group})
                log.warning("rank %d failed (%s) and is not restarted (max_restarts=%d)%s; the others "
                            "go on. Its log: %s", spec.rank, reason, max_restarts, also, rank_log)
        if len(finished) + len(lost) == len(procs):
            break
        if first_finish is not None and time.monotonic() - first_finish > finish_grace_s:
            left = ", ".join(str(s.rank) for s, p, _ in procs if p.poll() is None)
            log.warning("rank(s) %s still running %.0f s after the job's first replica finished (hung, "
                        "or restarted too late): ended", left, finish_grace_s)
            break
        if timeout_s is not None and time.monotonic() - began > timeout_s:
            stuck = ", ".join(str(s.rank) for s, p, _ in procs if p.poll() is None)
            raise LaunchError(f"job exceeded its {timeout_s:.0f} s limit; ranks still running: {stuck}")
        time.sleep(0.1)
    if not finished:
        rank, reason = next(iter(lost.items()))
        lost_log = next(lg for s, _, lg in procs if s.rank == rank)
        raise LaunchError(f"every rank failed (rank {rank}: {reason}); its log: {lost_log}\n"
                          f"--- last lines of rank {rank} ---\n{_tail(lost_log)}")


def _terminate(procs: Sequence[_Rank], wait_s: float = 5.0,
               signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """Send ``signals`` in turn (by default SIGTERM, then SIGKILL) to every still-running
    rank's process group, ``wait_s`` apart, until none is left."""
    alive = [p for p in procs if p.poll() is None]
    for sig in signals:
        for p in alive:
            for kill in (os.killpg, os.kill):  # a rank just forked may not lead its process group yet
                try:
                    kill(p.pid, sig)
                    if sig == signal.SIGTERM:
                        kill(p.pid, signal.SIGCONT)   # a stopped rank acts on SIGTERM only once resumed
                    break
                except ProcessLookupError:
                    continue
                except PermissionError:
                    break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            return



#: How long the other ranks get to exit once one has left because a peer was lost. A rank
#: leaves on the heartbeat's verdict only after saying why and after every live rank has read
#: it (``Heartbeat.settle``), so a second later what still runs is the lost rank, or a rank on
#: its way out whose error is already written.
_LOST_PEER_GRACE_S = 1.0


@contextlib.contextmanager
def signals_stop_the_job() -> Iterator[None]:
    """While ranks run, SIGTERM and SIGHUP (a scheduler's cancel, a closed terminal) raise
    ``JobStopped`` (a ``LaunchError``) in the launcher, so its ``finally`` ends the ranks. Python's default
    SIGTERM would end the launcher alone and leave its ranks running, blocked in gloo."""
    if threading.current_thread() is not threading.main_thread():
        yield   # only the main thread may set handlers; the caller owns signals then
        return

    def stop(signum: int, _frame: object) -> None:
        raise JobStopped(f"stopped by {signal.Signals(signum).name}; the ranks were ended")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
