"""DDP, the baseline: the gradient all-reduce of torch's ``DistributedDataParallel``.

The strategy is Lightning's own ``DDPStrategy`` (nothing of ours runs in training); this
package declares what the bench times for it (a bucketed ring all-reduce) and its cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncplane.algorithms.ddp.bench import DDPStep
from syncplane.job import JobContext
from syncplane.algorithms.spec import AlgorithmSpec, CostOptions, payload_bucket_streams
from syncplane.cluster.cost import Phase, ring_allreduce
from syncplane.cluster.profile import ClusterProfile

#: the strategy everything is measured against (and the plan keeps unless another is
#: clearly faster: ``plan.BASELINE_MARGIN``)
BASELINE = "ddp"


def ddp_cost(name: str, profile: ClusterProfile, payload_bytes: float, options: CostOptions) -> list[list[Phase]]:
    """One ring all-reduce of the payload per step, in the bench's buckets (``DDPStep``: one
    asynchronous all-reduce per 25 MB), priced as ``bucket_streams`` pinned rings."""
    return [ring_allreduce(profile.world_size, payload_bytes, payload_bucket_streams(profile, payload_bytes))]


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> DDPStep:
    return DDPStep()


SPEC = AlgorithmSpec(
    family="ddp",
    strategies={BASELINE: "Lightning's DDPStrategy: gradient all-reduce every step (the baseline)"},
    bench_step=_step,
    cost=ddp_cost,
    overlap={BASELINE: "backward"},   # generous to DDP: all of its buckets from the backward's start
    exact=(BASELINE,),
)
