"""Shared pytest setup: the repository root is importable (``tests.helpers``); every
test's random inputs come from the ``test_seed`` fixture."""

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
