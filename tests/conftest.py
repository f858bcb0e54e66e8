"""Shared pytest setup: the repository root is importable (``tests.helpers``); every
test's random inputs come from the ``test_seed`` fixture; the emulated clusters of a test
run live under a namespace prefix of their own."""

from __future__ import annotations

import os
import re
import subprocess
import zlib

import pytest

#: Base of every test's seed; set it to rerun the suite on other random inputs.
SEED_ENV = "SYNCPLANE_TEST_SEED"


@pytest.fixture
def test_seed(request: pytest.FixtureRequest) -> int:
    """A seed for the test's random inputs: a stable function of the test's id and
    ``$SYNCPLANE_TEST_SEED`` (default 0) -- not of the test order, the global RNG or
    ``PYTHONHASHSEED`` -- printed and recorded, so a failure can be replayed."""
    base = int(os.environ.get(SEED_ENV, "0"))
    seed = (zlib.crc32(request.node.nodeid.encode()) + base) % 2**30
    print(f"{request.node.nodeid}: seed {seed} ({SEED_ENV}={base})")
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.fixture(autouse=True)
def _job_variables_stay_in_their_test():
    """Each test gets back the environment it started with, and a default process group it
    created goes with it. Lightning's in-process fits write ``MASTER_ADDR``/``MASTER_PORT``
    (and ``PL_GLOBAL_SEED``) into ``os.environ``; left there, every later test's subprocess
    job inherits a port that may still be held here (``EADDRINUSE`` at its rendezvous)."""
    import torch.distributed as dist

    before = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if dist.is_available() and dist.is_initialized() and not had_group:
        dist.destroy_process_group()
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


def pytest_configure(config: pytest.Config) -> None:
    """This test run's emulated clusters get a namespace prefix of their own (``spt<pid>-``),
    inherited by every process it starts: a test's ``emulator.down()`` then removes only
    this run's namespaces, never a user's ``sp-`` cluster or another suite's. Under
    pytest-xdist (``make test``) each worker has a prefix of its own (``spt<pid>gw<n>-``, under the controller's): the
    workers' clusters never meet, and one worker's ``down()`` leaves the other's up."""
    from syncplane.cluster import emulator

    os.environ.setdefault(emulator.PREFIX_ENV, f"spt{os.getpid()}-")
    worker = os.environ.get("PYTEST_XDIST_WORKER")   # gw0, gw1, ... in a worker; unset otherwise
    if worker is not None:
        os.environ[emulator.PREFIX_ENV] = f"{os.environ[emulator.PREFIX_ENV][:-1]}{worker}-"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Whatever this run left up (a test killed half-way) comes down with it; the controller
    of an xdist run also takes down what a worker that died left under its own prefix."""
    from syncplane.cluster import emulator

    try:
        emulator.require_support()
    except emulator.EmulationError:
        return
    if emulator.namespaces():
        emulator.down()
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    own = os.environ[emulator.PREFIX_ENV][:-1]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for prefix in sorted({m.group(0) for name in listed if (m := re.match(rf"{own}gw\d+-", name))}):
        os.environ[emulator.PREFIX_ENV] = prefix
        try:
            emulator.down()
        finally:
            os.environ[emulator.PREFIX_ENV] = f"{own}-"
