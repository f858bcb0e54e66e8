"""What every strategy does with the model's replicas, whatever its algorithm: average them
(the consensus that validation and checkpoints show), measure how far apart they are, and
agree on control decisions over the gloo control group (a vote, a barrier, a token), so
that all ranks take the same branch. Lightning-free: ``syncplane.strategies.base`` calls it,
and strategies reach the transport only through here and their own algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from syncplane.comm import DEFAULT_BUCKET_BYTES, CommMeter, PhaseProfile, allreduce_mean_, make_buckets
from syncplane.comm.collectives import agreed_token, broadcast_by_host_, control_barrier, every_rank, mean_and_distance
from syncplane.comm.process_groups import control_group

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_CONSENSUS_SKETCH", "CommMeter", "ModelReplicas", "PhaseProfile", "agreed_token", "average_",
           "broadcast_by_host_", "consensus_distance", "control_barrier", "every_rank", "module_states", "start_control"]


def start_control() -> None:
    """Create the gloo group for control collectives (a collective: call it on every rank,
    before any strategy creates groups of its own)."""
    control_group()


def module_states(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters, then buffers, that DDP's initial broadcast sends (those the module names
    in ``_ddp_params_and_buffers_to_ignore`` left out)."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    return [t for name, t in [*module.named_parameters(), *module.named_buffers()] if name not in ignore]


def average_(tensors: Sequence[torch.Tensor], bucket_bytes: int, meter: CommMeter | None = None) -> None:
    """Replace ``tensors`` by their mean over all ranks (fused into buckets of ``bucket_bytes``)."""
    allreduce_mean_(make_buckets(list(tensors), bucket_bytes), meter=meter)


#: Buckets of the count sketch that the logged consensus distance is estimated from: 256 KB
#: of float64 on the wire, about 0.6 % relative error on the distance.
DEFAULT_CONSENSUS_SKETCH = 32768


def consensus_distance(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                       sketch_buckets: int = 0) -> float:
    """``mean_i ‖xᵢ − x̄‖ / ‖x̄‖`` over ``group`` (None: all ranks; a collective; 0.0 on one
    process); estimated from a count sketch of ``sketch_buckets`` floats when that is fewer
    than the model's (0: exact)."""
    return mean_and_distance(tensors, group, sketch_buckets)


class ModelReplicas:
    """The model's tensors (parameters, then floating buffers) fused into buckets once -- the
    model's tensors do not move -- for averages of the whole replica."""

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.buckets = make_buckets(list(tensors), bucket_bytes)
        self.group = group

    def average_(self, meter: CommMeter | None = None) -> None:
        """Every rank's replica replaced by the mean over ``group`` (None: all ranks)."""
        allreduce_mean_(self.buckets, self.group, meter=meter)
