"""The elastic job's quorum service as a process of its own (what an emulated cluster runs on
host 0): it reports the address it bound, answers there, ends with SIGTERM, and a bad bind
address fails with its error rather than a hang."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from syncplane.runtime.launcher import LaunchError
from syncplane.runtime.lighthouse import lighthouse_process

pytest.importorskip("torchft")


def test_the_service_binds_the_address_given_and_ends_with_the_launcher(tmp_path: Path) -> None:
    with lighthouse_process([], "127.0.0.1", strategy="diloco", log_file=tmp_path / "lighthouse.log") as address:
        assert address.startswith("http://127.0.0.1:")
        port = int(address.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    with pytest.raises(OSError):   # gone with the context
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_wildcard_bind_fails_with_the_services_own_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="would listen on every interface"):
        with lighthouse_process([], "0.0.0.0", strategy="diloco", log_file=tmp_path / "lighthouse.log"):
            pass
