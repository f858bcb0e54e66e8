"""Does the order a rank posts its gloo ``isend``/``irecv`` in change how fast a swap goes?

    python scripts/posting_order.py [--cluster homogeneous8] [--pair 7,0] [--mb 8] [--repeats 6] [--json F]

On an emulated cluster (brought up if it is not; ``syncplane emulate down`` removes it), rank
``a`` and rank ``b`` of ``--pair`` swap ``--mb`` MiB on their gloo connection, each end posting
its send and its receive in either order (four cases), and rank ``a`` exchanges the same bytes
with 3 and with all of its peers (an all-to-all, H-ATC's reduce-scatter), every rank posting
sends first or receives first. Each timing is the slowest rank's, after one untimed warm-up.
Prints each case's median and range against the α-β time of ``a``'s link (its NIC rate);
``--json`` keeps every sample. What it measured on 2026-12-01 is in ``docs/design-notes.md``,
"Receives before sends".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 2**20


def cases(a: int, b: int, world: int) -> dict[str, list[tuple[int, int, float, str]]]:
    """Each case's messages: (src, dst, share of the payload, which the sender posts first --
    ``s``: its send, ``r``: its receive). A receiver posts in the same order as the sender of
    the message that comes back to it, so both ends of a pair follow one case's rule."""
    others = [r for r in range(world) if r != a]
    three = [b, *[r for r in others if r != b][:2]]

    def swap(first_a: str, first_b: str) -> list[tuple[int, int, float, str]]:
        return [(a, b, 1.0, first_a), (b, a, 1.0, first_b)]

    def all_to_all(peers: list[int], first: str) -> list[tuple[int, int, float, str]]:
        share = 1.0 / len(peers)
        return [m for p in peers for m in ((a, p, share, first), (p, a, share, first))]

    return {
        "swap, both post send first": swap("s", "s"),
        "swap, both post receive first": swap("r", "r"),
        f"swap, {a} send first, {b} receive first": swap("s", "r"),
        f"swap, {a} receive first, {b} send first": swap("r", "s"),
        "all-to-all of 3 peers, send first": all_to_all(three, "s"),
        "all-to-all of 3 peers, receive first": all_to_all(three, "r"),
        f"all-to-all of {len(others)} peers, send first": all_to_all(others, "s"),
        f"all-to-all of {len(others)} peers, receive first": all_to_all(others, "r"),
    }


def worker(out: Path, pair: tuple[int, int], nbytes: int, repeats: int) -> None:
    """One rank (run by ``launch_on_cluster`` in each host)."""
    import torch
    import torch.distributed as dist

    from syncplane.comm.timing import slowest_times

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples: dict[str, list[float]] = {}
    for name, messages in cases(*pair, world).items():
        mine = [m for m in messages if rank in m[:2]]
        # a rank posts its receives first where the case says so for the messages it sends
        first = next((f for src, _, _, f in mine if src == rank), "s")
        sends = [(dst, torch.ones(int(share * nbytes) // 4)) for src, dst, share, _ in mine if src == rank]
        recvs = [(src, torch.empty(int(share * nbytes) // 4)) for src, dst, share, _ in mine if dst == rank]

        def post(sends: list[tuple[int, torch.Tensor]] = sends, recvs: list[tuple[int, torch.Tensor]] = recvs,
                 first: str = first) -> None:
            posted_sends = [dist.isend(t, peer) for peer, t in sends] if first == "s" else []
            posted_recvs = [dist.irecv(t, peer) for peer, t in recvs]
            posted_sends += [dist.isend(t, peer) for peer, t in sends] if first == "r" else []
            for work in posted_sends + posted_recvs:
                work.wait()

        samples[name] = slowest_times(post, repeats)
    if rank == 0:
        out.write_text(json.dumps(samples))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="homogeneous8", help="a shipped profile or a YAML path")
    parser.add_argument("--pair", default="7,0", help="ranks a,b: a swaps with b, and exchanges with all")
    parser.add_argument("--mb", type=float, default=8.0, help="MiB each way")
    parser.add_argument("--repeats", type=int, default=6, help="timed repetitions of each case")
    parser.add_argument("--json", type=Path, help="also write every sample here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    a, b = (int(r) for r in args.pair.split(","))
    nbytes = int(args.mb * MIB)
    if args.worker:
        worker(args.worker, (a, b), nbytes, args.repeats)
        return
    from syncplane.cluster import load_profile
    from syncplane.cluster.cost import MBIT
    from syncplane.runtime.launcher import launch_on_cluster

    profile = load_profile(args.cluster)
    if not (0 <= a < profile.world_size and 0 <= b < profile.world_size and a != b):
        sys.exit(f"posting_order: --pair {args.pair}: two different ranks of {profile.world_size} expected")
    link_s = nbytes / (profile.host_of_rank(a).spec.nic_mbit * MBIT)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.json"
        launch_on_cluster([sys.executable, __file__, "--worker", str(out), "--pair", args.pair, "--mb", str(args.mb),
                           "--repeats", str(args.repeats)], profile, Path(tmp) / "logs")
        samples: dict[str, list[float]] = json.loads(out.read_text())
    result: dict[str, Any] = {"cluster": profile.name, "pair": [a, b], "bytes_each_way": nbytes,
                              "link_s": link_s, "tcp_congestion": profile.tcp_congestion,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "samples": samples}
    print(f"{profile.name}, rank {a}'s {nbytes / MIB:g} MiB each way; its link's α-β time {link_s:.3f} s:")
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"  {name:44s} {median:.3f} s ({min(times):.3f}-{max(times):.3f}), x{median / link_s:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
