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
nothing (the default group) for model data; subgroups for model data come from ``new_group``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
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
        if is_gloo(group):
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


#: The backend name of gloo subgroups that share the default group's gloo devices (``new_group``).
SHARED_GLOO = "syncplane_gloo"


def is_gloo(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default group) runs on gloo, its own devices or shared ones."""
    return dist.get_backend(group) in ("gloo", SHARED_GLOO)


def new_group(ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` for model data (a collective: every rank, in the same order).

    Under a gloo default group the new group is gloo too, and it reaches its peers through the
    default group's gloo devices (one per NIC of ``GLOO_SOCKET_IFNAME``) rather than new ones.
    It still opens connections of its own, so its traffic is still a flow of its own. Why: each
    gloo device runs an I/O thread that wakes up even when idle, and torch gives every group
    new devices. DS-Sync makes a group per pair, stream and direction; with 9 ranks on 2
    cores their wake-ups kept the cores busy (``docs/design-notes.md``). Under another default
    backend (NCCL) this is ``dist.new_group``.
    """
    members = None if ranks is None else list(ranks)
    if dist.get_backend() != "gloo":
        return dist.new_group(members)
    if not hasattr(dist.Backend, SHARED_GLOO.upper()):
        dist.Backend.register_backend(SHARED_GLOO, _shared_gloo, extended_api=True, devices=["cpu", "cuda"])
    return dist.new_group(members, backend=SHARED_GLOO)


def _shared_gloo(opts: object, backend_options: object | None) -> dist.ProcessGroupGloo:
    """torch's gloo backend factory, with the default group's devices (``new_group``)."""
    world = dist.group.WORLD
    assert world is not None
    options = dist.ProcessGroupGloo._Options()
    options._devices = world._get_backend(torch.device("cpu")).options._devices
    options._timeout = opts.timeout                                     # type: ignore[attr-defined]
    backend = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)   # type: ignore[attr-defined]
    backend.options.global_ranks_in_group = opts.global_ranks_in_group  # type: ignore[attr-defined]
    backend.options.group_name = opts.group_id                          # type: ignore[attr-defined]
    return backend


def reset() -> None:
    """Forget the control group (after ``destroy_process_group``; tests)."""
    global _owner
    _owner = None
