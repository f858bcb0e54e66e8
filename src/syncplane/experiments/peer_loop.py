"""One rank of a comparison *peer*: the same recipe trained by another framework's sync.

    python peer_loop.py RUN_DIR/peer/peer.json      # once per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Peers (``horovod``, ``torchft_diloco``) are the yardsticks a syncplane strategy is
compared against, so they must train *exactly* what the strategies train: the parent
(``syncplane.experiments.peers``) exports the recipe's network (as a list of ``torch.nn``
layers), its initial weights, the data, every rank's sample order per epoch (what
Lightning's ``DistributedSampler`` gives that rank) and the learning rate of every step.
This file only replays them in a plain torch loop with the peer's own synchronization.

Deliberately imports nothing but the standard library, numpy and torch at module level:
Horovod 0.28.1 runs it under torch 2.0.1 in its own virtualenv, where syncplane cannot be
imported (the torchft peer, which runs in syncplane's environment, imports its store helper).
It writes the same ``history.jsonl`` and ``summary.json`` as ``syncplane.runtime.report``
(the contract comparisons read), with ``strategy`` set to the peer's name.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def build_network(spec: list[list[Any]]) -> nn.Sequential:
    """``[["Conv2d", {...}], ["ReLU", {}], ...]`` -> the ``nn.Sequential`` it describes."""
    return nn.Sequential(*(getattr(nn, name)(**kwargs) for name, kwargs in spec))


class Sync:
    """What a peer adds to the plain loop: wrapping the optimizer, its step (timed as the
    communication it waits for), and sums across ranks for the metrics."""

    name = "none"
    comm_seconds = 0.0
    bytes_sent = 0.0

    def __init__(self, cfg: dict[str, Any], rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world

    @contextlib.contextmanager
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
        yield optimizer

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        optimizer.step()

    def all_sum(self, values: list[float]) -> list[float]:
        return values

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The model validation scores: the replica itself where replicas are equal (Horovod)."""
        return model

    def all_max(self, values: list[float]) -> list[float]:
        return values

    def close(self) -> None:
        pass


class HorovodSync(Sync):
    """Horovod's ``DistributedOptimizer``: gradients all-reduced (average, gloo) during
    backward, ``step()`` waits for them. The wait inside ``step()`` is the exposed
    communication time; bytes are a ring all-reduce of the gradients per step."""

    name = "horovod"

    def __init__(self, cfg: dict[str, Any], rank: int, world: int) -> None:
        super().__init__(cfg, rank, world)
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        if (hvd.rank(), hvd.size()) != (rank, world):
            raise RuntimeError(f"horovod says rank {hvd.rank()} of {hvd.size()}, the launcher {rank} of {world}")

    @contextlib.contextmanager
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # no broadcast_optimizer_state: its state is empty here, and Horovod fills an empty
        # state with a zero-gradient step, which weight decay would turn into a real update
        yield hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        start = time.perf_counter()
        optimizer.synchronize()   # type: ignore[attr-defined]   # waits for the gradient all-reduces
        self.comm_seconds += time.perf_counter() - start
        self.bytes_sent += self.cfg["bytes_per_sync"]
        with optimizer.skip_synchronize():   # type: ignore[attr-defined]
            optimizer.step()

    def all_sum(self, values: list[float]) -> list[float]:
        out = self.hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=self.hvd.Sum, name="metrics_sum")
        return out.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        out = self.hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=self.hvd.Max, name="metrics_max")
        return out.tolist()

    def close(self) -> None:
        self.hvd.shutdown()


