"""Start ranks as forks of one server that has already imported torch, Lightning and syncplane.

Why: a fresh interpreter spends seconds of CPU importing torch and Lightning before its first
step (on a 2-core machine about 13 s a rank: torch 4 s, Lightning's torchmetrics 9 s). A job of
N ranks paid it N times, on the CPUs its ranks share. Forked from a server that has imported
them once, each rank starts in a fraction of a second; the server lives as long as the
launcher, so ``bench --matrix`` and Hydra multirun pay the import once for every job.

A forked rank is still a process of its own (own pid, session, memory, sockets), started the
way ``python -m MODULE ARGS`` would start it: its own environment, working directory,
``sys.argv``, stdout and stderr in its log, and inside its host's network namespace when the
launcher names one (the same namespaces, ``/sys`` and ``/etc/netns`` files that
``ip netns exec`` sets up). What it cannot take from its environment is what an
interpreter reads once when it imports a library (``OMP_NUM_THREADS`` for libgomp's default,
``TORCH_CPP_LOG_LEVEL``): those come from the launcher's environment. A job that needs them per
rank, or a command that is not ``python -m``, is started as a fresh process
(``SYNCPLANE_FORK_SERVER=0`` asks for that everywhere).

Built on ``multiprocessing``'s fork server: it reports each child's exit status and ends
with its launcher (each rank, forked with the kernel's parent-death signal, ends with it).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import multiprocessing as mp
import os
import runpy
import signal
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from syncplane.runtime.lifetime import die_with_parent

#: Imported once by the server: what every rank imports anyway. Product modules only; a tool
#: adds its own rank module with ``preload`` (the product never imports the tools: ``make lint``).
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "syncplane.strategies", "syncplane.runtime.worker"]

_extra_preload: list[str] = []

#: ``SYNCPLANE_FORK_SERVER=0``: start every rank as a fresh interpreter.
ENV = "SYNCPLANE_FORK_SERVER"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MS_BIND = 0x1000
_MNT_DETACH = 2


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ranks may be forked: Linux, and not switched off by ``SYNCPLANE_FORK_SERVER=0``."""
    env = os.environ if env is None else env
    return sys.platform == "linux" and env.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def forkable(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` when ``command`` is ``<this python> -m MODULE ARGS``, which a fork of
    this interpreter's server can run; else None."""
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
        return None
    return command[2], list(command[3:])


class ForkedRank:
    """A rank forked by the server, polled like a ``subprocess.Popen``: ``pid``, ``poll()``
    and ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    @property
    def returncode(self) -> int | None:
        return self.poll()


def preload(*modules: str) -> None:
    """Have the server import ``modules`` too (a tool's rank module, e.g. the bench's worker),
    when it starts: call before ``warm_up`` or the first ``start``. Later calls change nothing
    for a server already running (its ranks import the module themselves)."""
    _extra_preload.extend(m for m in modules if m not in PRELOAD and m not in _extra_preload)


@functools.cache
def _context() -> Any:
    """The fork-server context, set up once per process (with its server's end at exit)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_extra_preload])
    atexit.register(_stop_server)
    return ctx


def _stop_server() -> None:
    """At exit, end this process's server at once. Left to itself, a server still importing
    its preload (a launcher that failed validation seconds after its warm-up) would finish
    those imports, on CPUs the next job needs, before it noticed its launcher was gone."""
    from multiprocessing import forkserver as mp_forkserver

    server = mp_forkserver._forkserver   # type: ignore[attr-defined]
    if server._forkserver_pid is None:
        return
    try:
        os.kill(server._forkserver_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()   # closes the pipe, reaps the server, removes its socket


def warm_up(env: Mapping[str, str] | None = None) -> None:
    """Start the server now, if ranks will be forked, so that its imports overlap the
    launcher's own work (validating the job, bringing an emulated cluster up) rather than
    follow it. It returns at once; the first ``start`` waits for the imports."""
    if enabled(env):
        _context()
        from multiprocessing import forkserver as mp_forkserver

        mp_forkserver.ensure_running()


def start(module: str, args: Sequence[str], *, env: Mapping[str, str], log_path: Path,
          namespace: str | None) -> ForkedRank:
    """Fork ``python -m module args`` from the server (started on first use), with ``env`` as
    its whole environment, this process's working directory, and stdout and stderr appended
    to ``log_path``."""
    process = _context().Process(target=_run_rank, name=f"{module} rank", args=(
        module, list(args), dict(env), os.getcwd(), str(log_path.absolute()), namespace))
    process.start()
    return ForkedRank(process)


def _run_rank(module: str, args: list[str], env: dict[str, str], cwd: str, log_path: str,
              namespace: str | None) -> None:
    """In the forked child: become ``python -m module args`` and exit as it would."""
    # What the server imported is shared with it, page by page, until written. The cyclic
    # garbage collector writes into every object it visits: its full collections, during a
    # rank's steps, copied those pages one by one (measured: docs/design-notes.md). Frozen,
    # the server's objects are never visited; what the rank allocates is collected as ever.
    gc.freeze()
    import setproctitle

    # ps and /proc/PID/cmdline show the rank's command, not the server's
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    os.setsid()                          # its own session and process group, as the launcher's Popen gives
    # The server hands each child the launcher's end of the pipe whose closing ends the
    # server; a rank holding it would keep the server, and so itself, alive after the launcher
    # died. Without it, a killed launcher ends the server, and the parent-death signal the rank.
    from multiprocessing import forkserver as mp_forkserver

    alive = mp_forkserver._forkserver._forkserver_alive_fd   # type: ignore[attr-defined]
    if alive is not None:
        os.close(alive)
        mp_forkserver._forkserver._forkserver_alive_fd = None   # type: ignore[attr-defined]
    # from here on, whatever goes wrong is in the rank's log
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null_fd, 0), (log_fd, 1), (log_fd, 2)):
        os.dup2(fd, target)
    os.close(log_fd)
    os.close(null_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)    # as PYTHONUNBUFFERED=1
    die_with_parent(env)
    if namespace is not None:
        enter_namespace(namespace)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *(p for p in sys.path[1:] if p not in extra and p != cwd)]
    _reseed_numpy()
    sys.argv = [module, *args]
    # The server imported the module already; running it as __main__ again is what we want.
    warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package",
                            category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # what an interpreter does on its way out: wait for its threads, run atexit, flush
    threading._shutdown()   # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_code(code: object) -> int:
    """``sys.exit(code)``'s exit status, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _reseed_numpy() -> None:
    """Every fork inherits the server's NumPy global generator; a fresh interpreter seeds its
    own from the OS (``random`` reseeds itself after a fork; torch's default seed is fixed)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def enter_namespace(name: str) -> None:
    """Join network namespace ``name`` as ``ip netns exec`` does: the namespace, a private
    mount namespace with its own ``/sys`` (so ``/sys/class/net`` lists the host's NICs), and
    ``/etc/netns/NAME/*`` bound over ``/etc``. Only for a single-threaded process (a fresh fork)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what} for network namespace {name!r}: {os.strerror(errno)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(mount)")
    check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")
    etc = Path("/etc/netns") / name
    if etc.is_dir():
        for entry in sorted(etc.iterdir()):
            check(libc.mount(str(entry).encode(), str(Path("/etc") / entry.name).encode(), b"none", _MS_BIND, None),
                  f"bind {entry}")
