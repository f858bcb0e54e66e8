"""The torchft internals ``syncplane.algorithms.diloco.ft`` relies on (kept in one section of it),
pinned to the torchft version they were read from: a new torchft fails here, by name, before
an elastic job binds every interface or misreads a quorum."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torchft")

from syncplane.algorithms.diloco import ft  # noqa: E402


def test_the_installed_torchft_is_the_version_whose_internals_ft_reads() -> None:
    installed = ft.torchft_version()
    assert installed == ft.TORCHFT_VERSION, (
        f"torchft {installed} is installed, syncplane.algorithms.diloco.ft was written against torchft "
        f"{ft.TORCHFT_VERSION}: check its 'torchft internals' section (the Manager's RPC server bind, "
        "Manager._quorum_id) against the new version, then move TORCHFT_VERSION")


def test_the_manager_still_builds_its_server_by_name_on_the_wildcard_and_keeps_the_quorum_id() -> None:
    """What the two internals assume, read from the Manager's source."""
    import torchft.manager as tm

    source = inspect.getsource(tm.Manager.__init__)
    assert 'bind = f"[::]:{port}"' in source and "self._manager = ManagerServer(" in source
    assert "bind=bind" in source
    assert "self._quorum_id = quorum_id" in inspect.getsource(tm.Manager._async_quorum)


def test_the_bind_patch_rewrites_the_host_and_restores_the_server_class() -> None:
    import torchft.manager as tm

    seen: dict[str, str] = {}
    original = tm.ManagerServer
    tm.ManagerServer = lambda **kw: seen.update(kw)   # type: ignore[assignment]
    try:
        with ft._bound_manager_server("127.0.0.1"):
            tm.ManagerServer(bind="[::]:1234", replica_id="r")
        assert seen["bind"] == "127.0.0.1:1234"
    finally:
        restored = tm.ManagerServer
        tm.ManagerServer = original   # type: ignore[assignment]
    assert restored is not original and callable(restored)   # the stub, back in place after the block


def test_quorum_id_reads_the_managers_field() -> None:
    class Manager:
        _quorum_id = 7

    assert ft.quorum_id(Manager()) == 7
