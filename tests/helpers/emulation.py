"""Skip marker for tests that build an emulated cluster (root, network namespaces, tc)."""

from __future__ import annotations

import pytest

from syncplane.cluster import emulator
from syncplane.cluster.emulator import EmulationError

try:
    emulator.require_support()
    UNSUPPORTED: str | None = None
except EmulationError as exc:
    UNSUPPORTED = str(exc)

#: ``pytestmark = requires_emulation`` in a module whose tests need the emulator.
requires_emulation = pytest.mark.skipif(UNSUPPORTED is not None,
                                        reason=f"cluster emulation unavailable: {UNSUPPORTED}")
