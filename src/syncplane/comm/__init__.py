"""syncplane.comm: collective primitives on torch.distributed (no Lightning here).

The decentralized API (topology, neighbor_allreduce, ...) of design.md §4 lands on top
of these pieces: flat buckets (tensor fusion), communication accounting, and global
collectives.
"""

from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES, Bucket, make_buckets
from syncplane.comm.collectives import allreduce_mean_, mean_and_distance
from syncplane.comm.meter import CommMeter, ring_allreduce_bytes

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "CommMeter",
    "allreduce_mean_",
    "make_buckets",
    "mean_and_distance",
    "ring_allreduce_bytes",
]
