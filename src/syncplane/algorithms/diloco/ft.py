"""Elastic replica groups on torchft: the quorum service (its Lighthouse) and, per replica, a
torchft ``Manager``. torchft decides membership from heartbeats, rebuilds the gloo group per
quorum (a dead peer never wedges the next round) and heals a replica that is behind from a live
peer. What we add:

- **Loopback only.** The heal goes over the replica gloo group (``PGTransport``, not an HTTP
  server on every interface); the Manager's RPC server binds our address, not ``[::]``.
- **A replica is a process, or a node's L processes**: one torchft replica group (``group_rank``
  = the local rank; why one group: docs/design-notes.md), its TCP store on its rank 0. Its ranks
  are in or out of a quorum together and vote one commit; the quorum's store and gloo group are
  per group rank, so local rank j exchanges and heals its own outer shard among the local ranks
  j of the quorum's nodes.
- **Blocking quorum** (``use_async_quorum=False``): a joiner is healed before the round starts.
- **The round's own groups**: the engine's exchange averages, not torchft's all-reduce (``elastic``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch

from syncplane.net import tcp_store_server

log = logging.getLogger(__name__)


class ElasticUnavailable(RuntimeError):
    """torchft is missing (``pip install 'syncplane[ft]'``)."""


def _require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError as exc:   # pragma: no cover - the ft extra is installed by make setup
        raise ElasticUnavailable("elastic=true needs torchft: pip install 'syncplane[ft]' (torchft==0.2.0)") from exc


def check_bind_host(host: str) -> str:
    """Refuse a wildcard bind: the quorum service must listen on loopback or on the one
    address the user named (it accepts joins from anyone who can reach it)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"elastic lighthouse_host: {host!r} is not an IP address "
                         "(use 127.0.0.1 or a NIC's address)") from None
    if ip.is_unspecified:
        raise ValueError(f"elastic lighthouse_host: {host!r} would listen on every interface; "
                         "give 127.0.0.1 or one NIC's address")
    return str(ip)


