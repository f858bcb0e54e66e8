"""The stores we host listen on the address they were given, never on every interface."""

from __future__ import annotations

import datetime
import logging
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from syncplane import net


def _listeners(port: int) -> set[str]:
    """Local addresses (hex as in /proc/net/tcp{,6}) of the sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port_hex, 16) == port:   # 0A: TCP_LISTEN
                found.add(address)
    return found


LOOPBACK_V4 = "0100007F"   # 127.0.0.1 in /proc/net/tcp's byte order


def test_the_store_listens_on_its_address_alone_and_serves_clients():
    server = net.tcp_store_server("127.0.0.1", 0, 2)
    # torch's own server (the reference this replaces) would show the wildcard of tcp6 here
    assert _listeners(server.port) == {LOOPBACK_V4}
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=10))
    client.set("key", "from the client")
    assert server.get("key") == b"from the client"


def test_a_plain_torch_store_would_have_listened_on_every_interface():
    """The premise of ``tcp_store_server``: if torch ever binds ``host`` itself, this fails
    and the workaround can go."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert _listeners(server.port) != {LOOPBACK_V4}


def test_a_taken_port_is_named_in_the_error():
    taken = net.bound_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port} \(127\.0\.0\.1\) for the job's store"):
            net.tcp_store_server("127.0.0.1", port, 1)
    finally:
        taken.close()


def _resolving_to(monkeypatch, *addresses: str) -> None:
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
                for a in addresses]
    monkeypatch.setattr(net.socket, "getaddrinfo", getaddrinfo)


def test_a_name_binds_its_routable_address_ipv4_first(monkeypatch):
    _resolving_to(monkeypatch, "fd00::5", "127.0.1.1", "10.1.2.3")
    assert net.listen_address("node07") == (socket.AF_INET, "10.1.2.3")


def test_a_name_that_resolves_to_loopback_here_listens_everywhere_and_says_why(monkeypatch, caplog):
    """Debian's ``127.0.1.1 <hostname>``: bound there, no other node could reach the store."""
    _resolving_to(monkeypatch, "127.0.1.1")
    with caplog.at_level(logging.WARNING, logger="syncplane.net"):
        assert net.listen_address("node07") is None
    assert "'node07' resolves to loopback (127.0.1.1)" in caplog.text


def test_loopback_asked_for_is_loopback():
    assert net.listen_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    family, address = net.listen_address("localhost")
    assert address in ("127.0.0.1", "::1")


def test_a_name_that_does_not_resolve_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot listen on 'no-such-host.invalid': the name does not resolve"):
        net.listen_address("no-such-host.invalid")


def test_env_store_hosts_on_rank0_and_is_a_client_elsewhere_and_under_torchrun():
    server = net.env_store(datetime.timedelta(seconds=10),
                           {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "2"})
    port = server.port
    assert _listeners(port) == {LOOPBACK_V4}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    other = net.env_store(datetime.timedelta(seconds=10), {**env, "RANK": "1"})
    agent = net.env_store(datetime.timedelta(seconds=10), {**env, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    other.set("from", "rank 1")
    assert agent.get("from") == b"rank 1"
    assert _listeners(port) == {LOOPBACK_V4}   # the agent-hosted rank 0 started no second server
