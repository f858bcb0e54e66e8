"""The process groups a job talks on, by kind of traffic: one place creates and owns them.

Two kinds of traffic cross the ranks:

- **model data** -- parameters, gradients, buckets, the payloads of neighbour exchanges.
  They travel on the default process group (or subgroups of it), whose backend suits the
  device the model lives on: NCCL for CUDA tensors (Lightning makes the default group NCCL
  on GPUs), gloo for CPU tensors.
- **control** -- small CPU-side collectives: the topology check, consensus distance,
  group adjustments and pair-stream trials, SWA and replica gathers, the bandwidth probe,
  run-summary totals, barriers. NCCL refuses CPU tensors ("No backend type associated with
  device type cpu", seen on an H100 at the first topology check), so these go over a gloo
  group made for them, on every device alike -- also on CPU jobs, where the default group
  is gloo already: one code path, and a test can make the data group refuse control
  traffic (``tests/helpers/traffic.py``) to prove nothing control-like rides it.

Strategies never choose a backend: they call ``control_group()`` for control and pass
nothing (the default group) for model data.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger(__name__)

#: The default group the cached control group belongs to, and the control group itself.
#: Keyed on the default group so that a re-initialized job (tests, a new fit after
#: ``destroy_process_group``) never reuses a dead group.
_owner: tuple[object, dist.ProcessGroup] | None = None


def control_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The gloo group for control collectives over the ranks of ``group`` (default: all).

    The world's control group is created on first use -- ``new_group`` is a collective,
    so the first call must happen on every rank in the same order relative to other
    groups; ``SyncplaneStrategy`` calls it at setup, before any strategy creates groups.
    A subgroup that is gloo already (a NIC-bound stream group) is its own control group;
    a control group for another subgroup does not exist, and asking for one is an error
    rather than a hidden collective.
    """
    global _owner
    if group is not None and group is not dist.group.WORLD:
        if dist.get_backend(group) == "gloo":
            return group
        raise ValueError(f"no control group for a {dist.get_backend(group)} subgroup of ranks "
                         f"{dist.get_process_group_ranks(group)}: control collectives run over all ranks")
    world = dist.group.WORLD
    if _owner is None or _owner[0] is not world:
        control = dist.new_group(backend="gloo")
        log.debug("control group: gloo over %d ranks (default group backend: %s)",
                  dist.get_world_size(), dist.get_backend())
        _owner = (world, control)
    return _owner[1]


def reset() -> None:
    """Forget the control group (after ``destroy_process_group``; tests)."""
    global _owner
    _owner = None