@dataclass
class Lighthouse:
    """A running quorum service (torchft's ``LighthouseServer``) and its address."""

    server: Any
    address: str

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(host: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1,
                     join_timeout_s: float = 60.0, heartbeat_timeout_s: float = 5.0) -> Lighthouse:
    """Start the quorum service in this process, bound to ``host:port`` only. ``join_timeout_s``:
    how long a quorum waits for a heartbeating replica that has not asked to join yet (one at the
    end of its round); ``heartbeat_timeout_s``: silence after which a replica no longer counts."""
    _require_torchft()
    from torchft.coordination import LighthouseServer

    host = check_bind_host(host)
    server = LighthouseServer(bind=_host_port(host, port), min_replicas=min_replicas,
                              join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=100,
                              heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    # the server reports its hostname; replicas must dial the address it is bound to
    address = "http://" + _host_port(host, server.address().rsplit(":", 1)[1])
    log.info("elastic: lighthouse on %s (min_replicas=%d, join %.1f s, heartbeat %.1f s)",
             address, min_replicas, join_timeout_s, heartbeat_timeout_s)
    return Lighthouse(server, address)


def _host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- torchft internals
# ``_bound_manager_server`` is the one torchft internal relied on (the quorum's id, store and
# ranks come from the public ``ProcessGroup.configure``: ``_recording_gloo``);
# tests/unit/test_torchft_pin.py fails clearly when the installed torchft is another version.
TORCHFT_VERSION = "0.2.0"

_PATCH_LOCK = threading.Lock()


def torchft_version() -> str:
    """The installed torchft's version (its distribution metadata)."""
    from importlib.metadata import version

    return version("torchft")


@contextlib.contextmanager
def _bound_manager_server(host: str) -> Iterator[None]:
    """While a ``Manager`` is built, its RPC server binds ``host``, not the ``[::]`` torchft 0.2.0
    hard-codes (the Manager looks the class up in ``torchft.manager``: swapping that name is enough)."""
    import torchft.manager as tm

    original = tm.ManagerServer

    def bound(**kwargs: Any) -> Any:
        return original(**{**kwargs, "bind": _host_port(host, kwargs["bind"].rsplit(":", 1)[1])})

    with _PATCH_LOCK:
        tm.ManagerServer = bound   # type: ignore[assignment]
        try:
            yield
        finally:
            tm.ManagerServer = original   # type: ignore[assignment]


@dataclass
class QuorumView:
    """One quorum as this replica sees it: its id, size, this replica's rank and the store its
    members' groups rendezvous on (``store_addr``: ``host:port/prefix``, the quorum's own)."""

    quorum_id: int
    participants: int
    step: int
    rank: int = 0
    store_addr: str = ""


def _recording_gloo(timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group, noting the quorum's id, store and ranks at each
    ``configure`` (the ``Manager`` calls it at every membership change, within ``start_quorum``)."""
    from torchft.process_group import ProcessGroupGloo

    class RecordingGloo(ProcessGroupGloo):
        configured: tuple[str, int, int] | None = None   # store_addr, rank, quorum_id

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, *args: Any, **kwargs: Any) -> None:
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
            self.configured = (store_addr, rank, -1 if quorum_id is None else int(quorum_id))

    return RecordingGloo(timeout=timeout)


class ReplicaGroup:
    """This replica's quorum, commit vote and heal, over a torchft ``Manager``.

    Args:
        replica_id: a stable name (``replica3``); torchft tells a restart from its dead
            predecessor by a fresh suffix.
        state_dict / load_state_dict: what a healing replica receives from a live peer.
        round_timeout_s: the commit vote and the heal give up after it; ``quorum_timeout_s``: the
            wait for a quorum (a joiner's: up to the others' next boundary).
        min_replicas: a round with fewer members does not commit (the Lighthouse's own keeps such
            a quorum from forming).
        group_rank, group_world_size: a node replica's local rank and size (its ranks build their
            ``ReplicaGroup`` at once); ``share_port``: rank 0 calls it with its store's port, the
            others with None, and each gets rank 0's back (a broadcast over the node).
    """

    def __init__(self, replica_id: str, lighthouse: str, state_dict: Callable[[], Any],
                 load_state_dict: Callable[[Any], None], *, host: str = "127.0.0.1",
                 round_timeout_s: float = 30.0, quorum_timeout_s: float = 120.0, min_replicas: int = 1,
                 group_rank: int = 0, group_world_size: int = 1,
                 share_port: Callable[[int | None], int] | None = None) -> None:
        _require_torchft()
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager

        self.host = host = check_bind_host(host)
        timeout = timedelta(seconds=round_timeout_s)
        self._store = tcp_store_server(host, 0) if group_rank == 0 else None
        port = self._store.port if self._store is not None else None
        if group_world_size > 1:
            if share_port is None:
                raise ValueError("a replica group of several ranks needs share_port (rank 0's store port)")
            port = share_port(port)
        self._pg = _recording_gloo(timeout)
        transport = PGTransport(self._pg, timeout=timeout, device=torch.device("cpu"))
        with _bound_manager_server(host):
            self.manager = Manager(
                pg=self._pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replicas,
                use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=30), heartbeat_interval=timedelta(seconds=0.1), rank=group_rank,
                world_size=group_world_size, store_addr=host, store_port=port, lighthouse_addr=lighthouse,
                replica_id=replica_id, hostname=host,
                checkpoint_transport=transport, init_sync=False,   # same seed everywhere: θ_0 is already equal
            )

    def quorum(self) -> QuorumView:
        """Join the next quorum (blocking); heals this replica first if it is behind."""
        self.manager.start_quorum()
        store_addr, rank, quorum_id = self._pg.configured or ("", 0, -1)
        return QuorumView(quorum_id=quorum_id, participants=self.manager.num_participants(),
                          step=self.manager.current_step(), rank=rank, store_addr=store_addr)

    def gather_floats(self, value: float, view: QuorumView) -> list[float]:
        """Every member's ``value``, in quorum rank order (a sum of one-hot vectors on torchft's
        group: exact); zeros where a peer was lost (the caller then keeps its plan)."""
        from torch.distributed import ReduceOp

        every = torch.zeros(view.participants, dtype=torch.float64)
        every[view.rank] = value
        try:
            self.manager.allreduce(every, reduce_op=ReduceOp.SUM).wait()
        except Exception as exc:   # torchft reports the error to the manager too
            log.warning("elastic: gather failed (%s)", exc)
            return [0.0] * view.participants
        return every.tolist() if self.manager.errored() is None else [0.0] * view.participants

    def report_error(self, exc: Exception) -> None:
        """This replica's round went wrong (its peers' may not have): it votes not to commit."""
        self.manager.report_error(exc)

    def commit(self) -> bool:
        """The commit vote: True when this replica's group reported no error (its step advances;
        one that did not commit is behind at the next quorum and heals)."""
        return bool(self.manager.should_commit())

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """Where a resumed replica stands (torchft's public ``load_state_dict``)."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": self.manager.batches_committed()})

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self._pg.shutdown()


def start_barrier(folder: str | os.PathLike[str], replica: int, replicas: int, timeout_s: float) -> None:
    """Wait until all ``replicas`` first starts have their ``ReplicaGroup`` up (a file each in
    ``folder``), so the job's first quorum holds every replica instead of whichever started first
    (the others would then be admitted one by one, each healing); after ``timeout_s``, go on."""
    ready = Path(folder) / "elastic_ready"
    ready.mkdir(parents=True, exist_ok=True)
    (ready / f"replica{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while (present := len(list(ready.glob("replica*")))) < replicas and time.monotonic() <= deadline:
        time.sleep(0.05)
    if present < replicas:
        log.warning("elastic: %d of %d replicas started within %.0f s; the first quorum goes on without "
                    "the others (they join later)", present, replicas, timeout_s)
