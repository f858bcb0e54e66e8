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
from syncplane.launch import Launch

LOCK_TIMEOUT_S = 60.0


@dataclass
class _Window:
    tensor: torch.Tensor
    buffers: dict[int, torch.Tensor]
    #: writes (put / accumulate / get) into each buffer since the owner last read it
    versions: dict[int, int] = field(default_factory=dict)
    #: push-sum's associated scalar p and one p buffer per in-neighbour (BlueFog's associated p:
    #: p starts at 1 and its buffers at 0, whatever ``zero_init``)
    p: float = 1.0
    p_buffers: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)     # guards everything above
    mutex: threading.Lock = field(default_factory=threading.Lock)    # win_mutex, held across calls


_windows: dict[str, _Window] = {}

#: BlueFog's global switch: window ops also move and mix each window's associated p.
_with_associated_p = False


def _worker(rank: int) -> str:
    return f"syncplane-{rank}"


def _ensure_rpc() -> None:
    if rpc.api._is_current_rpc_agent_set():
        return
    launch = Launch.read()
    if launch.interfaces:   # tensorpipe takes its NIC from its own variable only
        os.environ.setdefault("TP_SOCKET_IFNAME", ",".join(launch.interfaces))
    address = launch.master_addr or "127.0.0.1"
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


def _remote_write(name: str, src: int, value: torch.Tensor, accumulate: bool, p: float | None = None) -> bool:
    window = _get(name)
    if src not in window.buffers:
        raise TopologyError(f"rank {src} wrote to window {name!r} of rank {dist.get_rank()}, "
                            f"which only has buffers for {sorted(window.buffers)}")
    with window.lock:
        if accumulate:
            window.buffers[src].add_(value)
        else:
            window.buffers[src].copy_(value)
        if p is not None:
            window.p_buffers[src] = window.p_buffers[src] + p if accumulate else p
        window.versions[src] += 1
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

    One buffer per in-neighbour of the static topology, initialised -- as in BlueFog --
    with a copy of the *caller's own* tensor (zeros with ``zero_init``), so
    ``win_create(x); win_update()`` returns x. Associated p starts at 1 and its buffers at
    0, with or without ``zero_init`` (BlueFog's p window), so a collect right after
    creation leaves p at 1.
    """
    _ensure_rpc()
    if not isinstance(name, str) or not name:
        raise ValueError(f"a window needs a non-empty string name, got {name!r}")
    if name in _windows:
        raise ValueError(f"window {name!r} already exists on rank {dist.get_rank()}")
    sources = context.in_neighbor_ranks()
    start = torch.zeros_like if zero_init else torch.clone
    buffers = {j: start(tensor.detach()) for j in sources}
    _windows[name] = _Window(tensor=tensor, buffers=buffers, versions={j: 0 for j in sources},
                             p_buffers={j: 0.0 for j in sources})
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


def get_current_created_window_names() -> list[str]:
    """Names of the windows that exist on this rank, sorted."""
    return sorted(_windows)


context.hold_topology_while(get_current_created_window_names)   # BlueFog: no set_topology under windows


def get_win_version(name: str) -> dict[int, int]:
    """{in-neighbour: writes into its buffer since this rank last read it with ``win_update``}."""
    window = _get(name)
    with window.lock:
        return dict(window.versions)


def turn_on_win_ops_with_associated_p() -> None:
    """Window ops also carry each window's scalar p (push-sum's weight), as in BlueFog: a
    put/accumulate overwrites/adds ``p × weight`` into the destination's p buffer and then
    scales p by ``self_weight``; ``win_update`` mixes p and the p buffers with the tensor's
    weights (also with ``clone=True``) and ``reset`` zeroes the p buffers it read; a get
    moves no p."""
    global _with_associated_p
    _with_associated_p = True


def turn_off_win_ops_with_associated_p() -> None:
    global _with_associated_p
    _with_associated_p = False


def win_associated_p(name: str) -> float:
    """This rank's associated p of window ``name`` (starts at 1)."""
    window = _get(name)
    with window.lock:
        return window.p


@dataclass
class WinHandle:
    """A launched window operation; ``win_wait(handle)`` finishes it."""

    futures: list[torch.futures.Future] = field(default_factory=list)
    finish: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    done: bool = False


