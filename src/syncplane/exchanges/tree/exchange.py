"""The tree as a stream exchange: FlexReduce's executor run by ``comm.StreamRunner`` on S
streams (DiLoCo's ``tree`` exchange), each stream all-reducing 1/S of the buffer with its own
plan, and its cost on S streams."""

from __future__ import annotations

import torch

from syncplane.cluster.cost import FlowArray, Phase, columns_of
from syncplane.cluster.profile import ClusterProfile
from syncplane.comm.codecs import Codec
from syncplane.comm.streams import Round, shard_bounds
from syncplane.exchanges.tree.cost import flexreduce_phases
from syncplane.exchanges.tree.executor import FlexReduce
from syncplane.exchanges.tree.tree import FlexTree, from_profile


class TreeExchange:
    """FlexReduce's pipelined all-reduce on ``shards`` streams. Exact fp32 only: its all-gather
    forwards the root's sums, which a lossy codec would have to carry re-encoded at every hop.
    Collective to construct (the executor checks the tree against the job)."""

    feedback_slots = 0

    def __init__(self, tree: FlexTree, shards: int = 1, *, timeout_s: float = 600.0) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        self.tree, self.streams = tree, shards
        self.executor = FlexReduce(tree, timeout_s=timeout_s, own_group=False)

    def check(self, size: int) -> None:
        if self.tree.world_size != size:
            raise ValueError(f"tree: {self.tree.describe()} covers {self.tree.world_size} ranks, the job has {size}")

    def run(self, round: Round) -> tuple[torch.Tensor, int]:
        with round.phase("clone"):     # on a copy: a failed round must leave the input as it was
            out = round.working_copy()
        round.keep.append(out)
        parts = [out[a:b] for a, b in shard_bounds(out.numel(), self.streams)]
        return out, self.executor.run_streams(parts, round.groups, round.deadline, round.keep, round.profile)

    def bytes_per_round(self, numel: int, codec: Codec, rank: int, size: int) -> int:
        return sum(self.executor.bytes_per_rank(b - a, 4) for a, b in shard_bounds(numel, self.streams) if b > a)


def cost(profile: ClusterProfile, payload_bytes: float, streams: int = 1) -> list[Phase]:
    """FlexReduce's pipelined pattern on S streams, as ``TreeExchange`` runs it: each stream
    all-reduces 1/S of the payload with its own plan, and the streams' wavefronts advance in
    lockstep -- every flow of one stream's tick, S times, at 1/S of the bytes (the same link
    loads; S flows where a per-flow cap limits one), stream s on NIC s mod k of its host."""
    phases = flexreduce_phases(from_profile(profile), payload_bytes / streams)
    made: dict[int, FlowArray] = {}   # the steady-state tick is one object: keep it one
    for phase in phases:
        if id(phase) not in made:
            src, dst, nbytes, copies = columns_of(phase)
            made[id(phase)] = FlowArray(src, dst, nbytes, copies * streams, pinned=True,
                                        chunked=isinstance(phase, FlowArray) and phase.chunked)
    return [made[id(phase)] for phase in phases]
