"""What a running job listens on: its processes' TCP listeners, polled with ``ss`` until it exits."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (forked ranks are the fork server's children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def listeners_until_exit(proc: subprocess.Popen[str]) -> tuple[list[str], int]:
    """Poll ``ss -ltnp`` until ``proc`` exits: (the lines of its processes' listeners on an address
    other than loopback, how many of its listeners were seen at all)."""
    exposed, seen = [], 0
    while proc.poll() is None:
        ours = descendants(proc.pid)
        for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
            pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            if pids & ours:
                seen += 1
                local = line.split()[3]
                if not (local.startswith("127.") or local.startswith("[::1]")):
                    exposed.append(line)
        time.sleep(0.2)
    return exposed, seen
