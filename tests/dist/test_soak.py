"""Every strategy's sync, run for thousands of steps on real gloo processes, holds no more
memory, descriptors, threads or sockets at the end than after its warm-up."""

from __future__ import annotations

import pytest

from syncplane import algorithms
from syncplane.bench.soak import run_soak


@pytest.mark.slow
def test_every_strategy_soaks_flat_over_real_processes(tmp_path):
    """2,000 steps of every strategy's sync on 2 gloo processes (the 10,000-step run is
    ``syncplane soak``; its numbers are in the closing notes)."""
    results = run_soak(algorithms.strategy_names(), steps=2000, ranks=2, payload_bytes=64 * 1024,
                       out_dir=tmp_path)
    assert set(results) == set(algorithms.strategy_names())
    for name, result in results.items():
        assert result["steps"] == 2000 and len(result["ranks"]) == 2
        assert result["flat"], (name, [r["rise"] for r in result["ranks"]])
