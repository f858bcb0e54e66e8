"""DiLoCo with a node as one replica (``replica: node``), Lightning-free.

Inside a node, torch's DDP over the node's ranks (``inner_group``: NCCL on GPUs, gloo on
CPU) keeps the node's ranks one model; or FSDP2's ``fully_shard`` over them, where a rank's
DiLoCo shard is its FSDP parameter shard (no gather of parameters at all: shard j's group is
the j-th ranks of every node, which needs nodes of one size). Across nodes, rank j of a node keeps only its shards
of the outer state (``layout.ReplicaLayout``: θ_g and the outer optimizer per shard, Δ formed
in place in the host mirror) and exchanges each with that shard's owners in the other nodes,
on a ``StreamRunner`` of its own (its own gloo groups: L exchanges at once per node, on the
host's NICs in turn, with the deadline and commit/discard of every DiLoCo exchange): the
mesh (fp32, int8), or with ``compression: sparse`` the gather of each shard's top-k pieces,
its error feedback kept per shard by its owner. With DDP, after
the round one all-gather on the node's gloo group rebuilds the replica's whole θ_g, which
is copied into the model.

A shard whose exchange was discarded keeps the replica's θ_local there (the owner puts it
back before the gather): its group skipped the round on every replica, nothing is lost.
With one rank per node the round is ``DiLoCoEngine``'s, bit for bit (one shard: the whole
model, on a mesh -- or the gather, for sparse -- over every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.engine import host_mirror
from syncplane.algorithms.diloco.layout import ReplicaLayout
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco.streaming import Round
from syncplane.algorithms.sharded import local, materialize, on_meta, shard_module
from syncplane.cluster.cost import FlowArray, Phase, concurrent_group_allreduces
from syncplane.comm.codecs import Codec
from syncplane.comm.meter import CommMeter
from syncplane.comm.streams import StreamRunner, reserve_key
from syncplane.exchanges import GatherExchange, MeshExchange
from syncplane.job import JobContext


#: Values per all-gather of the replica's θ_g (its staging: (L + 1) x 16 MB at most).
GATHER_CHUNK = 1 << 22


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a replica's outer round works on: the parameters (this rank's shard of each, under
    FSDP), then the floating buffers."""
    return [local(p.data) for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]


def shard_interfaces(interfaces: Sequence[str], shard: int) -> tuple[str, ...]:
    """The NICs of shard ``shard``'s streams: the host's, rotated by the shard, so that the L
    exchanges a node runs at once start on L different NICs where it has several (stream s of
    shard k on NIC (k + s) mod k_nics; every member of a shard group rotates alike)."""
    if not interfaces:
        return ()
    turn = shard % len(interfaces)
    return (*interfaces[turn:], *interfaces[:turn])


def node_groups(layout: ReplicaLayout, backend: str) -> dist.ProcessGroup:
    """This rank's node group on ``backend`` (a collective: every rank builds every node's)."""
    mine, _ = dist.new_subgroups_by_enumeration([list(node) for node in layout.nodes], backend=backend)
    return mine


