"""How long an elastic DiLoCo replica takes to heal a large outer state from a live peer.

Two processes on loopback, each a ``Membership`` (elastic DiLoCo's, around an outer optimizer) over
torchft's ``Manager`` (the real path: ``syncplane.algorithms.diloco.ft.ReplicaGroup``,
``PGTransport`` over the replica gloo group), around a Lighthouse in this process. The peer holds
θ_g of ``--params`` values and its outer optimizer's state (DiLoCo's Nesterov momentum: as many
values again), commits one round alone, then admits the joiner at its next quorum; the joiner, one
step behind, heals: θ_g, the momentum and the round position. Timed: from the peer's round boundary
(its call for the quorum the joiner is waiting in) to the joiner holding the state (quorum,
transfer, load), and the load alone. Writes ``docs/results/diloco_heal.json``.

``--ranks-per-replica L`` (> 1): each replica is a node of L processes (a gloo group of its own)
and one torchft replica group of L ranks, as elastic ``replica=node`` runs it; rank j holds
shard j (``--params``/L values and their momentum) and heals it from rank j of the peer, the
L transfers at once. Timed to the last rank holding its shard. Writes
``docs/results/diloco_heal_node.json``.

    python scripts/diloco_heal.py [--params 100000000] [--repeats 3] [--ranks-per-replica 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("diloco_heal")


def _engine(n: int, events: list[dict[str, Any]]) -> tuple[Any, Any]:
    """A replica's membership around θ_g of ``n`` values and its outer optimizer (what a heal carries)."""
    from syncplane.algorithms.diloco.elastic import Membership, QuorumTransport, fingerprint
    from syncplane.algorithms.diloco.outer import OuterOptimizer

    outer = OuterOptimizer(torch.randn(n, generator=torch.Generator().manual_seed(0)), pin=False)
    engine = Membership(QuorumTransport("127.0.0.1", 300.0), fingerprint(n, 10, "torch.optim.SGD", None, [(n,)]),
                        10, outer.state_dict, outer.load_state_dict, on_event=events.append)
    return engine, outer


def _share_port(port: int | None) -> int:
    """Rank 0's store port to the node's other ranks (``ft.ReplicaGroup``'s ``share_port``)."""
    import torch.distributed as dist

    box = [port]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _role(role: str, n: int, lighthouse: str, joining: list[Any], out: Any, rank: int = 0, ranks: int = 1,
          store: str = "") -> None:
    """The peer (commits a round alone, then admits the joiner) or the joiner (heals); with
    ``ranks`` > 1, rank ``rank`` of its node, holding shard ``rank`` of the outer state."""
    from syncplane.algorithms.diloco import ft

    torch.set_num_threads(1)
    if ranks > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    events: list[dict[str, Any]] = []
    engine, outer = _engine(n // ranks, events)
    group = ft.ReplicaGroup(role, lighthouse, engine.state_dict, engine.load_state_dict, round_timeout_s=300,
                            quorum_timeout_s=300, group_rank=rank, group_world_size=ranks,
                            share_port=_share_port if ranks > 1 else None)
    try:
        if role == "peer":
            engine.join(group)
            flat = outer.params.clone() - 0.01
            outer.begin_round_(flat)
            outer.finish_round_(flat)    # alone, Δ is the mean: a momentum buffer now exists
            engine.vote()                       # committed: the joiner is one step behind
            for event in joining:
                event.wait(timeout=300)
            time.sleep(1.0)                     # the joiner's request is in: the fast path takes it
            boundary = time.time()              # the round boundary: from here the joiner heals
            engine._next_quorum()
            out.send({"role": role, "boundary": boundary})
        else:
            joining[rank].set()
            engine.join(group)
            healed = time.time()
            heal = engine.stats.heals[-1] if engine.stats.heals else {}
            out.send({"role": role, "healed": healed, "load_s": heal.get("load_s"),
                      "bytes": heal.get("bytes"), "position": engine.position})
    finally:
        group.close()


def heal_once(n: int, ranks: int = 1) -> dict[str, Any]:
    import tempfile

    from syncplane.algorithms.diloco import ft

    lighthouse = ft.start_lighthouse("127.0.0.1", min_replicas=1, join_timeout_s=1.0)
    ctx = mp.get_context("spawn")
    joining = [ctx.Event() for _ in range(ranks)]
    roles = [(role, rank) for role in ("peer", "joiner") for rank in range(ranks)]
    pipes = {r: ctx.Pipe(duplex=False) for r in roles}
    folder = tempfile.mkdtemp(prefix="diloco_heal")
    procs = {r: ctx.Process(target=_role, args=(r[0], n, lighthouse.address, joining, pipes[r][1], r[1], ranks,
                                                f"{folder}/{r[0]}.store")) for r in roles}
    try:
        for r in roles[:ranks]:
            procs[r].start()
        time.sleep(3.0 + 2.0 * ranks)      # the peer's first quorum forms alone
        for r in roles[ranks:]:
            procs[r].start()
        results = {r: pipes[r][0].recv() for r in roles}
        for p in procs.values():
            p.join(timeout=60)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    joiners = [results[("joiner", rank)] for rank in range(ranks)]
    boundary = min(results[("peer", rank)]["boundary"] for rank in range(ranks))
    return {"role": "joiner", "load_s": max(j["load_s"] for j in joiners), "bytes": joiners[0]["bytes"],
            "position": min(j["position"] for j in joiners),
            "heal_s": round(max(j["healed"] for j in joiners) - boundary, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks-per-replica", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ranks = args.ranks_per_replica
    out = args.out or ROOT / "docs" / "results" / ("diloco_heal.json" if ranks == 1 else "diloco_heal_node.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = []
    for i in range(args.repeats):
        result = heal_once(args.params, ranks)
        assert result["position"] == 1, result     # healed: the peer's round position
        log.info("heal %d: %s", i, result)
        runs.append(result)
    heal = [r["heal_s"] for r in runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    node = ranks > 1
    where = (f"two nodes of {ranks} processes on loopback, rank j healing shard j (1/{ranks} of the state) from rank j "
             "of the peer; heal s = to the last rank holding its shard" if node else
             "two processes on loopback; heal s = to the joiner holding the state")
    doc = {"title": "Elastic DiLoCo: healing a " + ("node replica's sharded" if node else "replica's") +
                    " outer state from a live peer",
           "created": datetime.date.today().isoformat(), "commit": commit,
           "command": " ".join(["python scripts/diloco_heal.py", *sys.argv[1:]]),
           "about": (f"{args.params / 1e6:.0f}M-parameter θ_g + Nesterov momentum (fp32) over torchft's Manager "
                     f"(PGTransport on the replica gloo group), {where}, from the peer's round boundary (quorum, "
                     "transfer, load); load s = loading the received state. "
                     f"{args.repeats} runs on a shared 2-core machine (timings move 5-40 % between runs)."),
           "columns": ["parameters", *(["ranks per replica"] if node else []), "state MB" + (" per rank" if node else ""),
                       "heal s (median)", "heal s (min-max)", "load s (median)"],
           "rows": [[f"{args.params:,}", *([str(ranks)] if node else []), f"{runs[0]['bytes'] / 1e6:.0f}",
                     f"{statistics.median(heal):.2f}", f"{min(heal):.2f}-{max(heal):.2f}",
                     f"{statistics.median(r['load_s'] for r in runs):.2f}"]],
           "runs": runs}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
