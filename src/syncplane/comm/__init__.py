"""syncplane.comm: collective primitives on torch.distributed (no Lightning here).

Transport only: what moves tensors between ranks, never an algorithm's policy (schedules,
patterns, outer optimizers and tuners live in ``syncplane.algorithms``).

BlueFog-compatible API (BlueFog, arXiv 2111.04287; ``docs/comm.md``)::

    import syncplane.comm as sc
    sc.set_topology(sc.topology.ExponentialTwoGraph(n))
    y = sc.neighbor_allreduce(x)                                   # y_i = Σ_j A[j, i] x_j
    y = sc.neighbor_allreduce(x, self_weight=.5, src_weights={j: .5}, dst_weights=[k])
    h = sc.neighbor_allreduce_nonblocking(x); y = h.wait()
    sc.set_machine_topology(Gm); y = sc.hierarchical_neighbor_allreduce(x)

plus flat buckets (tensor fusion), communication accounting and global collectives.
"""

from syncplane.comm import topology, window
from syncplane.comm.consensus import push_sum_average
from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES, Bucket, flat_bucket_sizes, make_buckets
from syncplane.comm.check import check_plan
from syncplane.comm.codecs import ChunkedTopK, ErrorFeedback, Fp32, GradientSketch, Int8Blockwise, make_codec
from syncplane.comm.collectives import allreduce_mean_, mean_and_distance
from syncplane.comm.context import (
    in_neighbor_ranks,
    load_topology,
    out_neighbor_ranks,
    set_machine_topology,
    set_topology,
)
from syncplane.comm.errors import TopologyError
from syncplane.comm.hierarchical import hierarchical_neighbor_allreduce, hierarchical_neighbor_allreduce_tensors
from syncplane.comm.meter import CommMeter, PhaseProfile, ring_allreduce_bytes
from syncplane.comm.neighbor import (
    allgather,
    allgather_nonblocking,
    allreduce,
    allreduce_nonblocking,
    broadcast,
    broadcast_nonblocking,
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_allreduce,
    neighbor_allreduce_nonblocking,
    neighbor_allreduce_tensors,
)
from syncplane.comm.p2p import Handle
from syncplane.comm.context import directed
from syncplane.comm.streams import Round, StreamExchange, StreamRunner, shard_bounds
from syncplane.comm.window import (
    get_current_created_window_names,
    get_win_version,
    turn_off_win_ops_with_associated_p,
    turn_on_win_ops_with_associated_p,
    win_accumulate,
    win_accumulate_nonblocking,
    win_associated_p,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_mutex,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_update,
    win_update_then_collect,
    win_wait,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "CommMeter", "Handle", "PhaseProfile", "TopologyError", "allreduce", "allreduce_mean_",
    "allreduce_nonblocking", "broadcast", "broadcast_nonblocking", "check_plan", "flat_bucket_sizes",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_tensors",
    "in_neighbor_ranks", "load_topology", "make_buckets", "mean_and_distance", "neighbor_allgather",
    "neighbor_allreduce", "neighbor_allreduce_nonblocking", "neighbor_allreduce_tensors", "out_neighbor_ranks",
    "push_sum_average", "ring_allreduce_bytes", "set_machine_topology", "set_topology", "topology",
    "win_accumulate", "win_create", "win_free", "win_get", "win_mutex", "win_put", "win_update",
    "win_update_then_collect", "window",
    # codecs and the stream runner (groups per NIC, deadline, commit/discard)
    "ChunkedTopK", "ErrorFeedback", "Fp32", "GradientSketch", "Int8Blockwise", "Round", "StreamExchange", "StreamRunner", "directed", "make_codec",
    "shard_bounds",
    # BlueFog parity (docs/comm.md compatibility table)
    "allgather", "allgather_nonblocking", "get_current_created_window_names", "get_win_version",
    "neighbor_allgather_nonblocking", "turn_off_win_ops_with_associated_p", "turn_on_win_ops_with_associated_p",
    "win_accumulate_nonblocking", "win_associated_p", "win_get_nonblocking", "win_poll", "win_put_nonblocking",
    "win_wait",
]
