"""DiLoCo's one round engine, Lightning-free: every layout, schedule, codec, exchange and pacing.

A replica is the L ranks of a node, DDP or FSDP2 inside it (``layout.ReplicaLayout``; one rank
per replica: nodes of one rank, the same code path). The flat model ``[parameters | floating
buffers]`` (under FSDP, this rank's shards) is mirrored on the host and cut into the layout's
outer shards; this rank keeps its shards' θ_g and outer state (``FragmentedOuter``; blocking
rounds are P = 1, τ = 0) and exchanges each shard with its owners in the other replicas. A
round of fragment f: each owned piece of f copied to the host, Δ formed in place, averaged,
outer stepped and merged into the live model at the due step; a DDP node's ranks then
all-gather the fragment's pieces. A discarded piece keeps θ_local (the next Δ covers it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.cost import resolve_streams
from syncplane.algorithms.diloco.exchange import build_exchange
from syncplane.algorithms.diloco.layout import ReplicaLayout
from syncplane.algorithms.diloco.streaming import FragmentedOuter, Round, fragment_bounds
from syncplane.algorithms.diloco.transport import GLOO, Exchanger, Transport
from syncplane.algorithms.sharded import local, materialize, on_meta
from syncplane.comm.host_mirror import HostMirror
from syncplane.comm.meter import CommMeter
from syncplane.comm.streams import reserve_key, shard_bounds
from syncplane.exchanges import GatherExchange, MeshExchange
from syncplane.job import JobContext


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What the outer rounds work on: the parameters (under FSDP, this rank's shards), then the floating buffers."""
    return [local(p.data) for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]


#: Values per rank per all-gather of a node's θ_g pieces (the staging: (L + 1) x 16 MB at most).
GATHER_CHUNK = 1 << 22


def _runs(buffer: torch.Tensor, spans: Sequence[tuple[int, int]], at: int, data: torch.Tensor,
          into_runs: bool) -> None:
    """Copy between ``data`` and the values ``[at, at + len(data))`` of ``buffer``'s spans read in turn
    (``into_runs``: into the spans; else out of them, a short tail of ``data`` left as is)."""
    for a, b in spans:
        lo, hi = max(a, a + at), min(b, a + at + data.numel())   # a + at: where data[0] falls
        if lo < hi:
            part = data[lo - a - at:hi - a - at]
            (buffer[lo:hi].copy_(part) if into_runs else part.copy_(buffer[lo:hi]))
        at -= b - a


