"""DS-Sync's comm layer on real gloo processes: group averaging, the schedule, adjustment, the probe.

Reference for one step: with groups G₁..G_k partitioning the ranks, rank i ends with
``mean_{j ∈ G(i)} x_j`` -- the dense ``W x`` with ``W`` the block averaging matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed

SHAPES = [(3, 5), (7,), (2, 2, 2)]


def _inputs(rank: int, trial: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * trial + rank)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _dense_reference(groups, trial: int, world: int) -> list[list[torch.Tensor]]:
    x = [_inputs(r, trial) for r in range(world)]
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for g in groups:
        mean = [torch.stack([x[j][t] for j in g]).double().mean(0).float() for t in range(len(SHAPES))]
        for r in g:
            out[r] = mean
    return out


PARTITIONS = {  # number of groups -> a partition of 5 ranks
    2: [[0, 2, 4], [1, 3]],
    3: [[0, 1], [2, 3], [4]],
    4: [[0, 4], [1], [2], [3]],
}


def _group_average(rank: int, world: int):
    from syncplane.comm import make_buckets
    from syncplane.comm.groups import GroupSet

    groups = GroupSet([g for part in PARTITIONS.values() for g in part])
    results = {}
    for trial, (k, part) in enumerate(PARTITIONS.items()):
        tensors = _inputs(rank, trial)
        buckets = make_buckets(tensors, cap_bytes=64)          # several buckets
        mine = next(g for g in part if rank in g)
        groups.group_average_(buckets, mine)
        results[k] = tensors
    with pytest.raises(ValueError, match="not in group"):
        groups.group_average_(make_buckets(_inputs(rank, 9)), [r for r in range(world) if r != rank][:2])
    return results


def test_each_rank_holds_its_groups_mean_for_2_3_4_groups():
    results = run_distributed(_group_average, 5)
    for trial, (k, part) in enumerate(PARTITIONS.items()):
        want = _dense_reference(part, trial, 5)
        for rank in range(5):
            for got, ref in zip(results[rank][k], want[rank]):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _pair_inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    return [torch.randn(n, generator=g) for n in (1, 3, 9, 20)]      # buckets smaller than the stream count


def _pair_over_streams(rank: int, world: int, streams: int):
    from syncplane.comm import make_buckets
    from syncplane.comm.groups import GroupSet

    groups = GroupSet([[0, 1]], max_pair_streams=4)
    groups.pair_streams = streams
    tensors = _pair_inputs(rank)
    groups.group_average_(make_buckets(tensors, cap_bytes=4), [0, 1])
    return tensors


@pytest.mark.parametrize("streams", [1, 4])
def test_a_pair_over_several_streams_holds_the_exact_mean_on_both_ranks(streams):
    results = run_distributed(_pair_over_streams, 2, streams)
    for got0, got1, a, b in zip(results[0], results[1], _pair_inputs(0), _pair_inputs(1)):
        assert torch.equal(got0, got1)                              # bit-identical on both ends
        torch.testing.assert_close(got0, (a + b) / 2, rtol=0, atol=1e-7)


def _auto_streams(rank: int, world: int, steps: int):
    from syncplane.comm import make_buckets
    from syncplane.algorithms.ds_sync.engine import DSSync

    def runtime():
        return DSSync([[0, 1], [2, 3]], np.full((world, world), 1e8), pair_streams="auto")

    current = runtime()
    with pytest.raises(ValueError, match=r"pair_streams must be in 1..4 \(connections created\), got 5"):
        current.groups.pair_streams = 5
    used, outs, state = [], [], None
    for step in range(steps):
        if step == 2:                                   # resume in the middle of the trial
            state = current.state_dict()
            current = runtime()
            current.load_state_dict(state)
        tensors = _inputs(rank, step)
        current.sync_(make_buckets(tensors, cap_bytes=64))
        used.append(current.groups.pair_streams)
        outs.append(tensors)
    return used, current.streams.decisions, current.streams.describe(), outs, len(state["streams"]["trial_times"])


def test_auto_pair_streams_try_both_counts_on_real_syncs_and_every_rank_keeps_one():
    """Trial: a pattern period (P = 4 here) to warm up, one with 1 stream, one with 4; the
    count kept is the same on every rank from the trial's last sync on."""
    from syncplane.algorithms.ds_sync.pattern import build_pattern

    pattern = build_pattern([[0, 1], [2, 3]])
    period = pattern.period
    steps = 3 * period + 2
    results = run_distributed(_auto_streams, 4, steps)
    used = results[0][0]                                              # the count after each sync
    last = 3 * period - 1                                             # the trial's last sync decides
    kept = used[last]
    assert used[:2 * period] == [1] * 2 * period and used[2 * period:last] == [4] * (period - 1)
    assert kept in (1, 4) and used[last:] == [kept] * (steps - last)
    assert all(r[0] == used for r in results)                         # the same on every rank
    (step, one, many, decided), = results[0][1]                      # one decision, at the trial's end
    assert step == last and one > 0 and many > 0 and decided == kept
    assert results[0][2].startswith(f"pairs swap over {kept} stream(s) per direction (mean sync with 1 stream")
    assert results[0][4] == 2                                         # the checkpoint carried the trial so far
    for step in range(steps):                                         # every sync exact, whatever the count
        want = _dense_reference(pattern.groups_at(step), step, 4)
        for rank in range(4):
            for got, ref in zip(results[rank][3][step], want[rank]):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _schedule(rank: int, world: int, steps: int):
    from syncplane.comm import make_buckets
    from syncplane.algorithms.ds_sync.engine import DSSync

    racks = [[0, 1], [2, 3]]
    runtime = DSSync(racks, np.full((world, world), 1e8))
    outs = []
    for step in range(steps):
        tensors = _inputs(rank, step)
        runtime.sync_(make_buckets(tensors, cap_bytes=64))
        outs.append(tensors)
    return outs, [runtime.pattern.groups_at(s) for s in range(steps)], len(runtime.groups)


