"""Two emulated hosts swap a payload on one TCP connection both ways, then on one per direction.

    python scripts/swap_connections.py --cluster wan_two_sites --hosts sa0,sb0 --mb 8 --repeats 8

Plain sockets, no gloo: what the transport alone does when a pair's data goes both ways on one
connection (gloo's one connection per pair, before ``comm.context.set_one_way_links``) against
a connection per direction. Each swap: both hosts send the payload at once, timed until each has
received the other's. Brings the cluster up if it is not (``syncplane emulate down`` removes
it). Prints each mode's times per host and the α-β bound of the swap.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

PORTS = (29610, 29611)


def _recv_exactly(conn: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        data = conn.recv(min(1 << 20, n - got))
        if not data:
            raise ConnectionError("the peer closed the connection mid-swap")
        got += len(data)


def _connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((address, port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _accept(address: str, port: int) -> socket.socket:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1)
        return listener.accept()[0]


def side(role: str, mine: str, peer: str, mode: str, nbytes: int, repeats: int) -> list[float]:
    """One host's swaps: ``a`` accepts first, ``b`` connects first (so neither waits on the other)."""
    if mode == "one":
        conn = _accept(mine, PORTS[0]) if role == "a" else _connect(peer, PORTS[0])
        send, recv = conn, conn
    elif role == "a":
        send = _accept(mine, PORTS[0])
        recv = _connect(peer, PORTS[1])
    else:
        recv = _connect(peer, PORTS[0])
        send = _accept(mine, PORTS[1])
    payload, times = b"\0" * nbytes, []
    for _ in range(repeats):
        send.sendall(b"!")               # a barrier: both are ready before the clock starts
        _recv_exactly(recv, 1)
        start = time.perf_counter()
        sender = threading.Thread(target=send.sendall, args=(payload,))
        sender.start()
        _recv_exactly(recv, nbytes)
        sender.join()
        times.append(time.perf_counter() - start)
    for conn in {send, recv}:
        conn.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="wan_two_sites")
    parser.add_argument("--hosts", default="sa0,sb0", help="two host names of the profile")
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", help="also write the times here")
    parser.add_argument("--side", nargs=4, metavar=("ROLE", "MINE", "PEER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    nbytes = int(args.mb * 2**20)
    if args.side:                         # inside a host's namespace
        print(json.dumps(side(*args.side, nbytes, args.repeats)))
        return 0

    from syncplane.cluster import emulator, load_profile
    from syncplane.cluster.cost import CostModel

    profile = load_profile(args.cluster)
    names = args.hosts.split(",")
    hosts = {h.spec.name: h for h in profile.hosts}
    if len(names) != 2 or any(n not in hosts for n in names):
        parser.error(f"--hosts: two of {', '.join(hosts)}; got {args.hosts!r}")
    a, b = (hosts[n] for n in names)
    if not emulator.is_up(profile):
        emulator.up(profile)
    swap = [(a.first_rank, b.first_rank, nbytes), (b.first_rank, a.first_rank, nbytes)]
    bound = CostModel(profile).bound([swap])
    report = {"cluster": profile.name, "hosts": names, "bytes": nbytes, "bound_s": bound}
    for mode in ("one", "two"):
        procs = [subprocess.Popen(["ip", "netns", "exec", emulator.host_namespace(h), sys.executable, __file__,
                                   "--mb", str(args.mb), "--repeats", str(args.repeats),
                                   "--side", role, h.address(), peer.address(), mode],
                                  stdout=subprocess.PIPE, text=True)
                 for role, h, peer in (("a", a, b), ("b", b, a))]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"swap_connections: a side failed in mode {mode!r} (exit codes "
                             f"{[p.returncode for p in procs]})")
        times = [json.loads(out) for out in outs]
        slowest = [max(pair) for pair in zip(*times)]
        report[mode] = slowest
        label = "one connection both ways" if mode == "one" else "one connection per direction"
        print(f"{label:>30}: median {statistics.median(slowest):.3f} s, range {min(slowest):.3f}-"
              f"{max(slowest):.3f} s ({bound / statistics.median(slowest):.2f} of the {bound:.3f} s bound)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