class NodeEngine:
    """A collective to construct (node groups, shard streams): every rank, same order.

    Args:
        module: the model; the engine wraps it (``module``: DDP over the node, or the same
            module sharded by FSDP2's ``fully_shard``) -- train the wrapped one.
        config: the validated settings (plain rounds: fragments 1, no overlap).
        job: the job's shape (this rank, the NICs).
        layout: the node replicas and the shard owner map.
        device_ids: DDP's, for a model on a GPU.
        init: for a model built on the meta device (``inner: fsdp`` only): each parameter's and
            buffer's values by name (``sharded.materialize``), so that no rank ever holds the
            whole model; the shards are made on CPU.
    """

    def __init__(self, module: torch.nn.Module, config: DiLoCoConfig, job: JobContext, layout: ReplicaLayout,
                 device_ids: list[int] | None = None, init: Callable[[str, torch.Tensor], None] | None = None) -> None:
        self.config, self.layout, self.rank = config, layout, job.rank
        self.sync_every = config.sync_every
        on_gpu = next(module.parameters()).device.type == "cuda"
        meta = on_meta(module)
        if meta and (init is None or layout.inner != "fsdp"):
            raise ValueError("a model on the meta device needs inner='fsdp' and an init: each rank then "
                             "makes only its own shards (sharded.materialize)")
        self.gather_group = node_groups(layout, "gloo")
        self.inner_group = node_groups(layout, "nccl") if on_gpu else self.gather_group
        self.module = self._wrap(module, "cuda" if on_gpu else "cpu", device_ids)
        #: FSDP: the ranks that hold this rank's shard in every node (the consensus averages over
        #: them); DDP: None (all ranks: a node's ranks are one model, weighted by their count)
        self.consensus_group = (dist.new_subgroups_by_enumeration(
            [list(layout.shard_group(k)) for k in range(layout.shards)], backend="gloo")[0]
            if layout.inner == "fsdp" else None)
        if meta:
            materialize(self.module, init, "cpu")
            # every node takes the first node's values of this shard, as a model built whole
            # takes rank 0's: the nodes agree even where their ranks' seeds did not
            src = layout.shard_group(layout.owned(job.rank)[0])[0]
            for tensor in local_tensors(self.module):
                dist.broadcast(tensor, src=src, group=self.consensus_group)
        tensors = local_tensors(module)
        n_params = sum(local(p.data).numel() for p in module.parameters())
        self.host = host_mirror(tensors)      # DDP: the gather target, the replica's whole model
        total = self.host.buffer.numel()
        self.sharded = layout.inner == "fsdp"   # the FSDP shard is this rank's whole outer share
        self.owned = list(layout.owned(job.rank))
        self.bounds = {k: (0, total) for k in self.owned} if self.sharded else dict(enumerate(layout.bounds(total)))
        self.span = (self.bounds[self.owned[0]][0], self.bounds[self.owned[-1]][1])
        self.weight = layout.weight(job.rank)
        pin = self.host.on_gpu
        self.outers = {k: OuterOptimizer(self.host.buffer[a:max(a, min(b, n_params))], config.outer_optimizer,
                                         config.outer_kwargs, pin=pin, rule=config.outer)
                       for k, (a, b) in ((k, self.bounds[k]) for k in self.owned)}
        key = reserve_key("diloco-node")
        shards = 1 if config.shards == "auto" else int(config.shards)
        self.runners = {k: StreamRunner(self._exchange(shards, n_params - self.bounds[k][0]),
                                        codec=config.codec(),
                                        error_feedback_beta=config.error_feedback,
                                        interfaces=shard_interfaces(job.interfaces, k),
                                        timeout_s=config.sync_timeout_s,
                                        members=layout.shard_group(k), key=f"{key}/shard{k}")
                        for k in self.owned}
        self.shards, self.exchange_name = shards, "gather" if config.compression == "sparse" else "mesh"
        self.pending: dict[int, Round] = {}

    def _exchange(self, streams: int, exact_from: int) -> MeshExchange | GatherExchange:
        """A shard's exchange: the mesh (fp32, int8), or for ``compression: sparse`` the gather of
        its top-k pieces (a sum of them would be dense), the shard's floating buffers (from
        ``exact_from`` on, in the shard's own positions) as exact fp32, as ``DiLoCoEngine`` sends them."""
        if self.config.compression == "sparse":
            return GatherExchange(streams, max(0, exact_from))
        return MeshExchange(streams)

    def _wrap(self, module: torch.nn.Module, device: str, device_ids: list[int] | None) -> torch.nn.Module:
        """``inner: ddp``: torch's DDP over the node; ``fsdp``: FSDP2's ``fully_shard`` over it (in place,
        ``sharded.shard_module``'s units)."""
        if self.layout.inner == "fsdp":
            return shard_module(module, DeviceMesh.from_group(self.inner_group, device))
        return DistributedDataParallel(module, device_ids=device_ids, process_group=self.inner_group)

    # ------------------------------------------------------------ the schedule (P = 1, τ = 0)

    def starting(self, done: int) -> list[int]:
        """The (one) fragment whose round starts once ``done`` steps are complete."""
        return [0] if done % self.sync_every == 0 else []

    def launch(self, tensors: Sequence[torch.Tensor], fragment: int, due: int, background: bool,
               meter: CommMeter, scale: float = 1.0) -> None:
        """One round of every owned shard: Δ, the weighted mean over its group, the outer step.
        ``scale`` (``DiLoCoEngine.launch``'s per-rank weight for ``inner_steps: time``) must be 1:
        a node's weight is its rank count, and the config refuses the time mode with nodes."""
        if scale != 1.0:
            raise ValueError(f"replica=node weighs nodes by their rank count; a per-rank scale {scale} "
                             "(inner_steps=time) is not supported")
        tensors = [local(t) for t in tensors]
        committed = [self._shard_round(tensors, k, meter) for k in self.owned]
        self.pending[fragment] = Round(fragment, due, committed=all(committed))

    def pop(self, fragment: int) -> Round:
        return self.pending.pop(fragment)

    def pop_due(self, done: int) -> list[Round]:
        return [self.pending.pop(p) for p in sorted(self.pending) if self.pending[p].due <= done]

    def wait(self) -> None:
        """Rounds run blocking: nothing is ever in flight."""

    def merge(self, tensors: Sequence[torch.Tensor], round_: Round, alpha: float) -> bool:
        """The replica's θ_g gathered from its ranks into the live model; True if every owned shard
        committed. Always gathers: a discarded shard carries θ_local, the node's ranks agree."""
        if not self.sharded:
            self._gather()
        self.host.from_host([local(t) for t in tensors], alpha=alpha)
        return bool(round_.committed)

    @property
    def outer(self) -> NodeEngine:
        """The schedule and outer state (``DiLoCoEngine.outer``'s interface)."""
        return self

    @property
    def params(self) -> torch.Tensor:
        """This rank's θ_g shards (concatenated in shard order)."""
        return torch.cat([self.outers[k].params for k in self.owned])

    # ------------------------------------------------------------ state

    def outer_state_bytes(self) -> int:
        """θ_g, the outer optimizer's state and the Δ this rank keeps: about 1/L of ``replica: rank``'s."""
        return sum(o.state_bytes() for o in self.outers.values()) + 4 * (self.span[1] - self.span[0])

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: the layout (the outer state is per rank: ``rank_state_dict``)."""
        return {"replicas": self.layout.sizes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state.get("replicas", [])) != self.layout.sizes:
            raise ValueError(f"the checkpoint was written with replicas of {state.get('replicas')} ranks, this run "
                             f"has {self.layout.sizes}: replica='node' resumes on the same nodes")

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's outer shards and their exchanges' error-feedback residuals."""
        return {"shards": list(self.owned), "outer": [self.outers[k].state_dict() for k in self.owned],
                "exchange": [self.runners[k].state_dict() for k in self.owned]}

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if list(state["shards"]) != self.owned:
            raise ValueError(f"the checkpoint gives rank {self.rank} shards {state['shards']}, it owns {self.owned}")
        for k, outer, exchange in zip(self.owned, state["outer"], state["exchange"]):
            self.outers[k].load_state_dict(outer)
            self.runners[k].load_state_dict(exchange)

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()

    # ------------------------------------------------------------ internals

    def _shard_round(self, tensors: Sequence[torch.Tensor], k: int, meter: CommMeter) -> bool:
        a, b = self.bounds[k]
        self.host.to_host(list(tensors), a, b)
        runner = self.runners[k]

        def average_(flat: torch.Tensor) -> bool:
            if self.weight != 1.0:
                flat.mul_(self.weight)
            return runner.allreduce_mean_(flat, meter)

        if self.outers[k].round_(self.host.buffer[a:b], average_):
            return True
        self.host.to_host(list(tensors), a, b)   # discarded: θ_local back in place of Δ
        return False

    def _gather(self) -> None:
        """Every rank of the node gets the whole θ_g: an all-gather of the owned spans (padded to
        the widest), in pieces of ``GATHER_CHUNK`` values so that its staging stays small."""
        node = self.layout.nodes[self.layout.replica_of(self.rank)]
        if len(node) == 1:
            return
        spans = [(self.bounds[o[0]][0], self.bounds[o[-1]][1]) for o in map(self.layout.owned, node)]
        width = max(b - a for a, b in spans)
        step = min(width, GATHER_CHUNK)
        mine, out = torch.zeros(step), torch.empty(len(node) * step)
        for c in range(0, width, step):
            n = min(step, width - c)
            a, b = self.span
            own = self.host.buffer[min(a + c, b):min(a + c + n, b)]
            mine[: own.numel()].copy_(own)
            dist.all_gather_into_tensor(out[: len(node) * n], mine[:n], group=self.gather_group)
            for i, (a_i, b_i) in enumerate(spans):
                part = self.host.buffer[min(a_i + c, b_i):min(a_i + c + n, b_i)]
                part.copy_(out[i * n: i * n + part.numel()])