def test_schedule_averages_within_the_patterns_group_every_step():
    from syncplane.algorithms.ds_sync.pattern import build_pattern

    steps = 4
    results = run_distributed(_schedule, 4, steps)
    pattern = build_pattern([[0, 1], [2, 3]])
    for rank in range(4):
        assert results[rank][1] == results[0][1]                  # identical schedule on every rank
    for step in range(steps):
        want = _dense_reference(pattern.groups_at(step), step, 4)
        for rank in range(4):
            for got, ref in zip(results[rank][0][step], want[rank]):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _adjusting(rank: int, world: int):
    import types

    import syncplane.algorithms.ds_sync.engine as ds_sync_module
    from syncplane.cluster.probe import Topology
    from syncplane.comm import make_buckets
    from syncplane.algorithms.ds_sync.engine import DSSync

    bw = np.full((world, world), 1e9)
    slow_bw = bw.copy()
    slow_bw[3, :] = slow_bw[:, 3] = 1e7                        # what a re-probe sees: rank 3's NIC is slow
    probes = []

    def reprobe():
        # what the real re-probe does with a fresh bandwidth matrix: the bottlenecks it shows
        # (rank 3 is found from the matrix, not named by the test)
        probes.append(True)
        now = Topology(racks=[list(range(world))], hosts=[[r] for r in range(world)], bandwidth=slow_bw,
                       latency=np.zeros_like(slow_bw), source="re-probe")
        return (slow_bw, *now.bottlenecks())

    # The runtime's clock is the test's: each group average "takes" 10 ms, 300 ms from step 2
    # on in rank 3's group (rank 3 starts lagging after the first window). A real sleep would
    # make the flagged steps depend on how loaded the machine is.
    clock = [0.0]
    ds_sync_module.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    runtime = DSSync([list(range(world))], bw, adjust_every=2, imbalance=1.5, reprobe=reprobe)
    real_average = runtime.groups.group_average_

    def timed_average(buckets, group, meter=None):
        real_average(buckets, group, meter)
        clock[0] += 0.3 if 3 in group and runtime.step >= 2 else 0.01

    runtime.groups.group_average_ = timed_average
    for _ in range(6):
        runtime.sync_(make_buckets([torch.full((1000,), float(rank))]))
    return runtime.adjustments, runtime.pattern.iterations, len(probes)


def test_a_lagging_rank_is_split_off_and_every_rank_adopts_the_same_pattern():
    results = run_distributed(_adjusting, 4)
    adjustments, iterations, probes = results[0]
    assert adjustments == [(4, "rank3")]
    for adj, its, n in results:
        assert (adj, its, n) == (adjustments, iterations, 1)
    for groups in iterations:                                   # rank 3 now always in a pair
        assert next(len(g) for g in groups if 3 in g) == 2


def _probe(rank: int, world: int, cache_dir: str):
    from pathlib import Path

    from syncplane.cluster import probe

    first = probe.probe(nbytes=64 * 1024, cache_dir=Path(cache_dir))
    second = probe.probe(nbytes=64 * 1024, cache_dir=Path(cache_dir))
    return first.to_dict(), second.source


def test_real_probe_on_localhost_measures_every_pair_and_is_cached(tmp_path):
    results = run_distributed(_probe, 3, str(tmp_path))
    topo, source = results[0]
    bw = np.asarray(topo["bandwidth"])
    off = bw[~np.eye(3, dtype=bool)]
    assert np.all(np.isfinite(off)) and np.all(off > 0)
    assert topo["racks"] == [[0, 1, 2]]
    assert all(r[0] == topo for r in results)                  # same result on every rank
    assert all("cached" in r[1] for r in results)
    assert len(list(tmp_path.glob("*.json"))) == 1