def win_poll(handle: WinHandle) -> bool:
    """Whether every remote write/read of ``handle`` has completed (``win_wait`` still needed)."""
    return handle.done or all(f.done() for f in handle.futures)


def win_wait(handle: WinHandle) -> bool:
    """Wait for ``handle``'s remote operations (re-raising their errors) and release any
    mutexes it holds. Returns True."""
    if handle.done:
        return True
    try:
        for f in handle.futures:
            f.wait()
    finally:
        handle.finish.close()
        handle.done = True
    return True


def _destinations(dst_weights: Mapping[int, float] | Sequence[int] | None) -> dict[int, float]:
    out = context.out_neighbor_ranks()
    if dst_weights is None:
        return {k: 1.0 for k in out}
    destinations = topology.as_destinations(dst_weights)
    stray = sorted(set(destinations) - set(out))
    if stray:
        raise ValueError(f"dst_weights names ranks {stray}, which are not out-neighbours {out} of rank "
                         f"{dist.get_rank()} in the topology the windows were created on")
    return destinations


def _send_nonblocking(tensor: torch.Tensor, name: str, self_weight: float | None,
                      dst_weights: Mapping[int, float] | Sequence[int] | None, require_mutex: bool,
                      accumulate: bool) -> WinHandle:
    window = _get(name)
    destinations = _destinations(dst_weights)
    me = dist.get_rank()
    handle = WinHandle()
    if require_mutex:
        handle.finish.enter_context(win_mutex(name, ranks=list(destinations)))
    with window.lock:
        p = window.p if _with_associated_p else None
    try:
        handle.futures = [rpc.rpc_async(_worker(k), _remote_write,
                                        args=(name, me, tensor.detach() * s, accumulate,
                                              None if p is None else p * s))
                          for k, s in destinations.items()]
    except BaseException:
        handle.finish.close()
        raise
    if self_weight is not None:   # the scaled copies are already made: scaling now is safe
        with window.lock:
            tensor.mul_(self_weight)
            if _with_associated_p:
                window.p *= self_weight
    return handle


def win_put_nonblocking(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                        dst_weights: Mapping[int, float] | Sequence[int] | None = None,
                        require_mutex: bool = False) -> WinHandle:
    """Launch ``win_put``; finish it with ``win_wait``."""
    return _send_nonblocking(tensor, name, self_weight, dst_weights, require_mutex, accumulate=False)


def win_accumulate_nonblocking(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                               dst_weights: Mapping[int, float] | Sequence[int] | None = None,
                               require_mutex: bool = False) -> WinHandle:
    """Launch ``win_accumulate``; finish it with ``win_wait``."""
    return _send_nonblocking(tensor, name, self_weight, dst_weights, require_mutex, accumulate=True)