def _own_address(master_addr: str) -> str:
    """The address this rank reaches the master from (its emulated host's NIC, or loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))   # UDP: no packet is sent, only a route is chosen
        return str(s.getsockname()[0])


class TorchftDiLoCoSync(Sync):
    """torchft's ``DiLoCo`` (``torchft.local_sgd``): every rank is one replica group of one
    process, a ``Manager`` per replica and a ``Lighthouse`` (the quorum server, run inside
    rank 0's process on rank 0's address) -- no other service, nothing off loopback / the
    emulated hosts. A plain gloo group (the launcher's MASTER_ADDR) carries only the metrics."""

    name = "torchft_diloco"

    def __init__(self, cfg: dict[str, Any], rank: int, world: int) -> None:
        super().__init__(cfg, rank, world)
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer

        from datetime import timedelta

        self.dist = dist
        master = os.environ["MASTER_ADDR"]
        # this class runs in syncplane's own environment (torchft beside our torch), so it
        # may use syncplane's stores, which listen only on the address named
        from syncplane.net import env_store, tcp_store_server

        store = env_store(timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        me = _own_address(master)
        self.lighthouse = None
        if rank == 0:
            self.lighthouse = LighthouseServer(bind=f"{me}:0", min_replicas=world, join_timeout_ms=60_000)
            lighthouse_port = self.lighthouse.address().rsplit(":", 1)[1]
            store.set("syncplane_lighthouse", f"http://{me}:{lighthouse_port}")
        lighthouse = store.get("syncplane_lighthouse").decode()
        self.replica_store = tcp_store_server(me, 0)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        timeout = timedelta(seconds=float(cfg.get("sync_timeout_s", 600.0)))
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False,
            load_state_dict=self._load, state_dict=self._state, replica_id=f"replica{rank}",
            rank=0, world_size=1, store_addr=me, store_port=self.replica_store.port, lighthouse_addr=lighthouse,
            hostname=me, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            init_sync=False)   # every replica starts from the same exported weights

    def _state(self) -> dict[str, Any]:
        assert self.model is not None and self.optimizer is not None
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        assert self.model is not None and self.optimizer is not None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    @contextlib.contextmanager
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
        from torchft.local_sgd import DiLoCo

        self.model, self.optimizer = model, optimizer
        module, _, cls = self.cfg["outer_optimizer"].rpartition(".")
        outer = getattr(importlib.import_module(module), cls)(model.parameters(), **self.cfg["outer_kwargs"])
        with DiLoCo(self.manager, [model], optimizer, outer, sync_every=self.cfg["sync_every"],
                    backup_device=torch.device("cpu"), pin_memory=False):
            yield optimizer

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if (step + 1) % self.cfg["sync_every"]:
            optimizer.step()
            return
        start = time.perf_counter()   # this step's post-hook runs the round: quorum, all-reduce of Δ, outer step
        optimizer.step()
        self.comm_seconds += time.perf_counter() - start
        self.bytes_sent += self.cfg["bytes_per_sync"]

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The average of the replicas, which is what syncplane's ``diloco`` validates (and
        checkpoints): a comparison of the two must score the same model. Mid-round a single
        replica is worse than the average; scoring each rank's own replica put torchft's first
        validation 0.02-0.03 below ours on every seed (2026-11-23, both clusters) -- a gap in
        what was evaluated, not in training. Timed and counted as communication, as ours is."""
        start = time.perf_counter()
        average, sent = replica_average(model, self.dist)
        self.comm_seconds += time.perf_counter() - start
        self.bytes_sent += sent
        return average

    def all_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.dist.destroy_process_group()


SYNCS = {"horovod": HorovodSync, "torchft_diloco": TorchftDiLoCoSync}


def replica_average(model: nn.Module, dist: Any) -> tuple[nn.Module, int]:
    """A copy of ``model`` holding the mean over the ranks of its floating-point parameters
    and buffers (one all-reduce on the default group of ``dist``, ``torch.distributed``),
    and the bytes a ring all-reduce of them sends per rank. Training goes on from ``model``.
    Only the torchft peer calls it, in syncplane's environment (hence the import here)."""
    from syncplane.comm.meter import ring_allreduce_bytes

    average = copy.deepcopy(model)
    tensors = [t for t in (*average.parameters(), *average.buffers()) if t.is_floating_point()]
    world = dist.get_world_size()
    with torch.no_grad():
        flat = parameters_to_vector(tensors)
        dist.all_reduce(flat)
        vector_to_parameters(flat / world, tensors)
    return average, ring_allreduce_bytes(flat.numel() * flat.element_size(), world)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, sync: Sync, rank: int, world: int) -> tuple[float, float]:
    """Accuracy and mean loss over the whole validation set (of ``sync.eval_model``): each
    rank scores rows rank::world."""
    model = sync.eval_model(model)
    model.eval()
    correct = loss = 0.0
    with torch.no_grad():
        for start in range(rank, len(x), 512 * world):
            rows = torch.arange(start, min(start + 512 * world, len(x)), world)
            logits = model(x[rows])
            correct += float((logits.argmax(1) == y[rows]).sum())
            loss += float(F.cross_entropy(logits, y[rows], reduction="sum"))
    model.train()
    total_correct, total_loss = sync.all_sum([correct, loss])
    return total_correct / len(x), total_loss / len(x)


