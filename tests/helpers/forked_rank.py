"""A rank for the fork-server tests: ``python -m tests.helpers.forked_rank MODE OUT_DIR``.

``report`` writes what the rank sees of itself (identity, environment, session, network
namespace, NICs, an unseeded NumPy draw, the objects its garbage collector leaves alone and
whether it still collects a cycle of its own) to ``OUT_DIR/rank<R>.json``; ``exit3`` exits 3;
``raise`` raises; ``sleep`` never ends on its own.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    print(f"rank {rank} says hello", flush=True)
    if mode == "report":
        import weakref

        import numpy as np

        class Node:
            pass

        cycle = Node()
        cycle.self = cycle        # type: ignore[attr-defined]
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()

        (out / f"rank{rank}.json").write_text(json.dumps({
            "argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__, "pid": os.getpid(),
            "pgid": os.getpgid(0), "sid": os.getsid(0), "world_size": os.environ["WORLD_SIZE"],
            "marker": os.environ.get("FORKED_RANK_MARKER"), "netns": os.stat("/proc/self/ns/net").st_ino,
            "nics": sorted(os.listdir("/sys/class/net")), "numpy": float(np.random.random()),
            "stdin": sys.stdin.read(), "cmdline": Path("/proc/self/cmdline").read_text(),
            "frozen": gc.get_freeze_count(), "cycle_collected": alive() is None,
        }))
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "raise":
        raise ValueError("this rank raised on purpose")
    elif mode == "sleep":
        time.sleep(600)


if __name__ == "__main__":
    main()