def win_put(tensor: torch.Tensor, name: str, self_weight: float | None = None,
            dst_weights: Mapping[int, float] | Sequence[int] | None = None, require_mutex: bool = False) -> bool:
    """Overwrite this rank's buffer in each destination's window with ``tensor × s_k``;
    then scale ``tensor`` by ``self_weight`` if given (push-style mixing). Destinations
    default to every out-neighbour with weight 1 and must be out-neighbours."""
    return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_accumulate(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                   dst_weights: Mapping[int, float] | Sequence[int] | None = None,
                   require_mutex: bool = False) -> bool:
    """Like ``win_put`` but adds into the destinations' buffers."""
    return win_wait(win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_get_nonblocking(name: str, src_weights: Mapping[int, float] | None = None,
                        require_mutex: bool = False) -> WinHandle:
    """Launch ``win_get``; the buffers are written when ``win_wait`` returns."""
    window = _get(name)
    inn = context.in_neighbor_ranks()
    sources = {int(j): float(w) for j, w in src_weights.items()} if src_weights is not None else {j: 1.0 for j in inn}
    stray = sorted(set(sources) - set(inn))
    if stray:
        raise ValueError(f"src_weights names ranks {stray}, which are not in-neighbours {inn} of rank "
                         f"{dist.get_rank()}")
    handle = WinHandle()
    if require_mutex:
        handle.finish.enter_context(win_mutex(name, ranks=list(sources)))

    def store(j: int, future: torch.futures.Future) -> None:
        value = future.wait()
        with window.lock:     # no p moves: BlueFog's get leaves the p buffers alone
            window.buffers[j].copy_(value * sources[j])
            window.versions[j] += 1

    def fetch(j: int) -> torch.futures.Future:
        return rpc.rpc_async(_worker(j), _remote_read, args=(name,)).then(lambda f, j=j: store(j, f))

    handle.futures = [fetch(j) for j in sources]
    return handle


def win_get(name: str, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False) -> bool:
    """Fetch each source's window tensor (× weight) into this rank's buffers (pull style).
    Associated p is not fetched (as in BlueFog)."""
    return win_wait(win_get_nonblocking(name, src_weights, require_mutex))


def win_update(name: str, self_weight: float | None = None, neighbor_weights: Mapping[int, float] | None = None,
               reset: bool = False, clone: bool = False, require_mutex: bool = False) -> torch.Tensor:
    """``x ← a·x + Σ_j w_j·buffer_j`` (defaults: the static topology's receive weights, or
    uniform ones after ``set_topology(..., is_weighted=False)``).

    Updates the window tensor in place and returns it (a copy with ``clone=True``, the
    window tensor untouched); ``reset`` zeroes the buffers it read. The buffers read are
    marked as seen (``get_win_version`` 0). ``require_mutex`` holds this rank's window
    mutex, so no neighbour's ``require_mutex`` write interleaves. With associated p on,
    ``p ← a·p + Σ_j w_j·p_j`` -- also with ``clone``, as in BlueFog -- and ``reset``
    zeroes the p buffers read.
    """
    window = _get(name)
    if self_weight is None and neighbor_weights is None:
        self_weight, neighbor_weights = context.recv_weights()
    if self_weight is None or neighbor_weights is None:
        raise ValueError("win_update needs both self_weight and neighbor_weights, or neither")
    stray = sorted(set(neighbor_weights) - set(window.buffers))
    if stray:
        raise ValueError(f"neighbor_weights names ranks {stray}, which are not in-neighbours "
                         f"{sorted(window.buffers)} of rank {dist.get_rank()}")
    with _own_mutex(window) if require_mutex else contextlib.nullcontext(), window.lock:
        result = window.tensor * self_weight
        p = window.p * self_weight
        for j, w in neighbor_weights.items():
            result.add_(window.buffers[j], alpha=w)
            p += w * window.p_buffers[j]
            window.versions[j] = 0
            if reset:
                window.buffers[j].zero_()
        if _with_associated_p:
            window.p = p
            if reset:
                window.p_buffers.update({j: 0.0 for j in neighbor_weights})
        if clone:
            return result
        window.tensor.copy_(result)
        return window.tensor


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """``x ← x + Σ_j buffer_j`` and zero the buffers, atomically (push-sum's collect)."""
    return win_update(name, 1.0, {j: 1.0 for j in _get(name).buffers}, reset=True, require_mutex=require_mutex)


@contextlib.contextmanager
def _own_mutex(window: _Window) -> Iterator[None]:
    if not window.mutex.acquire(timeout=LOCK_TIMEOUT_S):
        raise TimeoutError(f"own window mutex on rank {dist.get_rank()} not acquired in {LOCK_TIMEOUT_S} s")
    try:
        yield
    finally:
        window.mutex.release()


@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Hold the ``name`` window mutex of ``ranks`` (default: the out-neighbours, as in
    BlueFog; ``for_self=True``: this rank's own) for the block.

    Acquired in rank order, so two ranks locking overlapping sets cannot deadlock.
    """
    if for_self:
        chosen: Sequence[int] = [dist.get_rank()]
    else:
        chosen = ranks if ranks is not None else context.out_neighbor_ranks()
    targets = sorted(set(chosen))
    held: list[int] = []
    try:
        for r in targets:
            rpc.rpc_sync(_worker(r), _remote_mutex, args=(name, True))
            held.append(r)
        yield
    finally:
        for r in reversed(held):
            rpc.rpc_sync(_worker(r), _remote_mutex, args=(name, False))