def train(cfg: dict[str, Any], rank: int, world: int) -> None:
    """The plain loop: the exported order, the exported LR per step, the peer's sync."""
    run_dir = Path(cfg["run_dir"])
    torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(int(cfg["seed"]))
    data = np.load(cfg["data"])
    train_x, train_y = torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"])
    val_x, val_y = torch.from_numpy(data["val_x"]), torch.from_numpy(data["val_y"])
    order = np.load(cfg["order"], mmap_mode="r")   # [world, epochs, samples per rank]
    lrs = np.load(cfg["lrs"])
    model = build_network(cfg["network"])
    weights = np.load(cfg["weights"])
    model.load_state_dict({k: torch.from_numpy(weights[k]) for k in weights.files})
    base = torch.optim.SGD(model.parameters(), lr=float(lrs[0]), momentum=cfg["momentum"],
                           weight_decay=cfg["weight_decay"])
    sync = SYNCS[cfg["peer"]](cfg, rank, world)
    batch, epochs = int(cfg["batch_size"]), int(cfg["epochs"])
    steps_per_epoch = order.shape[2] // batch
    step, samples, step_times = 0, 0, []
    if rank == 0:
        (run_dir / "history.jsonl").unlink(missing_ok=True)
    try:
        with sync.wrap(model, base) as optimizer:
            fit_start = time.perf_counter()
            for epoch in range(epochs):
                epoch_start = time.perf_counter()
                mine = torch.from_numpy(np.ascontiguousarray(order[rank, epoch]))
                loss_sum = 0.0
                for b in range(steps_per_epoch):
                    start = time.perf_counter()
                    rows = mine[b * batch:(b + 1) * batch]
                    for group in optimizer.param_groups:   # Horovod's wrapper is a new optimizer object
                        group["lr"] = float(lrs[step])
                    optimizer.zero_grad()
                    loss = F.cross_entropy(model(train_x[rows]), train_y[rows])
                    loss.backward()
                    sync.step(optimizer, step)
                    step += 1
                    samples += len(rows)
                    loss_sum += float(loss)
                    step_times.append(time.perf_counter() - start)
                val_acc, val_loss = evaluate(model, val_x, val_y, sync, rank, world)
                if rank == 0:
                    record = {"epoch": epoch, "step": step, "epoch_s": round(time.perf_counter() - epoch_start, 3),
                              "val_acc": val_acc, "val_loss": val_loss, "train_loss": loss_sum / max(steps_per_epoch, 1)}
                    with open(run_dir / "history.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
                    print(f"epoch {epoch + 1}/{epochs}  step {step}  val_acc {val_acc:.4f}  val_loss {val_loss:.4f}  "
                          f"({record['epoch_s']:.1f} s)", flush=True)
            train_seconds = time.perf_counter() - fit_start
        totals = sync.all_sum([float(samples), sync.comm_seconds, sync.bytes_sent])
        slowest = sync.all_max([train_seconds, *step_times])
    finally:
        sync.close()
    if rank == 0:
        seconds = max(slowest[0], 1e-9)
        summary = {
            "strategy": cfg["peer"], "recipe": cfg["recipe"], "seed": cfg["seed"], "world_size": world, "steps": step,
            "metrics": {"val_acc": val_acc, "val_loss": val_loss},
            "throughput": {"samples_per_s": totals[0] / seconds,
                           "step_s_median": statistics.median(slowest[1:]) if step_times else None,
                           "tokens_per_s": None, "model_flops_per_s": None, "mfu": None},
            "comm": {"seconds": totals[1] / world, "bytes_sent_per_rank": totals[2] / world},
            "consensus_distance": None, "train_seconds": seconds,
            "strategy_details": {"peer": cfg["peer"], "torch": torch.__version__,
                                 **({"sync_every": cfg["sync_every"], "outer_optimizer": cfg["outer_optimizer"],
                                     "outer_kwargs": cfg["outer_kwargs"]} if cfg["peer"] == "torchft_diloco" else {})},
        }
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(run_dir / "summary.json")
        print(f"summary written to {run_dir / 'summary.json'}", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python peer_loop.py RUN_DIR/peer/peer.json", file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[0]).read_text())
    train(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
