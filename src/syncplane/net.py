"""Small socket helpers shared by the launcher, the transport and the probe (a leaf: imports
nothing of ours), among them stores that listen only on the address they were given.

torch's ``TCPStore`` server, told ``host``, still listens on every interface (``*:PORT`` in
``ss -ltn``): ``host`` only says where clients connect. A job's store accepts keys from
anyone who reaches it, so on a multi-homed node (a management NIC, a public address)
that is more than the user asked for. ``TCPStore`` does take an already-bound socket
(``master_listen_fd``), so the store's server here is bound first, to the one address
``host`` names, and handed over.

The one exception is a hostname that resolves to loopback on the store's own node (Debian's
``127.0.1.1 <hostname>`` in ``/etc/hosts``, while the other nodes resolve it to the NIC):
bound there the store could never be reached by another node, so it listens on every
interface as torch would, and says so in the log.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping

import torch.distributed as dist

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous store or RPC)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def listen_address(host: str) -> tuple[socket.AddressFamily, str] | None:
    """The (family, address) a server for ``host`` should bind, or None for every interface
    (only for a hostname that resolves to loopback here: see the module's docstring)."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host!r}: the name does not resolve here ({e})") from None
    found = [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in infos]
    # IPv4 first, as torch's clients try it first
    found.sort(key=lambda fa: fa[0] != socket.AF_INET)
    routable = [fa for fa in found if not ipaddress.ip_address(fa[1]).is_loopback]
    if routable:
        return routable[0]
    if _is_literal(host) or host == "localhost":
        return found[0]   # asked for loopback: a single-node job
    log.warning("%r resolves to loopback (%s) on this node, which other nodes cannot reach: the job's "
                "store listens on every interface. Set MASTER_ADDR to this node's address to bind only it",
                host, found[0][1])
    return None


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on the address ``host`` names (every interface only where
    ``listen_address`` says so), ``port`` 0 for any free one."""
    where = listen_address(host)
    family, address = where if where is not None else (socket.AF_INET, "0.0.0.0")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {address}:{port} ({host}) for the job's store: {e.strerror}") from e
    return sock


def tcp_store_server(host: str, port: int, world_size: int | None = None, *,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                     wait_for_workers: bool = False) -> dist.TCPStore:
    """The server side of a ``TCPStore`` (``is_master=True``) listening only on ``host``'s
    address; ``port`` 0 picks a free one (``store.port`` gives it)."""
    sock = bound_socket(host, port)
    bound_port = int(sock.getsockname()[1])
    # the store owns the descriptor from here on (it closes it); a socket object left
    # holding it would close it under the store when collected
    fd = sock.detach()
    try:
        return dist.TCPStore(host.strip("[]"), bound_port, world_size, True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def master_endpoint(env: Mapping[str, str]) -> tuple[str, int]:
    """The job store's address and port from torchrun-style variables (torch's defaults)."""
    return env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))


def env_store(timeout: datetime.timedelta, env: Mapping[str, str] | None = None) -> dist.Store:
    """The job's store from torchrun-style variables (``MASTER_ADDR``/``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``), as ``init_method="env://"`` would make it, but with rank 0's
    server on ``MASTER_ADDR`` alone. Under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) the
    agent already hosts it, and every rank is a client."""
    env = os.environ if env is None else env
    addr, port = master_endpoint(env)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return tcp_store_server(addr, port, world, timeout=timeout)
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout, wait_for_workers=False)


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group(backend)`` from torchrun-style variables (what ``env://``
    does), its store bound as ``env_store`` binds it. Like ``env://``, keys on torchrun's
    agent store are kept apart per restart (``/worker/attempt_<n>``): a restarted worker
    must not read the keys of the attempt before it."""
    store = env_store(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
