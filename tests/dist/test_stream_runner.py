"""``StreamRunner`` running the mesh exchange (``MeshExchange``) on real gloo processes: the mean of every rank's buffer, bit-identical
for every shard count, int8 within its error bound, and commit-or-discard on a failure."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import (assert_only_the_straggled_round_discarded, rounds_with_a_straggler,
                                       run_distributed)


def _inputs(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (r + 1) for r in range(world)]


def _dense_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    """The reference: sum in rank order, then divide (the order the owners use)."""
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    return acc / len(xs)


def _sharded_means(rank: int, world: int, sizes: list[int], shard_counts: list[int], seed: int,
                   compression: str):
    from syncplane.comm import CommMeter, StreamRunner, make_codec
    from syncplane.exchanges import MeshExchange

    out = {}
    for shards in shard_counts:
        exchange = StreamRunner(MeshExchange(shards), codec=make_codec(compression, 16), timeout_s=30)
        for numel in sizes:   # one exchange serves buffers of any size
            flat = _inputs(world, numel, seed)[rank].clone()
            meter = CommMeter()
            assert exchange.allreduce_mean_(flat, meter=meter)
            out[shards, numel] = (flat, meter.bytes_sent, exchange.bytes_per_round(numel))
        exchange.close()
    return out


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_shard_count_gives_the_exact_dense_mean(world):
    """Primes, and fewer elements than shards x ranks (some segments are empty)."""
    shard_counts, sizes = [1, 2, 3, 8], [1009, 2, 7]
    results = run_distributed(_sharded_means, world, sizes, shard_counts, 11, "none", timeout=120)
    for numel in sizes:
        want = _dense_mean(_inputs(world, numel, 11))
        for rank_result in results:
            for shards in shard_counts:
                flat, sent, predicted = rank_result[shards, numel]
                assert torch.equal(flat, want), f"S={shards}, {numel} values: differs from the dense mean"
                assert sent == predicted
    # each rank sends 2(n-1)/n of the payload (up to segment rounding)
    assert abs(results[0][1, 1009][1] - 2 * (world - 1) / world * 1009 * 4) <= 2 * world * 4


def test_int8_mean_is_within_the_codec_bound_and_identical_on_every_rank():
    world, numel = 3, 4099
    results = run_distributed(_sharded_means, world, [numel], [1, 4], 5, "int8", timeout=120)
    xs = _inputs(world, numel, 5)
    want = _dense_mean(xs)
    for shards in (1, 4):
        got = [r[shards, numel][0] for r in results]
        for other in got[1:]:
            assert torch.equal(other, got[0]), "replicas must agree exactly"
        # two quantizations (in: each contribution; out: the mean), each <= max|block|/254 per value
        bound = 2 * max(x.abs().max() for x in xs) / 254 * 1.0001
        assert (got[0] - want).abs().max() <= bound
        assert ((got[0] - want).norm() / want.norm()) < 0.02
        sent, fp32_bytes = results[0][shards, numel][1], 2 * (world - 1) / world * numel * 4
        assert 0.30 < sent / fp32_bytes < 0.32   # 1/4, plus one fp32 scale per 16 values (+1/16)


def _straggler(rank: int, world: int, late_rank: int):
    from syncplane.comm import StreamRunner
    from syncplane.exchanges import MeshExchange

    return rounds_with_a_straggler(StreamRunner(MeshExchange(2), timeout_s=60.0), rank, late_rank, 1000, "straggler")


@pytest.mark.parametrize("world", [3])
def test_a_timed_out_round_is_discarded_on_every_rank_and_the_next_commits(world):
    results = run_distributed(_straggler, world, world - 1, timeout=120)
    assert_only_the_straggled_round_discarded(results, world, 1000)


def _bad_input(rank: int, world: int):
    from syncplane.comm import StreamRunner
    from syncplane.exchanges import MeshExchange

    exchange = StreamRunner(MeshExchange(1), timeout_s=5)
    try:
        exchange.allreduce_mean_(torch.zeros(4, dtype=torch.float64))
    except ValueError as exc:
        return str(exc)
    finally:
        exchange.close()
    return None


def test_bad_input_is_refused_before_any_communication():
    messages = run_distributed(_bad_input, 2)
    assert all("expected a contiguous 1-D float32 CPU tensor, got torch.float64" in m for m in messages)


def _refused_then_committed(rank: int, world: int, seed: int):
    from syncplane.comm import StreamRunner
    from syncplane.exchanges import NestedExchange

    runner = StreamRunner(NestedExchange([world], streams=4), timeout_s=30)
    try:
        try:
            runner.allreduce_mean_(torch.ones(3))       # 4 streams of `world` pieces: more than 3 values
        except ValueError as exc:
            refused = str(exc)
        x = _inputs(world, 1000, seed)[rank]
        committed = runner.allreduce_mean_(x)           # the next round's agreement is its own
        return refused, committed, x
    finally:
        runner.close()


def test_a_pattern_refusing_its_input_raises_on_every_rank_and_the_next_round_commits(test_seed):
    """The pattern's own ``ValueError`` inside a round: raised on every rank once they have
    agreed to discard it, so the agreement's receives of that round are not left for the next
    one (which then waited for a flag that never came)."""
    world = 2
    results = run_distributed(_refused_then_committed, world, test_seed, timeout=120)
    want = _dense_mean(_inputs(world, 1000, test_seed))
    for refused, committed, x in results:
        assert "pieces" in refused and committed
        torch.testing.assert_close(x, want)


def _kept_buffers_rounds(rank: int, world: int, sizes: list[int]):
    """Each pattern's rounds on one runner (its buffers kept between rounds) beside the same
    rounds each on a runner of its own (every buffer fresh), on fresh inputs every round."""
    from syncplane.comm import StreamRunner
    from syncplane.exchanges import GatherExchange, MeshExchange, NestedExchange

    patterns = {"mesh": lambda: MeshExchange(2), "gather": lambda: GatherExchange(2),
                "nested": lambda: NestedExchange([2, world // 2], streams=2)}
    out = {}
    for name, pattern in patterns.items():
        kept = StreamRunner(pattern(), timeout_s=60)
        for r, numel in enumerate(sizes):
            flat = _inputs(world, numel, 100 + r)[rank].clone()
            fresh_runner, fresh = StreamRunner(pattern(), timeout_s=60), flat.clone()
            assert kept.allreduce_mean_(flat) and fresh_runner.allreduce_mean_(fresh)
            fresh_runner.close()
            out[name, r] = (flat, fresh)
        kept.close()
    return out


def test_buffers_kept_between_rounds_change_no_bit_of_any_round():
    """The patterns keep their receive, sum and output buffers between rounds (``Round.kept``):
    round after round on fresh inputs (a smaller buffer in the front of a larger one), each
    mean equals a fresh runner's bit for bit, and the dense mean within fp32 rounding (the
    nested pattern sums in its own order)."""
    world, sizes = 4, [1031, 1031, 517, 1031]
    results = run_distributed(_kept_buffers_rounds, world, sizes, timeout=120)
    for r, numel in enumerate(sizes):
        want = _dense_mean(_inputs(world, numel, 100 + r))
        for rank_result in results:
            for name in ("mesh", "gather", "nested"):
                kept, fresh = rank_result[name, r]
                assert torch.equal(kept, fresh), f"{name}, round {r}: kept buffers changed the mean"
                torch.testing.assert_close(kept, want, msg=f"{name}, round {r}: not the mean")


FLAG_PATTERNS = [[], [0], [4], [2], [1, 3], [0, 1, 2, 3, 4]]     # the ranks that pass False


def _agreements(rank: int, world: int, fanouts: list[int]):
    import torch.distributed as dist

    from syncplane.comm.collectives import every_rank_ok

    return {(fanout, i): every_rank_ok(dist.group.WORLD, rank, world, rank not in failing, fanout)
            for fanout in fanouts for i, failing in enumerate(FLAG_PATTERNS)}


def _posted_agreements(rank: int, world: int, fanouts: list[int]):
    """Each agreement's receives posted first, then other traffic (an all-reduce on another
    group, as a runner's exchange runs on its data groups), then the decision."""
    import torch
    import torch.distributed as dist

    from syncplane.comm.collectives import post_every_rank_ok

    other = dist.new_group(backend="gloo")
    out = {}
    for fanout in fanouts:
        for i, failing in enumerate(FLAG_PATTERNS):
            decide = post_every_rank_ok(dist.group.WORLD, rank, world, fanout)
            values = torch.full((1000,), float(rank))
            dist.all_reduce(values, group=other)
            out[fanout, i] = (decide(rank not in failing), float(values[0]))
    return out


def test_every_rank_ok_is_the_and_of_every_ranks_flag():
    """The round's agreement on 5 ranks: one message delay (fanout 8), two (2) and three (1),
    with any rank, several or none failing: every rank gets the AND of all flags."""
    fanouts = [1, 2, 8]
    results = run_distributed(_agreements, 5, fanouts, timeout=120)
    for fanout in fanouts:
        for i, failing in enumerate(FLAG_PATTERNS):
            assert [r[fanout, i] for r in results] == [not failing] * 5, (fanout, failing)


def test_agreement_posted_ahead_of_other_traffic_is_the_same_and():
    """``post_every_rank_ok`` then traffic on another group then the decision, as a runner's
    round runs it: every rank still gets the AND of all flags, and the traffic its sum."""
    fanouts = [1, 8]
    results = run_distributed(_posted_agreements, 5, fanouts, timeout=120)
    for fanout in fanouts:
        for i, failing in enumerate(FLAG_PATTERNS):
            assert [r[fanout, i] for r in results] == [(not failing, 10.0)] * 5, (fanout, failing)
