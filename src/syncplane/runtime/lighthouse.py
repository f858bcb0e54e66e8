"""An elastic job's quorum service as a process of its own, for a job on an emulated cluster.

Locally the launcher runs the Lighthouse in its own process, on loopback. On an emulated
cluster the replicas live in host namespaces that cannot reach the launcher's, so the
service runs where a real cluster would run it, on a node of the job: host 0, bound to
that host's first NIC only (never a wildcard). It lives exactly as long as the launcher:
the launcher ends it with SIGTERM after the job, and the kernel kills it if the launcher
dies outright (``die_with_parent``). It reports its address as one JSON line on stdout.
The service is the one the strategy's family declares (``AlgorithmSpec.elastic``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from syncplane.algorithms import elastic_mode, elastic_settings
from syncplane.runtime.launcher import LaunchError
from syncplane.runtime.lifetime import PARENT_ENV, die_with_parent

#: How long the service may take to start (an interpreter importing torchft and torch).
START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def lighthouse_process(prefix: Sequence[str], host: str, *, strategy: str, log_file: Path,
                       env: Mapping[str, str] | None = None, min_replicas: int = 1, join_timeout_s: float = 60.0,
                       heartbeat_timeout_s: float = 5.0) -> Iterator[str]:
    """Run ``strategy``'s quorum service with ``prefix`` (``ip netns exec <host>``) bound to
    ``host``; yields its address. Its log (the service's warnings) goes to ``log_file``."""
    command = [*prefix, sys.executable, "-m", "syncplane.runtime.lighthouse", "--strategy", strategy, "--host", host,
               "--min-replicas", str(min_replicas), "--join-timeout-s", str(join_timeout_s),
               "--heartbeat-timeout-s", str(heartbeat_timeout_s)]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as log_out:
        proc = subprocess.Popen(command, env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_out,
                                start_new_session=True)
        try:
            yield _read_address(proc, log_file)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _read_address(proc: subprocess.Popen[bytes], log_file: Path) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    try:
        return str(json.loads(line)["address"])
    except (ValueError, KeyError):
        proc.kill()
        proc.wait()
        tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise LaunchError(f"the elastic quorum service did not start within {START_TIMEOUT_S:.0f} s "
                          f"(exit code {proc.returncode}); its log {log_file}:\n{tail}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncplane.runtime.lighthouse",
                                     description="Serve an elastic job's quorum until SIGTERM.")
    parser.add_argument("--strategy", required=True, help="the elastic job's strategy (its family's service)")
    parser.add_argument("--host", required=True, help="the one address to bind (a NIC's, or 127.0.0.1)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--join-timeout-s", type=float, default=60.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    elastic = elastic_mode(args.strategy)
    if elastic is None:
        parser.error(f"--strategy {args.strategy}: not a strategy with an elastic mode "
                     f"({', '.join(elastic_settings()) or 'none'})")
    die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    service = elastic.start(args.host, min_replicas=args.min_replicas, join_timeout_s=args.join_timeout_s,
                            heartbeat_timeout_s=args.heartbeat_timeout_s)
    print(json.dumps({"address": service.address}), flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
