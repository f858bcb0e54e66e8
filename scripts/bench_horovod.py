"""Horovod's gloo all-reduce on an emulated cluster, next to syncplane's numbers.

    scripts/setup_horovod.sh                       # once: Horovod 0.28.1 + torch 2.0.1 in its own venv
    python scripts/bench_horovod.py --cluster two_racks --payload-mb resnet50 [--steps 4] [--json out.json]

Every rank runs in its emulated host (same namespaces and shaping as ``syncplane
bench``) with Horovod's own gloo rendezvous (its HTTP rendezvous server runs inside
rank 0's host). Needs root. The result is Horovod itself, measured -- not an imitation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from syncplane.bench.runner import parse_payload
from syncplane.cluster import emulator, load_profile
from syncplane.algorithms import strategy_time
from syncplane.cluster.cost import CostModel
from syncplane.launcher import RankSpec, launch

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path.home() / ".cache" / "syncplane" / "horovod-venv"

RENDEZVOUS = """
import sys, time
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
server = RendezvousServer(verbose=0)
port = server.start()
server.init(get_host_assignments(parse_hosts(sys.argv[1]), int(sys.argv[2])))
print(port, flush=True)
time.sleep(100000)
"""


@contextmanager
def _hostname_resolves_to_nic(profile):
    """Work around Horovod 0.28.1 binding its process-set gloo context to the address the
    machine's *hostname* resolves to (ignoring HOROVOD_GLOO_IFACE). ``ip netns exec NS``
    bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``, so inside each emulated host
    the hostname resolves to that host's NIC address and the context travels over the
    shaped link like every other one. The files are removed afterwards."""
    created = []
    try:
        for host in profile.hosts:
            folder = Path("/etc/netns") / emulator.host_namespace(host)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{host.address(0)} {socket.gethostname()}\n")
            created.append(folder)
        yield
    finally:
        for folder in created:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--payload-mb", default="resnet50")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--json")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Horovod venv at {args.venv}: run scripts/setup_horovod.sh first")
    profile = load_profile(args.cluster)
    payload = parse_payload(args.payload_mb)
    hosts = ",".join(f"{h.name}:{h.spec.ranks}" for h in profile.hosts)
    out_dir = Path("outputs") / "horovod" / time.strftime("%Y%m%d-%H%M%S")
    with emulator.in_use(profile), emulator.background_flows(profile, out_dir), _hostname_resolves_to_nic(profile):
        first = profile.hosts[0]
        server = subprocess.Popen(["ip", "netns", "exec", emulator.host_namespace(first), str(python), "-c",
                                   RENDEZVOUS, hosts, str(profile.world_size)], stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            if not port:
                raise SystemExit("Horovod's rendezvous server did not start")
            ranks = []
            for host in profile.hosts:
                for local, rank in enumerate(host.ranks):
                    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": first.address(0), "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
                           "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                           "HOROVOD_GLOO_IFACE": "eth0", "HOROVOD_HOSTNAME": host.name,
                           "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(profile.world_size),
                           "HOROVOD_LOCAL_RANK": str(local), "HOROVOD_LOCAL_SIZE": str(host.spec.ranks),
                           "HOROVOD_CROSS_RANK": str(host.index), "HOROVOD_CROSS_SIZE": str(len(profile.hosts)),
                           "HOROVOD_GLOO_TIMEOUT_SECONDS": "300", "HOROVOD_LOG_LEVEL": os.environ.get("HOROVOD_LOG_LEVEL", "warning")}
                    ranks.append(RankSpec(rank=rank, local_rank=local, local_world_size=host.spec.ranks,
                                          node_rank=host.index, prefix=emulator.rank_prefix(profile, rank), env=env))
            launch([str(python), str(HERE / "horovod_worker.py"), str(payload), str(args.steps), str(args.warmup)],
                   ranks, out_dir / "logs", env=dict(os.environ), echo_rank0=False)
        finally:
            server.kill()
    line = next(l for l in (out_dir / "logs" / "rank0.log").read_text().splitlines() if l.startswith("HOROVOD_RESULT"))
    result = json.loads(line.split(" ", 1)[1])
    median = statistics.median(result["step_s"])
    _, bound = strategy_time(CostModel(profile), "ddp", payload)   # Horovod's gloo all-reduce is a ring too
    report = {"cluster": profile.name, "world_size": profile.world_size, "payload_bytes": payload,
              "results": [{"strategy": "horovod_allreduce", "sync_s_median": median, "step_s": result["step_s"],
                           "bound_s": bound, "bound_ratio": bound / median}]}
    print(json.dumps(report["results"][0], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
