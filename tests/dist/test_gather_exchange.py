"""``GatherExchange`` under the ``StreamRunner`` on 3 real gloo ranks, flat and by hosts
(``((0, 2), (1,))``: a host of two that forwards a block, and one of one): every rank gets the
mean of every rank's encoded piece (sparse, with error feedback, and an exact fp32 tail),
bit-identical on every rank and to a dense reference of the same pieces; a discarded round
leaves the buffer and the error feedback as they were, so the next round matches a reference
that never saw it."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed, straggle_after_peers_started

WORLD, NUMEL, EXACT_FROM, SHARDS, BETA = 3, 1000, 900, 2, 0.9
LAYOUTS = {"flat": None, "hosts": ((0, 2), (1,))}


def _codec():
    from syncplane.comm import ChunkedTopK

    return ChunkedTopK(density=0.05, bits=2, chunk=64)


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * (r + 1) for r in range(WORLD)]


def _reference(feedbacks, xs: list[torch.Tensor]) -> torch.Tensor:
    """Each rank's pieces as the gather cuts them (per stream; the tail exact), each decoded to
    dense on its own, summed in rank order, divided once."""
    from syncplane.comm.streams import shard_bounds

    codec, out = _codec(), torch.zeros(NUMEL)
    for lo, hi in shard_bounds(NUMEL, SHARDS):
        cut = max(lo, min(hi, EXACT_FROM))
        acc = torch.zeros(hi - lo)
        for ef, x in zip(feedbacks, xs):
            if cut > lo:
                acc[:cut - lo] += codec.extract(ef.compress(x[lo:cut], lo), cut - lo)
            acc[cut - lo:] += x[cut:hi]
        out[lo:hi] = acc / WORLD
    return out


def _rounds(rank: int, world: int, seed: int):
    return {layout: _layout_rounds(rank, world, seed, hosts) for layout, hosts in LAYOUTS.items()}


def _layout_rounds(rank: int, world: int, seed: int, hosts):
    from syncplane.comm import CommMeter, StreamRunner
    from syncplane.exchanges import GatherExchange

    out = {}
    # exact fp32 on the gather: the plain mean, summed in rank order
    runner = StreamRunner(GatherExchange(3, groups=hosts), timeout_s=60)
    flat = _inputs(seed + 1)[rank].clone()
    assert runner.allreduce_mean_(flat)
    out["fp32"] = flat
    runner.close()

    runner = StreamRunner(GatherExchange(SHARDS, EXACT_FROM, hosts), codec=_codec(), timeout_s=60,
                          error_feedback_beta=BETA)
    for i in range(3):
        flat = _inputs(seed + 10 * i)[rank].clone()
        if i == 1:      # a straggler: rank 2 stays away past everyone's timeout
            runner.timeout_s = 1.0
            straggle_after_peers_started(f"gather{seed}{hosts}", rank == world - 1, runner.timeout_s)
        else:
            runner.timeout_s = 60.0
        meter = CommMeter()
        ok = runner.allreduce_mean_(flat, meter)
        out[i] = (ok, flat.clone(), runner.state_dict()["residuals"].clone(), meter.bytes_sent)
        out[f"error{i}"] = runner.last_error
    out["predicted"] = runner.bytes_per_round(NUMEL)
    runner.close()
    return out


def test_the_gather_is_the_mean_of_the_same_pieces_on_every_rank(test_seed):
    everything = run_distributed(_rounds, WORLD, test_seed, timeout=180)
    for layout in LAYOUTS:
        _check(layout, [r[layout] for r in everything], test_seed)
    # by hosts: ranks 0 and 1 send their piece once (to host mate 0 <-> 2, or across to 2);
    # rank 2 sends its own to 0, host (0, 2)'s block across to 1, and 1's piece on to 0: 4
    for rank, pieces in enumerate([1, 1, 4]):
        assert everything[rank]["hosts"]["predicted"] * 2 == everything[rank]["flat"]["predicted"] * pieces


def _check(layout: str, results, test_seed: int) -> None:
    from syncplane.comm import ErrorFeedback

    xs = _inputs(test_seed + 1)
    want = xs[0] + xs[1]
    want += xs[2]
    want /= WORLD
    for r in results:
        assert torch.equal(r["fp32"], want)

    feedbacks = [ErrorFeedback(_codec(), NUMEL, BETA) for _ in range(WORLD)]
    first = _reference(feedbacks, _inputs(test_seed))
    after_first = [ef.residual.clone() for ef in feedbacks]
    third = _reference(feedbacks, _inputs(test_seed + 20))   # round 2 was discarded: never seen
    for rank, r in enumerate(results):
        ok, got, residual, sent = r[0]
        assert ok and torch.equal(got, first), f"{layout}, rank {rank}: round 1 differs ({r['error0']})"
        assert torch.equal(residual[0], after_first[rank])
        assert sent == r["predicted"]
        ok, got, residual, _ = r[1]
        assert not ok
        assert torch.equal(got, _inputs(test_seed + 10)[rank]), "a discarded round changes nothing"
        assert torch.equal(residual[0], after_first[rank]), "a discarded round puts the feedback back"
        ok, got, residual, _ = r[2]
        assert ok and torch.equal(got, third), f"{layout}, rank {rank}: round 3 differs from the reference"
        assert torch.equal(residual[0], feedbacks[rank].residual)
    # sparse head at 5 % and 2 bits, exact tail: far below the fp32 pieces
    assert results[0]["predicted"] < (WORLD - 1) * (EXACT_FROM * 4) / 5 + (WORLD - 1) * (NUMEL - EXACT_FROM) * 4
