"""Probe -> profile: a topology written as a cluster profile reproduces the pairwise bandwidths
it was found with, racks and hosts included (issue 36 item 4; the topology here is the one a
profile declares, ``probe.from_profile`` -- the probe on an emulated cluster is not run)."""

from __future__ import annotations

import numpy as np
import pytest

from syncplane.cluster import load_profile, parse_profile
from syncplane.cluster.probe import from_profile


@pytest.mark.parametrize("name", ["two_racks", "uneven_three_racks", "asymmetric_3_2_4", "slow_nic"])
def test_a_profile_written_from_a_topology_reproduces_its_bandwidths(name: str) -> None:
    topo = from_profile(load_profile(name))
    written = parse_profile(topo.to_profile("probed").to_dict())
    again = from_profile(written)
    assert again.racks == topo.racks and again.hosts == topo.hosts
    off = ~np.eye(topo.world_size, dtype=bool)
    ratio = again.bandwidth[off] / topo.bandwidth[off]
    assert np.all(np.abs(ratio - 1) <= 0.15), f"{name}: bandwidth ratios {ratio.min():.2f}..{ratio.max():.2f}"


@pytest.mark.parametrize("name,racks_found", [("two_racks", True), ("uneven_three_racks", False)])
def test_racks_are_found_from_noisy_measurements_and_written(name: str, racks_found: bool) -> None:
    """The probe's own path: noisy pairwise rates (fresh, ±5 %) and each rank's host id ->
    racks clustered -> a profile whose bandwidths are the truth's within 15 %. On
    ``uneven_three_racks`` pairwise rates alone cannot find the racks (host a2's 100 Mbit NIC
    equals the uplinks, so a2 looks as far from its rack as from the others): the profile
    still reproduces every pair's rate, but finding those racks needs concurrent flows (not
    done yet, issue 36)."""
    from syncplane.cluster.probe import topology_from_measurements

    truth = from_profile(load_profile(name))
    rng = np.random.default_rng()
    noise = rng.uniform(0.95, 1.05, truth.bandwidth.shape)
    measured = np.where(np.isfinite(truth.bandwidth), truth.bandwidth * np.sqrt(noise * noise.T), np.inf)
    host_ids = [truth.host_of(r) for r in range(truth.world_size)]
    found = topology_from_measurements(measured, truth.latency, host_ids)
    assert (sorted(found.racks) == sorted(truth.racks)) == racks_found
    again = from_profile(parse_profile(found.to_profile().to_dict()))
    # the profile numbers ranks rack by rack, host by host: rank i of it is rank order[i] here
    order = np.array([r for rack in found.racks for host in found.hosts if host[0] in rack for r in host])
    off = ~np.eye(truth.world_size, dtype=bool)
    ratio = again.bandwidth[off] / truth.bandwidth[np.ix_(order, order)][off]
    assert np.all(np.abs(ratio - 1) <= 0.15), f"bandwidth ratios {ratio.min():.2f}..{ratio.max():.2f}"
