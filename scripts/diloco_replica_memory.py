"""Host memory of DiLoCo's outer state per rank, ``replica: rank`` against ``replica: node``.

Runs the engines Lightning-free on real gloo ranks (nodes given as ranks per host) with an
MLP of ``--params`` values (or ``--model bert-large``: the ``bert_large`` recipe's full-size
BERT-large, 24 layers, hidden 1024, ≈335 M parameters, or its width with ``--layers`` layers,
on random tokens): a few inner SGD steps (with momentum for the MLP; plain for BERT-large, to
keep the job small) and ``--rounds`` outer rounds, then prints, per layout, each rank's
outer-state bytes (θ_g, the outer optimizer's state and Δ: ``outer_state_bytes``), its peak
RSS (``ru_maxrss``, which includes the interpreter and torch; also shown above the RSS at the
start), and for two ranks the resident and peak MB after each phase (rank 0's as it happens,
so a run the kernel stops for memory still says how far it got). On CPU the model, its
gradients, DDP's buckets and FSDP's unsharded parameters are host memory too, which on a GPU
job would sit on the device. Each layout runs in fresh processes.

An FSDP layout builds the model on the meta device and each rank makes only its own shards
(``sharded.materialize``, BERT's initialization seeded per tensor), so no rank ever holds the
whole model; ``--no-meta`` builds it whole on every rank first.

Before a layout starts, its peak host memory is estimated from the parameter count
(``estimate``); a layout whose whole job would exceed ``--max-total-gb`` is not started, and
the arithmetic is printed instead (so the shared machine is never pushed out of memory to
show that it does not fit).

    python3 scripts/diloco_replica_memory.py --ranks 4 --per-host 2 --params 8000000
    python3 scripts/diloco_replica_memory.py --model bert-large --layers 12 --layouts rank,node-fsdp --max-total-gb 19
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncplane.runtime.launcher import free_port


#: BERT-large's vocabulary (the recipe's default) and the random batch each inner step sees
BERT_VOCAB, BERT_BATCH, BERT_SEQ = 30522, 2, 64


class MaskedLM(torch.nn.Module):
    """The recipe's model in a LightningModule's place (FSDP2 units are its children's): the
    MLM loss of a batch of token ids."""

    def __init__(self, layers: int | None = None) -> None:
        super().__init__()
        from transformers import BertForMaskedLM

        from syncplane.recipes.bert_large import bert_config

        config = bert_config("full", BERT_VOCAB)
        if layers is not None:
            config.num_hidden_layers = layers
        self.bert = BertForMaskedLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, labels=ids).loss


def _model(name: str, params: int, layers: int | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "bert-large":
        return MaskedLM(layers)
    width = max(8, int((params / 2) ** 0.5))    # two square layers of width x width
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))


def _loss(name: str, model: torch.nn.Module, module: torch.nn.Module) -> torch.Tensor:
    """One inner step's loss: MLM on random tokens (BERT-large), or a square of the MLP's output."""
    if name == "bert-large":
        return module(torch.randint(0, BERT_VOCAB, (BERT_BATCH, BERT_SEQ)))
    return module(torch.randn(8, model[0].in_features)).square().mean()


def bert_init(name: str, tensor: torch.Tensor) -> None:
    """BERT's initialization of one tensor, made whole (``sharded.materialize``), its randomness
    seeded by the tensor's name: weights N(0, 0.02) with the padding row of the word
    embeddings 0, LayerNorm weights 1, biases 0; the position ids 0..n-1, token types 0."""
    with torch.no_grad():
        if name.endswith("position_ids"):
            tensor.copy_(torch.arange(tensor.shape[-1]).expand_as(tensor))
        elif name.endswith("LayerNorm.weight"):
            tensor.fill_(1.0)
        elif tensor.dim() < 2 or not tensor.is_floating_point():
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            if name.endswith("word_embeddings.weight"):
                tensor[0].zero_()


def _rss_mb(rank: int, phase: str) -> tuple[int, int]:
    """(this process's resident MB now, its peak so far), shown as it happens for rank 0 (a
    job the kernel stops for memory still says how far it got)."""
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * resource.getpagesize() // 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    if rank == 0:
        print(f"  rank 0 {phase}: {now} MB resident, peak {peak} MB", flush=True)
    return now, peak


def estimate(params: int, layout: str, per_host: int, inner_momentum: bool, ranks: int,
             base: float = 0.0) -> dict[str, float]:
    """Host bytes per rank at the peak, by arithmetic: ``base`` (the interpreter, torch, gloo and
    the model's library), the model and its gradients (FSDP: 1/L of each), the inner momentum
    (if any), the outer state (θ_g, outer momentum and Δ: 12 bytes per value, 1/L of it with
    node replicas), for DDP inside a node its gradient buckets and the rest of the host mirror
    (the gather's target), and the mesh's working buffers during a round (its result, the
    pieces it receives in both phases and the owner's sum: (1 + 2(n−1)/n + 1/n) times the
    span a rank exchanges, n the replicas). Activations come on top."""
    replica, inner = layout.split("-") if "-" in layout else (layout, "ddp")
    share = 1 / per_host if replica == "node" else 1.0
    replicas = ranks // per_host if replica == "node" else ranks
    model = 4 * params * (share if inner == "fsdp" else 1.0)
    parts = {"base": base, "model": model, "grads": model, "inner_momentum": model if inner_momentum else 0.0,
             "outer_state": 12 * params * share}
    if replica == "node" and inner == "ddp":
        parts["ddp_buckets"] = 4 * params
        parts["mirror_rest"] = 4 * params * (1 - share)
    parts["exchange"] = 4 * params * share * (1 + 2 * (replicas - 1) / replicas + 1 / replicas)
    parts["total"] = sum(parts.values())
    return parts


def _rank(rank: int, world: int, port: int, layout: str, per_host: int, params: int, rounds: int, out: str,
          name: str, layers: int | None, meta: bool) -> None:
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import job_layout
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    job = JobContext(rank=rank, world_size=world, local_world_size=per_host)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # interpreter, torch, the groups
    phases = {"start": _rss_mb(rank, "start")}
    replica, inner = layout.split("-") if "-" in layout else (layout, "ddp")
    meta = meta and inner == "fsdp"     # only FSDP shards can be made without the whole model
    with torch.device("meta" if meta else "cpu"):
        model = _model(name, params, layers)
    phases["model"] = _rss_mb(rank, "model built")
    config = DiLoCoConfig(sync_every=2, exchange="mesh", replica=replica, inner=inner)
    engine = DiLoCoEngine(model, config, job, job_layout(replica, inner, job), init=bert_init if meta else None)
    module = engine.module
    phases["engine"] = _rss_mb(rank, "engine built")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if name == "bert-large" else 0.9)
    losses = []
    for step in range(2 * rounds):
        optimizer.zero_grad()
        loss = _loss(name, model, module)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
        phases[f"step {step + 1}"] = _rss_mb(rank, f"step {step + 1}")
        if (step + 1) % 2 == 0:
            tensors = [p.data for p in model.parameters()]
            engine.launch(tensors, 0, step + 1, False, CommMeter())
            engine.merge(tensors, engine.pop(0), 0.0)
            phases[f"round {(step + 1) // 2}"] = _rss_mb(rank, f"round {(step + 1) // 2}")
    result = {"layout": layout, "rank": rank, "params": sum(p.numel() for p in model.parameters()),
              "outer_state_bytes": engine.outer_state_bytes(), "losses": losses, "phases": phases, "meta": meta,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before_bytes": before}
    engine.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"{layout}-{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--params", type=int, default=8_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="rank,node,node-fsdp")
    parser.add_argument("--model", choices=["mlp", "bert-large"], default="mlp")
    parser.add_argument("--layers", type=int, default=None, help="BERT-large's width with this many layers (24 by default)")
    parser.add_argument("--no-meta", dest="meta", action="store_false",
                        help="build the whole model on every rank before FSDP shards it (by default an FSDP layout "
                             "builds it on the meta device and each rank makes only its shards)")
    parser.add_argument("--max-total-gb", type=float, default=14.0,
                        help="start a layout only if its estimated host memory, all ranks together, is below this")
    parser.add_argument("--base-gb", type=float, default=1.1,
                        help="per rank, before any tensor: the interpreter, torch, gloo and transformers "
                             "(1.1 GB measured here at the first phase of a BERT-large run)")
    parser.add_argument("--out", default="/tmp/diloco_replica_memory")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in _model(args.model, args.params, args.layers).parameters())
    for layout in args.layouts.split(","):
        parts = estimate(params, layout, args.per_host, args.model != "bert-large", args.ranks, args.base_gb * 1e9)
        total_gb = args.ranks * parts["total"] / 1e9
        print(f"{layout:10s} params {params:,}  estimated GB per rank "
              + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items()) + f"  (x{args.ranks} ranks: {total_gb:.1f} GB)")
        if total_gb > args.max_total_gb:
            print(f"{layout:10s} not started: {total_gb:.1f} GB > --max-total-gb {args.max_total_gb:g}")
            continue
        mp.spawn(_rank, args=(args.ranks, free_port(), layout, args.per_host, args.params, args.rounds, args.out,
                              args.model, args.layers, args.meta), nprocs=args.ranks)
        rows = [json.load(open(os.path.join(args.out, f"{layout}-{r}.json"))) for r in range(args.ranks)]
        print(f"{layout:10s} params {rows[0]['params']:,}  outer-state MB per rank "
              f"{[round(r['outer_state_bytes'] / 2**20, 1) for r in rows]}  peak RSS MB per rank "
              f"{[round(r['peak_rss_bytes'] / 2**20) for r in rows]}  peak RSS above the start MB "
              f"{[round((r['peak_rss_bytes'] - r['rss_before_bytes']) / 2**20) for r in rows]}  losses (rank 0) "
              f"{rows[0]['losses']}")
        for r in rows[:2]:
            print(f"{layout:10s} rank {r['rank']} MB (now, peak) by phase: "
                  + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in r["phases"].items()))


if __name__ == "__main__":
    main()
