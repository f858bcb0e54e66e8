"""What ``DiLoCoEngine`` asks of the wire, injected: real gloo ranks (``GLOO``, the default), the
quorum's (elastic mode), or n ranks' engines in threads (``tests/helpers/fake_transport.py``, as
torchft's tests mock its Manager). It builds a node's groups and the outer exchanges, and runs
the collectives the engine calls itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from syncplane.algorithms.sharded import shard_module
from syncplane.comm.meter import CommMeter
from syncplane.comm.streams import StreamExchange, StreamRunner


class Exchanger(Protocol):
    """An outer exchange over fixed members: what ``StreamRunner`` offers."""

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """``runner``: the exchange ``exchange`` over ``members`` (global ranks; None: all), with
    ``StreamRunner``'s options; ``groups``: a group of each of ``sets`` (they may overlap), this
    rank's by set index; ``all_gather``/``all_reduce`` (a sum) over a group; ``wrap``: the node's
    FSDP2 (``sharded``) or DDP over its group. What builds groups or exchanges is a collective:
    every rank, same order."""

    def runner(self, exchange: StreamExchange, **options: Any) -> Exchanger: ...

    def groups(self, sets: Sequence[Sequence[int]], backend: str) -> dict[int, Any]: ...

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None: ...

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> None: ...

    def wrap(self, module: torch.nn.Module, group: Any, sharded: bool, device: str,
             device_ids: list[int] | None) -> torch.nn.Module: ...


class GlooTransport:
    """torch.distributed groups, ``StreamRunner``'s gloo streams, DDP and FSDP2 (``shard_module``)."""

    def runner(self, exchange: StreamExchange, **options: Any) -> Exchanger:
        return StreamRunner(exchange, **options)

    def groups(self, sets: Sequence[Sequence[int]], backend: str) -> dict[int, Any]:
        made = [(i, dist.new_group(sorted(s), backend=backend)) for i, s in enumerate(sets)]
        return {i: group for i, group in made if dist.get_rank() in sets[i]}

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
        dist.all_gather_into_tensor(out, tensor, group=group)

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> None:
        dist.all_reduce(tensor, group=group)

    def wrap(self, module: torch.nn.Module, group: Any, sharded: bool, device: str,
             device_ids: list[int] | None) -> torch.nn.Module:
        if sharded:
            return shard_module(module, DeviceMesh.from_group(group, device))
        return DistributedDataParallel(module, device_ids=device_ids, process_group=group)


GLOO = GlooTransport()
