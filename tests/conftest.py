"""Shared pytest setup: the repository root is importable (``tests.helpers``); every
test's random inputs come from the ``test_seed`` fixture; the emulated clusters of a test
run live under a namespace prefix of their own."""

from __future__ import annotations

import os
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


def pytest_configure(config: pytest.Config) -> None:
    """This test run's emulated clusters get a namespace prefix of their own (``spt<pid>-``),
    inherited by every process it starts: a test's ``emulator.down()`` then removes only
    this run's namespaces, never a user's ``sp-`` cluster or another suite's."""
    from syncplane.cluster import emulator

    os.environ.setdefault(emulator.PREFIX_ENV, f"spt{os.getpid()}-")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Whatever this run left up (a test killed half-way) comes down with it."""
    from syncplane.cluster import emulator

    try:
        emulator.require_support()
    except emulator.EmulationError:
        return
    if emulator.namespaces():
        emulator.down()
