"""Host memory of DiLoCo's outer state per rank, ``replica: rank`` against ``replica: node``.

Runs the engines Lightning-free on real gloo ranks (nodes given as ranks per host) with an
MLP of ``--params`` values (or ``--model bert-large``: the full-size BERT-large of the
``bert_large`` recipe, 24 layers, hidden 1024, ≈335 M parameters, on random tokens): a few
inner SGD steps (with momentum for the MLP; plain for BERT-large, to keep the job small) and ``--rounds`` outer rounds,
then prints, per layout, each rank's outer-state bytes (θ_g, the outer optimizer's state and
Δ: ``outer_state_bytes``) and its peak RSS (``ru_maxrss``, which includes the interpreter and
torch: compare the layouts, not the absolute value; also shown above the RSS at the start). On
CPU the model, its gradients, DDP's buckets and FSDP's unsharded parameters are host memory
too, which on a GPU job would sit on the device. Each layout runs in fresh processes.

Before a layout starts, its host memory is estimated from the parameter count (``estimate``:
the model, its gradients, the inner momentum and the outer state, per rank); a layout whose
whole job would exceed ``--max-total-gb`` is not started, and the arithmetic is printed
instead (so the shared machine is never pushed out of memory to show that it does not fit).

    python3 scripts/diloco_replica_memory.py --ranks 4 --per-host 2 --params 8000000
    python3 scripts/diloco_replica_memory.py --model bert-large --layouts rank,node-fsdp --max-total-gb 14
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncplane.runtime.launcher import free_port


#: BERT-large's vocabulary (the recipe's default) and the random batch each inner step sees
BERT_VOCAB, BERT_BATCH, BERT_SEQ = 30522, 2, 64


class MaskedLM(torch.nn.Module):
    """The recipe's model in a LightningModule's place (FSDP2 units are its children's): the
    MLM loss of a batch of token ids."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertForMaskedLM

        from syncplane.recipes.bert_large import bert_config

        self.bert = BertForMaskedLM(bert_config("full", BERT_VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, labels=ids).loss


def _model(name: str, params: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "bert-large":
        return MaskedLM()
    width = max(8, int((params / 2) ** 0.5))    # two square layers of width x width
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))


def _loss(name: str, model: torch.nn.Module, module: torch.nn.Module) -> torch.Tensor:
    """One inner step's loss: MLM on random tokens (BERT-large), or a square of the MLP's output."""
    if name == "bert-large":
        return module(torch.randint(0, BERT_VOCAB, (BERT_BATCH, BERT_SEQ)))
    return module(torch.randn(8, model[0].in_features)).square().mean()


def estimate(params: int, layout: str, per_host: int, inner_momentum: bool) -> dict[str, float]:
    """Host bytes per rank, by arithmetic: the model and its gradients (FSDP: 1/L of each), the
    inner momentum (if any), the outer state (θ_g, outer momentum and Δ: 12 bytes per value,
    1/L of it with node replicas) and, for DDP inside a node, its gradient buckets and the rest
    of the host mirror (the gather's target). Activations and the interpreter come on top."""
    replica, inner = layout.split("-") if "-" in layout else (layout, "ddp")
    share = 1 / per_host if replica == "node" else 1.0
    model = 4 * params * (share if inner == "fsdp" else 1.0)
    parts = {"model": model, "grads": model, "inner_momentum": model if inner_momentum else 0.0,
             "outer_state": 12 * params * share}
    if replica == "node" and inner == "ddp":
        parts["ddp_buckets"] = 4 * params
        parts["mirror_rest"] = 4 * params * (1 - share)
    parts["total"] = sum(parts.values())
    return parts


def _rank(rank: int, world: int, port: int, layout: str, per_host: int, params: int, rounds: int, out: str,
          name: str) -> None:
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import node_layout
    from syncplane.algorithms.diloco.node import NodeEngine
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    job = JobContext(rank=rank, world_size=world, local_world_size=per_host)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # interpreter, torch, the groups
    model = _model(name, params)
    replica, inner = layout.split("-") if "-" in layout else (layout, "ddp")
    config = DiLoCoConfig(sync_every=2, exchange="mesh", replica=replica, inner=inner)
    if replica == "rank":
        tensors = [p.data for p in model.parameters()]
        engine, module = DiLoCoEngine(tensors, sum(t.numel() for t in tensors), config, job), model
    else:
        engine = NodeEngine(model, config, job, node_layout(replica, inner, job))
        module = engine.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if name == "bert-large" else 0.9)
    for step in range(2 * rounds):
        optimizer.zero_grad()
        _loss(name, model, module).backward()
        optimizer.step()
        if (step + 1) % 2 == 0:
            tensors = [p.data for p in model.parameters()]
            engine.launch(tensors, 0, step + 1, False, CommMeter())
            engine.merge(tensors, engine.outer.pop(0), 0.0)
    result = {"layout": layout, "rank": rank, "params": sum(p.numel() for p in model.parameters()),
              "outer_state_bytes": engine.outer_state_bytes(),
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
    parser.add_argument("--max-total-gb", type=float, default=14.0,
                        help="start a layout only if its estimated host memory, all ranks together, is below this")
    parser.add_argument("--out", default="/tmp/diloco_replica_memory")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    params = sum(p.numel() for p in _model(args.model, args.params).parameters())
    for layout in args.layouts.split(","):
        parts = estimate(params, layout, args.per_host, inner_momentum=args.model != "bert-large")
        total_gb = args.ranks * parts["total"] / 1e9
        print(f"{layout:10s} params {params:,}  estimated GB per rank "
              + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items()) + f"  (x{args.ranks} ranks: {total_gb:.1f} GB)")
        if total_gb > args.max_total_gb:
            print(f"{layout:10s} not started: {total_gb:.1f} GB > --max-total-gb {args.max_total_gb:g}")
            continue
        mp.spawn(_rank, args=(args.ranks, free_port(), layout, args.per_host, args.params, args.rounds, args.out,
                              args.model), nprocs=args.ranks)
        rows = [json.load(open(os.path.join(args.out, f"{layout}-{r}.json"))) for r in range(args.ranks)]
        print(f"{layout:10s} params {rows[0]['params']:,}  outer-state MB per rank "
              f"{[round(r['outer_state_bytes'] / 2**20, 1) for r in rows]}  peak RSS MB per rank "
              f"{[round(r['peak_rss_bytes'] / 2**20) for r in rows]}  peak RSS above the start MB "
              f"{[round((r['peak_rss_bytes'] - r['rss_before_bytes']) / 2**20) for r in rows]}")


if __name__ == "__main__":
    main()