def parameter_module(tensors: Sequence[torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``tensors`` (sharing their storage): the bench's and tests' model."""
    module = torch.nn.Module()
    for i, tensor in enumerate(tensors):
        module.register_parameter(f"t{i}", torch.nn.Parameter(tensor))
    return module


def shard_interfaces(interfaces: Sequence[str], shard: int) -> tuple[str, ...]:
    """The host's NICs rotated by ``shard``: a node's L exchanges at once start on different NICs."""
    if not interfaces:
        return ()
    turn = shard % len(interfaces)
    return (*interfaces[turn:], *interfaces[:turn])


class DiLoCoEngine:
    """A collective to construct (node groups, shard streams): every rank, same order.

    Args:
        module: the model; node replicas wrap it (``module``: DDP over the node, or FSDP2) -- train that.
        job, layout: this rank, its NICs and profile (``streams: auto``); the replicas (``job_layout``).
        device_ids: DDP's, for a model on a GPU.
        init: a model on the meta device (``inner: fsdp`` only): the values by name
            (``sharded.materialize``), so that no rank holds the whole model; shards made on CPU.
        transport: the groups, exchanges and collectives (``transport.GLOO``: real gloo ranks)."""

    def __init__(self, module: torch.nn.Module, config: DiLoCoConfig, job: JobContext, layout: ReplicaLayout,
                 device_ids: list[int] | None = None, init: Callable[[str, torch.Tensor], None] | None = None,
                 transport: Transport = GLOO) -> None:
        self.config, self.layout, self.rank, self.transport = config, layout, job.rank, transport
        self.node = layout.nodes[layout.replica_of(job.rank)]
        self.sharded = layout.inner == "fsdp"   # the FSDP shard is this rank's whole outer share
        on_gpu = next(module.parameters()).device.type == "cuda"
        meta = on_meta(module)
        if meta and (init is None or not self.sharded):
            raise ValueError("a model on the meta device needs inner='fsdp' and an init: each rank then "
                             "makes only its own shards (sharded.materialize)")
        self.module, self.consensus_group = module, None
        self.gather_group: Any = None
        if not layout.per_rank:
            replica = layout.replica_of(job.rank)
            self.gather_group = transport.groups(layout.nodes, "gloo")[replica]
            self.inner_group = transport.groups(layout.nodes, "nccl")[replica] if on_gpu else self.gather_group
            self.module = transport.wrap(module, self.inner_group, self.sharded, "cuda" if on_gpu else "cpu",
                                         device_ids)
        if meta:
            materialize(self.module, init, "cpu")
        tensors = local_tensors(module)
        n_params = sum(local(p.data).numel() for p in module.parameters())
        self.host = HostMirror(tensors)   # DDP nodes: the gather target, the replica's whole model
        self.host.to_host(tensors)
        total = self.host.buffer.numel()
        self.gathers = not self.sharded and len(self.node) > 1   # a DDP node: its ranks all-gather θ_g's pieces
        self.runs: dict[int, list[tuple[int, int]]] = {}   # FSDP on uneven nodes: each set's spans of the buffer
        # _sharded / _pieces set owned, members, flats (each part's outer buffer), n_params and local (fragments)
        self.pieces = self._sharded(module, n_params, total) if self.sharded else self._pieces(total, n_params)
        if meta:   # every node takes the first node's values, as a model built whole takes rank 0's
            self._over_sets(tensors, mean=False)
        self.outers = {k: FragmentedOuter(self.flats[k], self.n_params[k], config.fragments, config.sync_every,
                                          config.outer_optimizer, config.outer_kwargs, pin=self.host.on_gpu,
                                          rule=config.outer, bounds=self.pieces[k])
                       for k in self.owned}
        starts = [a for k in self.owned for a, _ in self.pieces[k]]
        cuts = [lo for runs in self.runs.values() for lo, _ in runs] or starts
        self.host.check_cuts(tensors, sorted(({a for a, _ in self.local} | set(cuts)) - {0}))
        self.weight = layout.weight(job.rank)
        self.streams = resolve_streams(config.streams, job, config.topology, config.exchange, config.compression)
        self.runners, self.exchange_name = self._runners(job, n_params)

    # ------------------------------------------------------------ construction

    def _pieces(self, total: int, n_params: int) -> dict[int, list[tuple[int, int]]]:
        """Each outer shard's piece of each fragment in the host buffer: each fragment (the even cut
        of the model, whatever the layout, so a DDP node runs the per-rank schedule) cut into the
        layout's S shards, piece k of every fragment owned by shard k's rank."""
        fragments = fragment_bounds(n_params, total - n_params, self.config.fragments)
        shards = self.layout.shards
        self.owned = list(self.layout.owned(self.rank))
        self.members = {k: self.layout.shard_group(k) for k in self.owned}
        self.flats = {k: self.host.buffer for k in self.owned}
        self.n_params = {k: n_params for k in self.owned}
        if any(b - a < shards for a, b in fragments):
            raise ValueError(f"fragments={self.config.fragments}: a fragment of this model has fewer values than "
                             f"the {shards} outer shards of a node; use fewer fragments")
        cut = [[(a + s, a + e) for s, e in shard_bounds(b - a, shards)] for a, b in fragments]
        self.local = fragments
        return {k: [pieces[k] for pieces in cut] for k in range(shards)}

    def _sharded(self, module: torch.nn.Module, n_params: int, total: int) -> dict[int, list[tuple[int, int]]]:
        """FSDP2 nodes: this rank's exchange sets (``ReplicaLayout.fsdp_units``) and each one's piece of
        each fragment (the even cut of the whole model). A set's spans, read in turn, are its outer
        buffer: the host buffer itself when this rank is in one set (nodes of one size), else a packed
        copy. Builds the sets' groups and the consensus group (the ranks of the nodes of this one's
        size holding the same rows): collectives."""
        layout, node = self.layout, self.node
        shapes = [tuple(p.shape) for p in module.parameters()]
        self.sets, spans = layout.fsdp_units(self.rank, shapes, total - n_params)
        self.owned = sorted(spans)
        self.members = {k: self.sets[k] for k in self.owned}
        self.flats = {k: self.host.buffer for k in self.owned}
        self.set_groups = self.transport.groups(self.sets, "gloo")
        alike = sorted({(len(nd), i) for nd in layout.nodes for i in range(len(nd))})
        groups = self.transport.groups([[nd[i] for nd in layout.nodes if len(nd) == n] for n, i in alike], "gloo")
        self.consensus_group = groups[alike.index((len(node), node.index(self.rank)))]
        whole = sum(math.prod(shape) for shape in shapes)
        fragments = fragment_bounds(whole, total - n_params, self.config.fragments)

        def at(runs: Sequence[tuple[int, int, int]], g: int) -> int:   # values of ``runs`` before global g
            return sum(min(max(g - start, 0), hi - lo) for lo, hi, start in runs)

        everything = sorted({run for runs in spans.values() for run in runs})
        self.local = [(at(everything, a), at(everything, b)) for a, b in fragments]
        if len(self.owned) > 1:
            self.runs = {k: [(lo, hi) for lo, hi, _ in spans[k]] for k in self.owned}
            self.flats = {k: torch.zeros(at(spans[k], whole + total - n_params)) for k in self.owned}
            for k in self.owned:   # θ_g starts as the model
                self._pack(k, 0, self.flats[k].numel(), into_host=False)
        self.n_params = {k: at(spans[k], whole) for k in self.owned}
        return {k: [(at(spans[k], a), at(spans[k], b)) for a, b in fragments] for k in self.owned}

    def _pack(self, k: int, start: int, end: int, into_host: bool) -> None:
        """Copy ``[start, end)`` of set k's packed buffer from (or into) its spans of the host buffer."""
        _runs(self.host.buffer, self.runs[k], start, self.flats[k][start:end], into_runs=into_host)

    def _over_sets(self, tensors: Sequence[torch.Tensor], mean: bool) -> None:
        """Every owned set's values over its members into the live model: the exact mean (``mean``),
        or the first member's (the others send zeros)."""
        self.host.to_host(tensors)
        for k in self.owned:
            if self.runs:
                self._pack(k, 0, self.flats[k].numel(), into_host=False)
            values = self.flats[k]
            if not mean and self.rank != self.sets[k][0]:
                values.zero_()
            self.transport.all_reduce(values, self.set_groups[k])
            if mean:
                values.div_(len(self.sets[k]))
            if self.runs:
                self._pack(k, 0, values.numel(), into_host=True)
        self.host.from_host(tensors)

    def average_model_(self, tensors: Sequence[torch.Tensor]) -> None:
        """The replicas' exact mean in place of this rank's values (validation's consensus under FSDP
        on uneven nodes, where no group holds the same values on every node)."""
        self._over_sets([local(t) for t in tensors], mean=True)

    def _runners(self, job: JobContext, n_params: int) -> tuple[dict[int, Exchanger], str]:
        """Each owned shard's exchange: one rank per replica, ``build_exchange``'s over every rank; node
        replicas, the mesh over its owners, or the gather (the floating buffers as exact fp32)."""
        config = self.config
        if self.layout.per_rank:
            runner, name = build_exchange(job, self.streams, config.compression, config.block_size,
                                          config.sync_timeout_s, config.exchange, config.topology,
                                          codec=config.codec(), error_feedback_beta=config.error_feedback,
                                          exact_from=n_params, make=self.transport.runner)
            return {self.owned[0]: runner}, name
        key = reserve_key("diloco-node")
        sparse = config.compression == "sparse" or config.exchange == "gather"
        runners = {}
        for k in self.owned:
            exact_from = self.n_params[k] if self.runs else sum(max(0, min(b, n_params) - a) for a, b in self.pieces[k])
            pattern = GatherExchange(self.streams, exact_from) if sparse else MeshExchange(self.streams)
            runners[k] = self.transport.runner(pattern, codec=config.codec(), error_feedback_beta=config.error_feedback,
                                      interfaces=shard_interfaces(job.interfaces, k), timeout_s=config.sync_timeout_s,
                                      members=self.members[k], key=f"{key}/shard{k}")
        return runners, "gather" if sparse else "mesh"

    # ------------------------------------------------------------ the schedule

    def starting(self, done: int) -> list[int]:
        """Fragments whose round starts once ``done`` steps are complete."""
        return self.outers[self.owned[0]].starting(done)

    def launch(self, tensors: Sequence[torch.Tensor], fragment: int, due: int, background: bool,
               meter: CommMeter, scale: float | None = None) -> None:
        """Start fragment ``fragment``'s round from the live model on every owned shard, merged at
        step ``due``. ``scale``: this rank's factor on its Δ (and floating buffers), so that the plain
        mean is the weighted one (``TimedRounds.scale``); None: the rank count's (``layout.weight``)."""
        tensors = [local(t) for t in tensors]
        weight = self.weight if scale is None else scale
        for k in self.owned:
            start, end = self.pieces[k][fragment]
            # the piece of the host buffer (or of the set's packed copy) is reused in place for Δ and the result
            if self.runs:
                self.host.to_host(tensors, *self.local[fragment])
                self._pack(k, start, end, into_host=False)
            else:
                self.host.to_host(tensors, start, end)
            runner, sizes = self.runners[k], [b - a for a, b in self.pieces[k]]
            # the piece's place in the shard's exchanges, its pieces one after another (error feedback is per place)
            offset, total = sum(sizes[:fragment]), sum(sizes)

            def average_(flat: torch.Tensor, _: int, runner: Exchanger = runner, offset: int = offset,
                         total: int = total) -> bool:
                if weight != 1.0:
                    flat.mul_(weight)
                return runner.allreduce_mean_(flat, meter, offset=offset, total=total)

            self.outers[k].launch(fragment, average_, due=due, background=background)

    def wait(self) -> None:
        """Complete the exchanges in flight and their outer steps; the merges stay at their step."""
        for outer in self.outers.values():
            outer.wait()

    def pop(self, fragment: int) -> Round:
        """Wait for and remove the fragment's round on every owned shard; committed if all were."""
        rounds = [self.outers[k].pop(fragment) for k in self.owned]
        return Round(fragment, rounds[0].due, committed=all(bool(r.committed) for r in rounds),
                     parts={k: bool(r.committed) for k, r in zip(self.owned, rounds)})

    def pop_due(self, done: int) -> list[Round]:
        """The rounds to merge once ``done`` steps are complete (waited for, removed)."""
        pending = self.outers[self.owned[0]].pending
        return [self.pop(p) for p in sorted(pending) if pending[p].due <= done]

    def merge(self, tensors: Sequence[torch.Tensor], round_: Round, alpha: float) -> bool:
        """A finished round into the live model; True if every owned piece committed. A discarded
        piece keeps θ_local; a DDP node then all-gathers the fragment's pieces (the ranks agree)."""
        tensors = [local(t) for t in tensors]
        fragment = round_.fragment
        parts = round_.parts if round_.parts is not None else {k: bool(round_.committed) for k in self.owned}
        if not self.runs and not self.gathers:   # each committed piece where it is
            for k in self.owned:
                if parts[k]:
                    self.host.from_host(tensors, *self.pieces[k][fragment], alpha=alpha)
            return bool(round_.committed)
        if self.runs:   # every committed set's spans, around the others' θ_local
            self.host.to_host(tensors, *self.local[fragment])
            for k in self.owned:
                if parts[k]:
                    self._pack(k, *self.pieces[k][fragment], into_host=True)
        else:
            for k in self.owned:
                if not parts[k]:
                    self.host.to_host(tensors, *self.pieces[k][fragment])
            self._gather(fragment)
        self.host.from_host(tensors, *self.local[fragment], alpha=alpha)   # the whole fragment
        return bool(round_.committed)

    def _gather(self, fragment: int) -> None:
        """Every rank of the node gets the fragment's pieces of θ_g: all-gathers of each rank's owned
        pieces (read as one run, padded to the widest rank's), ``GATHER_CHUNK`` values at a time."""
        spans = [[self.pieces[k][fragment] for k in self.layout.owned(r)] for r in self.node]
        width = max(sum(b - a for a, b in s) for s in spans)
        if width == 0:
            return
        step = min(width, GATHER_CHUNK)
        mine, out = torch.zeros(step), torch.empty(len(self.node) * step)
        own = spans[self.node.index(self.rank)]
        for c in range(0, width, step):
            n = min(step, width - c)
            mine.zero_()
            _runs(self.host.buffer, own, c, mine[:n], into_runs=False)
            self.transport.all_gather(out[: len(self.node) * n], mine[:n], self.gather_group)
            for i, s in enumerate(spans):
                _runs(self.host.buffer, s, c, out[i * n:(i + 1) * n], into_runs=True)

    def adopt(self, tensors: Sequence[torch.Tensor]) -> None:
        """The live model's parameters take this rank's θ_g (an elastic heal replaced it; buffers stay)."""
        self._into_model(tensors, lambda values, params, at: values.copy_(params))

    def rebase(self, tensors: Sequence[torch.Tensor], old: torch.Tensor) -> None:
        """The live model's parameters moved by θ_g's change since ``old`` (an earlier ``params``): a late
        replica healed keeps its work on top, its next Δ being the one it would have sent against ``old``."""
        self._into_model(tensors, lambda values, params, at: values.add_(params - old[at:at + params.numel()]))

    def _into_model(self, tensors: Sequence[torch.Tensor],
                    change: Callable[[torch.Tensor, torch.Tensor, int], None]) -> None:
        """``change(values, θ_g, at)`` on the live model's values of each owned piece (``at``: its place
        in ``params``). A DDP node: a collective, its ranks all-gathering their changed pieces."""
        tensors = [local(t) for t in tensors]
        if self.gathers:
            self.host.to_host(tensors)   # the others' pieces and the buffers, carried by the gather unchanged
        at = 0
        for k in self.owned:
            for (a, _), outer in zip(self.outers[k].bounds, self.outers[k].outers):
                n = outer.params.numel()
                if not self.gathers:
                    self.host.to_host(tensors, a, a + n)
                change(self.host.buffer[a:a + n], outer.params, at)
                if not self.gathers:
                    self.host.from_host(tensors, a, a + n)
                at += n
        if self.gathers:
            for fragment in range(len(self.local)):
                self._gather(fragment)
            self.host.from_host(tensors)

    @property
    def exchange_ran(self) -> dict[str, Any]:
        """The exchange settings as they run (``config.EXCHANGE_KEYS``; no ``auto``, old names mapped)."""
        return {"streams": int(self.streams), "exchange": self.exchange_name, "compression": self.config.compression}

    @property
    def params(self) -> torch.Tensor:
        """This rank's θ_g: its owned shards in order (one rank per replica: the whole model's)."""
        return torch.cat([self.outers[k].params for k in self.owned])

    # ------------------------------------------------------------ state

    def outer_state_bytes(self) -> int:
        """θ_g, the outer optimizer's state and Δ this rank keeps: about 1/L of a per-rank replica's."""
        state = sum(o.state_bytes() for f in self.outers.values() for o in f.outers)
        return state + 4 * sum(b - a for k in self.owned for a, b in self.pieces[k])

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares (call ``wait`` first): one rank per replica, the outer state and the
        rounds waiting to merge; node replicas, the layout (their outer state is ``rank_state_dict``'s)."""
        if self.layout.per_rank:
            return self.outers[self.owned[0]].state_dict()
        return {"replicas": self.layout.sizes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.layout.per_rank:
            if "replicas" in state and "outer" not in state:
                raise ValueError(f"the checkpoint was written with replicas of {state['replicas']} ranks, this "
                                 "run has one rank per replica: resume with the same replica setting")
            self.outers[self.owned[0]].load_state_dict(state)
        elif list(state.get("replicas", [])) != self.layout.sizes:
            raise ValueError(f"the checkpoint was written with replicas of {state.get('replicas', [1])} ranks, "
                             f"this run has {self.layout.sizes}: replica='node' resumes on the same nodes")

    def shard_state_dict(self) -> dict[str, Any]:
        """The outer state this rank holds, which an elastic heal carries (not the residuals, the rank's
        own): one rank per replica ``state_dict``, node replicas its shards'. Call ``wait`` first."""
        if self.layout.per_rank:
            return self.state_dict()
        return {"shards": list(self.owned), "outer": [self.outers[k].state_dict() for k in self.owned]}

    def load_shard_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.layout.per_rank:
            self.load_state_dict(state)
            return
        if list(state["shards"]) != self.owned:
            raise ValueError(f"the state (a checkpoint's or a peer's) holds shards {state['shards']}, rank "
                             f"{self.rank} owns {self.owned}")
        for k, outer in zip(self.owned, state["outer"]):
            self.outers[k].load_state_dict(outer)

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own state: its exchanges' residuals, and with node replicas its outer shards."""
        if self.layout.per_rank:
            return {"exchange": self.runners[self.owned[0]].state_dict()}
        return {**self.shard_state_dict(), "exchange": [self.runners[k].state_dict() for k in self.owned]}

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if self.layout.per_rank:
            self.runners[self.owned[0]].load_state_dict(state.get("exchange", {}))
            return
        self.load_shard_state_dict(state)
        for k, exchange in zip(self.owned, state["exchange"]):
            self.runners[k].load_state_dict(exchange)

    def close(self) -> None:
        """Stop the background work and the exchanges (the state stays readable)."""
        for outer in self.outers.values():
            outer.close()
        for runner in self.runners.values():
            runner.close()
