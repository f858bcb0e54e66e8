"""One-sided window operations (BlueFog's ``win_*``) on ``torch.distributed.rpc``.

A *window* is a named tensor on every rank plus one buffer per in-neighbour (static
topology). Neighbours write into those buffers whenever they like -- ``win_put``
overwrites, ``win_accumulate`` adds -- or the owner pulls with ``win_get``; the owner
folds the buffers into its tensor with ``win_update`` / ``win_update_then_collect``.
No rank waits for another's progress: a remote write is served by the owner's RPC
threads, not its training loop.

Atomicity: the owner's updates and every remote write to its window take the same
per-window lock, so ``win_update_then_collect`` (read and zero the buffers) can never
lose an ``win_accumulate`` that lands concurrently -- the mass conservation push-sum
needs. ``win_mutex`` additionally lets a rank hold other ranks' windows across several
operations (``require_mutex=True`` on a put/accumulate does that for its destinations).

RPC (TensorPipe) is started on first use over the default process group's world: rank
0 picks a port and broadcasts it. It listens on the interface named by
``TP_SOCKET_IFNAME`` (set from ``GLOO_SOCKET_IFNAME`` when only that one is given).
Call ``shutdown()`` on every rank before exiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import rpc

from syncplane.comm import context, topology
from syncplane.comm.errors import TopologyError
from syncplane.net import free_port

LOCK_TIMEOUT_S = 60.0


@dataclass
class _Window:
    tensor: torch.Tensor
    buffers: dict[int, torch.Tensor]
    lock: threading.Lock = field(default_factory=threading.Lock)     # guards tensor + buffers
    mutex: threading.Lock = field(default_factory=threading.Lock)    # win_mutex, held across calls


_windows: dict[str, _Window] = {}


def _worker(rank: int) -> str:
    return f"syncplane-{rank}"


def _ensure_rpc() -> None:
    if rpc.api._is_current_rpc_agent_set():
        return
    if "GLOO_SOCKET_IFNAME" in os.environ:
        os.environ.setdefault("TP_SOCKET_IFNAME", os.environ["GLOO_SOCKET_IFNAME"])
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = [free_port(address) if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{address}:{port[0]}", num_worker_threads=16)
    rpc.init_rpc(_worker(dist.get_rank()), rank=dist.get_rank(), world_size=dist.get_world_size(),
                 rpc_backend_options=options)


def shutdown() -> None:
    """Stop RPC (collective, graceful: waits for outstanding remote writes)."""
    _windows.clear()
    if rpc.api._is_current_rpc_agent_set():
        rpc.shutdown()


def _get(name: str) -> _Window:
    try:
        return _windows[name]
    except KeyError:
        raise KeyError(f"no window named {name!r} on rank {dist.get_rank()}; create it with win_create") from None


# --------------------------------------------------------------------- remote handlers


def _remote_write(name: str, src: int, value: torch.Tensor, accumulate: bool) -> bool:
    window = _get(name)
    if src not in window.buffers:
        raise TopologyError(f"rank {src} wrote to window {name!r} of rank {dist.get_rank()}, "
                            f"which only has buffers for {sorted(window.buffers)}")
    with window.lock:
        if accumulate:
            window.buffers[src].add_(value)
        else:
            window.buffers[src].copy_(value)
    return True


def _remote_read(name: str) -> torch.Tensor:
    window = _get(name)
    with window.lock:
        return window.tensor.detach().clone()


def _remote_mutex(name: str, acquire: bool) -> bool:
    window = _get(name)
    if not acquire:
        window.mutex.release()
        return True
    if not window.mutex.acquire(timeout=LOCK_TIMEOUT_S):
        raise TimeoutError(f"window {name!r} mutex on rank {dist.get_rank()} not acquired in {LOCK_TIMEOUT_S} s")
    return True


# --------------------------------------------------------------------- public API


def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False) -> bool:
    """Register ``tensor`` (kept by reference) as window ``name``. Collective.

    Buffers exist for the static topology's in-neighbours; they start as zeros with
    ``zero_init``, otherwise as the neighbours' current tensors.
    """
    from syncplane.comm.neighbor import neighbor_allgather

    _ensure_rpc()
    if name in _windows:
        raise ValueError(f"window {name!r} already exists on rank {dist.get_rank()}")
    sources = context.in_neighbor_ranks()
    if zero_init:
        buffers = {j: torch.zeros_like(tensor) for j in sources}
    else:
        gathered = neighbor_allgather(tensor.reshape(1, -1)).reshape(len(sources), *tensor.shape)
        buffers = {j: gathered[i].clone() for i, j in enumerate(sources)}
    _windows[name] = _Window(tensor=tensor, buffers=buffers)
    dist.barrier()   # every window exists before anyone writes into it
    return True


def win_free(name: str | None = None) -> bool:
    """Release window ``name`` (all windows when None). Collective."""
    dist.barrier()   # nobody is still writing
    if name is None:
        _windows.clear()
    else:
        _get(name)
        del _windows[name]
    return True


def _destinations(dst_weights: Mapping[int, float] | Sequence[int] | None) -> dict[int, float]:
    if dst_weights is None:
        return {k: 1.0 for k in context.out_neighbor_ranks()}
    return topology.as_destinations(dst_weights)


def _send(tensor: torch.Tensor, name: str, self_weight: float | None,
          dst_weights: Mapping[int, float] | Sequence[int] | None, require_mutex: bool, accumulate: bool) -> bool:
    destinations = _destinations(dst_weights)
    me = dist.get_rank()
    with win_mutex(name, ranks=list(destinations)) if require_mutex else contextlib.nullcontext():
        futures = [rpc.rpc_async(_worker(k), _remote_write, args=(name, me, tensor.detach() * s, accumulate))
                   for k, s in destinations.items()]
        for f in futures:
            f.wait()
    if self_weight is not None:
        window = _get(name)
        with window.lock:
            tensor.mul_(self_weight)
    return True


def win_put(tensor: torch.Tensor, name: str, self_weight: float | None = None,
            dst_weights: Mapping[int, float] | Sequence[int] | None = None, require_mutex: bool = False) -> bool:
    """Overwrite this rank's buffer in each destination's window with ``tensor × s_k``;
    then scale ``tensor`` by ``self_weight`` if given (push-style mixing)."""
    return _send(tensor, name, self_weight, dst_weights, require_mutex, accumulate=False)


def win_accumulate(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                   dst_weights: Mapping[int, float] | Sequence[int] | None = None,
                   require_mutex: bool = False) -> bool:
    """Like ``win_put`` but adds into the destinations' buffers."""
    return _send(tensor, name, self_weight, dst_weights, require_mutex, accumulate=True)


