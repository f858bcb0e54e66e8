"""A process that syncplane's launcher starts ends with it, even when the launcher is killed
outright (SIGKILL) and cannot end it itself."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
from collections.abc import Mapping

#: The launcher's pid, given to every rank it starts (``die_with_parent``).
PARENT_ENV = "SYNCPLANE_LAUNCHER_PID"

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def die_with_parent(env: Mapping[str, str] | None = None) -> None:
    """Have the kernel SIGKILL this process when the process that started it dies (Linux's
    parent-death signal), so a launcher or torchrun agent killed outright leaves no rank
    behind. If the launcher that started us (``PARENT_ENV``) is already gone, exit now: it
    died before the signal was armed, so the signal would never come. A no-op where prctl is
    missing (not Linux)."""
    env = os.environ if env is None else env
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    launcher = env.get(PARENT_ENV)
    if launcher is not None:
        try:
            os.kill(int(launcher), 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass   # alive, owned by another user


def skip_collection_at_exit() -> None:
    """Call at a process's start: once its atexit handlers have run (this one, registered
    first, runs last), every live object is frozen, so that the interpreter's last garbage
    collection passes over them. With torch and Lightning loaded that collection takes
    seconds, after the process's work is done (docs/design-notes.md has the measurement).
    Nothing else of the exit changes: files and logs are still flushed and closed."""
    atexit.register(gc.freeze)
