"""A few random uneven profiles for real: every strategy's bench sync on the emulated cluster.

The property test (``tests/unit/test_random_profiles.py``) checks the patterns and the cost
model on hundreds of generated profiles; this one builds two of them (drawn from the test's
seed; ``SYNCPLANE_TEST_SEED`` draws others) as network namespaces (racks of different sizes,
hosts of 1-2 ranks, a slow NIC, uneven uplinks, a two-NIC host) and runs the bench on each:
every sync completes and moves the bytes its pattern says. H-ATC mixes the profile's racks,
which differ in size (``tests/dist/test_hierarchical_uneven.py`` checks its values against the
dense reference).
"""

from __future__ import annotations

import random

import pytest

from syncplane.cluster import parse_profile
from tests.helpers.emulation import requires_emulation

pytestmark = [requires_emulation, pytest.mark.slow]

STRATEGIES = ["ddp", "atc", "h_atc", "ds_sync", "diloco"]
PROFILES = 2


def random_profile(rng: random.Random, index: int) -> dict:
    """Three racks of 1-3 hosts (1-2 ranks each; at most 8 ranks), one slow NIC, uneven uplinks."""
    racks, ranks = [], 0
    for r in range(3):
        hosts = []
        for h in range(rng.randint(1, 3)):
            n = min(rng.randint(1, 2), 8 - ranks - (2 - r))   # leave a rank for each later rack
            if n < 1:
                break
            hosts.append({"name": f"x{r}{h}", "nic_mbit": 400, "ranks": n, "nics": rng.choice([1, 1, 2])})
            ranks += n
        racks.append({"name": f"r{r}", "uplink_mbit": rng.choice([50, 100, 200]), "hosts": hosts})
    slow = rng.choice([h for rack in racks for h in rack["hosts"]])
    slow["nic_mbit"] = 100
    return {"name": f"random{index}", "racks": racks}


def test_every_strategy_syncs_on_random_uneven_profiles(tmp_path, test_seed):
    from syncplane.bench.runner import run_bench
    from syncplane.cluster import emulator

    rng = random.Random(test_seed)
    for index in range(PROFILES):
        profile = parse_profile(random_profile(rng, index))
        print(f"profile {index} (seed {test_seed}): {profile.to_dict()}")
        try:
            report = run_bench(profile, STRATEGIES, 2**20, steps=2, warmup=1, out_dir=tmp_path / str(index))
        finally:
            emulator.down()
        assert [r["strategy"] for r in report["results"]] == STRATEGIES
        for result in report["results"]:
            assert result["status"] == "ok", (index, result)
            assert result["sync_s_median"] > 0 and result["bytes_sent_per_rank"] > 0, (index, result)
        ddp = report["results"][0]
        n = profile.world_size
        assert ddp["bytes_sent_per_rank"] == pytest.approx(2 * (n - 1) / n * 2**20, rel=0.01)   # ring: 2(n−1)/n · M
        # the row keeps what DS-Sync's trial settled on (the count its price assumes)
        ds_sync = next(r for r in report["results"] if r["strategy"] == "ds_sync")
        assert "stream(s) per direction" in ds_sync["described"], (index, ds_sync)
