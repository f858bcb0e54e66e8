"""DS-Sync's topology probe on an emulated ``two_racks`` cluster recovers both racks.

Needs root and iproute2 (network namespaces, tc); skipped with the reason elsewhere.
Run it under ``flock /tmp/syncplane-emu.lock`` like every emulator user.
"""

from __future__ import annotations

import json
import sys


from syncplane.cluster import emulator, load_profile
from tests.helpers.emulation import requires_emulation

pytestmark = requires_emulation


def test_probe_recovers_both_racks_of_two_racks(tmp_path):
    from syncplane.runtime.launcher import launch_on_cluster

    profile = load_profile("two_racks")
    out = tmp_path / "topology.json"
    try:
        launch_on_cluster([sys.executable, "-m", "syncplane.cluster.probe", "--mb", "2", "--refresh",
                           "--json", str(out)], profile, tmp_path / "logs", timeout_s=240)
    finally:
        emulator.down()
    topo = json.loads(out.read_text())
    assert topo["racks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo["hosts"] == [[r] for r in range(8)]
    bw = topo["bandwidth"]
    # inside a rack the 400 Mbit NICs, across racks the shared 100 Mbit uplink
    intra = min(bw[i][j] for rack in topo["racks"] for i in rack for j in rack if i != j)
    cross = max(bw[i][j] for i in topo["racks"][0] for j in topo["racks"][1])
    assert intra > 2 * cross
    assert intra * 8 / 1e6 < 450 and cross * 8 / 1e6 < 110                          # the shaped rates bound them