def win_get(name: str, src_weights: Mapping[int, float] | None = None) -> bool:
    """Fetch each source's window tensor (× weight) into this rank's buffers (pull style)."""
    sources = src_weights if src_weights is not None else {j: 1.0 for j in context.in_neighbor_ranks()}
    window = _get(name)
    futures = {j: rpc.rpc_async(_worker(j), _remote_read, args=(name,)) for j in sources}
    for j, future in futures.items():
        value = future.wait()
        if j not in window.buffers:
            raise TopologyError(f"rank {dist.get_rank()} has no buffer for rank {j} in window {name!r}")
        with window.lock:
            window.buffers[j].copy_(value * float(sources[j]))
    return True


def win_update(name: str, self_weight: float | None = None, neighbor_weights: Mapping[int, float] | None = None,
               reset: bool = False, clone: bool = False) -> torch.Tensor:
    """``x ← a·x + Σ_j w_j·buffer_j`` (defaults: the static topology's weights).

    Updates the window tensor in place and returns it (a copy with ``clone=True``, the
    window tensor untouched); ``reset`` zeroes the buffers it read.
    """
    window = _get(name)
    if self_weight is None and neighbor_weights is None:
        self_weight, neighbor_weights, _ = topology.static_weights(context.load_topology(), dist.get_rank())
    if self_weight is None or neighbor_weights is None:
        raise ValueError("win_update needs both self_weight and neighbor_weights, or neither")
    with window.lock:
        result = window.tensor * self_weight
        for j, w in neighbor_weights.items():
            result.add_(window.buffers[j], alpha=w)
            if reset:
                window.buffers[j].zero_()
        if clone:
            return result
        window.tensor.copy_(result)
        return window.tensor


def win_update_then_collect(name: str) -> torch.Tensor:
    """``x ← x + Σ_j buffer_j`` and zero the buffers, atomically (push-sum's collect)."""
    window = _get(name)
    with window.lock:
        for buffer in window.buffers.values():
            window.tensor.add_(buffer)
            buffer.zero_()
        return window.tensor


@contextlib.contextmanager
def win_mutex(name: str, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Hold the ``name`` window mutex of ``ranks`` (default: this rank) for the block.

    Acquired in rank order, so two ranks locking overlapping sets cannot deadlock.
    """
    targets = sorted(set(ranks if ranks is not None else [dist.get_rank()]))
    held: list[int] = []
    try:
        for r in targets:
            rpc.rpc_sync(_worker(r), _remote_mutex, args=(name, True))
            held.append(r)
        yield
    finally:
        for r in reversed(held):
            rpc.rpc_sync(_worker(r), _remote_mutex, args=(name, False))