# ---------------------------------------------------------------- the price (``syncplane simulate``, plan, bench)


def node_cost(layout: ReplicaLayout, payload_bytes: float, period: int, streams: int, codec: Codec,
              gather: bool = False) -> list[list[Phase]]:
    """One round of ``period`` steps of ``replica: node`` (inner DDP) as the cost model's flows.

    Every step, torch's DDP all-reduces the gradient inside each node (a ring on loopback).
    At the round's end, the shards' meshes run at once: node a sends node b the b-th part of
    each of its S shards, M/N in all, in each of the mesh's two phases (so a node sends
    2(N−1)/N·M per round per direction across: M between two nodes), on S x ``streams``
    connections, pinned to the host's NICs in turn; then each node's ranks all-gather the
    replica's θ_g over loopback. ``gather`` (``compression: sparse``): the shards' gathers
    instead, one phase in which a node sends every other node its encoded shards."""
    inner = concurrent_group_allreduces(layout.nodes, payload_bytes)
    across = shard_exchange_cost(layout, payload_bytes, streams, codec, gather)
    return [inner + across + gather_cost(layout, payload_bytes)] + [list(inner) for _ in range(period - 1)]


def shard_exchange_cost(layout: ReplicaLayout, payload_bytes: float, streams: int, codec: Codec,
                        gather: bool = False) -> list[Phase]:
    """The S shard groups' meshes together: two phases in which every node sends every other
    node M/N (``codec``'s size of it) over S x ``streams`` pinned flows (module doc of
    ``node_cost``); or their gathers: one phase of all of M's encoded pieces to every other node."""
    n = len(layout.nodes)
    if n < 2:
        return []
    numel = max(int(payload_bytes // 4), 1)
    flows = layout.shards * streams
    if gather:
        coded = sum(codec.nbytes(b - a) for a, b in layout.bounds(numel))
    else:
        coded = payload_bytes * codec.nbytes(numel) / (4 * numel) / n
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    src = np.array([layout.nodes[a][0] for a, _ in pairs], dtype=np.int64)
    dst = np.array([layout.nodes[b][0] for _, b in pairs], dtype=np.int64)
    step = FlowArray(src, dst, np.full(len(pairs), coded / flows), np.full(len(pairs), flows, dtype=np.int64),
                     pinned=True)
    return [step] if gather else [step, step]


def gather_cost(layout: ReplicaLayout, payload_bytes: float) -> list[Phase]:
    """``NodeEngine._gather``: every rank of a node sends its span of θ_g (fp32) to the others."""
    numel = max(int(payload_bytes // 4), 1)
    bounds = layout.bounds(numel)
    flows = [(rank, other, 4.0 * (bounds[layout.owned(rank)[-1]][1] - bounds[layout.owned(rank)[0]][0]))
             for node in layout.nodes for rank in node for other in node if other != rank]
    return [flows] if flows else []
