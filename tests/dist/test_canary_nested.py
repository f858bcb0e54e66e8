"""Canary's nested exchange on real gloo processes, chosen because the job's cluster profile
groups its ranks in hosts and racks of equal size: with the exact codec every rank ends with
the float64 dense mean of fresh random inputs (to fp32 rounding), the same bits for one and
two streams; with the gradient sketch (and int8) every rank holds exactly what the definition gives --
each level's pieces encoded, decoded and summed in digit order (raw fp32 between ranks of
one host unless ``compress_in_host``), the owner's mean encoded once -- computed here in one
process from the same inputs; the bytes sent are what the
transport predicts; and ``exchange=nested`` on ranks that are not grouped fails naming the
field, on every rank, before anything is sent."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.models import assert_fp32_mean, colayer_grads

SIZES = [1031, 24, 3000]          # colayers; 24 = streams · n pieces exactly at 6 ranks and 2 streams


def _profile(racks: int, hosts: int, ranks: int) -> str:
    lines = ["name: nested_test", "racks:"]
    for r in range(racks):
        lines += [f"  - name: r{r}", "    uplink_mbit: 100", "    hosts:"]
        lines += [f"      - {{name: h{r}x{h}, nic_mbit: 400, ranks: {ranks}}}" for h in range(hosts)]
    return "\n".join(lines) + "\n"


def _run(rank: int, world: int, profile_path: str, seed: int):
    os.environ["SYNCPLANE_CLUSTER"] = profile_path
    from syncplane.algorithms.canary import CanaryConfig, CanaryEngine
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.comm import CommMeter
    from syncplane.exchanges import NestedExchange
    from syncplane.job import JobContext

    out = {}
    for compression, nics, in_host in (("none", 1, False), ("none", 2, False), ("sketch", 1, False),
                                       ("sketch", 2, False), ("sketch", 1, True), ("int8", 1, False)):
        transport = make_transport(CanaryConfig(compression=compression, nics=nics, compress_in_host=in_host,
                                                sync_timeout_s=60), JobContext.from_environment())
        nested = transport.exchange
        assert isinstance(nested, NestedExchange) and nested.parts == nics
        engine = CanaryEngine(SIZES, world, transport)
        colayers = [c.clone() for c in colayer_grads(world, seed, SIZES)[rank]]
        meter = CommMeter()
        engine.exchange_all_(colayers, meter)
        predicted = sum(transport.bytes_per_round(size) for size in SIZES)
        out[(compression, nics, in_host)] = (colayers, meter.bytes_sent, predicted, nested.radices,
                                             sorted(nested.exact_levels))
        transport.close()
    return out


def _reference(inputs: list[torch.Tensor], radices: list[int], streams: int, exact: list[int],
               compression: str) -> torch.Tensor:
    """The nested exchange with a lossy codec, by its definition, all ranks in one process:
    the reduce-scatter of an ``exact`` level sends raw fp32."""
    from syncplane.algorithms.canary import CanaryConfig
    from syncplane.comm import shard_bounds
    from syncplane.exchanges.digit import _mixed_digit, nested_schedule

    codec = CanaryConfig(compression=compression).codec()
    n = len(inputs)

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return codec.extract(codec.compress(x.contiguous()), x.numel())

    bounds = [[(a + lo, a + hi) for lo, hi in shard_bounds(b - a, n)] for a, b in shard_bounds(inputs[0].numel(), streams)]
    partial = [[{p: inputs[r][lo:hi] for p, (lo, hi) in enumerate(s)} for s in bounds] for r in range(n)]
    plans = [nested_schedule(radices, r, streams) for r in range(n)]
    for k in range(len(radices)):
        after = [[dict(d) for d in partial[r]] for r in range(n)]
        for r in range(n):
            for step in plans[r][k]:
                t, mine = step.stream, _mixed_digit(radices, r, step.level)
                sources = {_mixed_digit(radices, peer, step.level): peer for peer in step.recvs}
                kept = next(iter(step.recvs.values()))
                summed = {}
                for p in kept:
                    acc = None
                    for v in range(radices[step.level]):
                        theirs = partial[sources[v]][t][p] if v != mine else None
                        value = (partial[r][t][p] if theirs is None
                                 else theirs if step.level in exact else round_trip(theirs))
                        acc = value.clone() if acc is None else acc.add_(value)
                    summed[p] = acc
                after[r][t] = summed
        partial = after
    out = torch.empty_like(inputs[0])
    for t, s in enumerate(bounds):
        for p, (lo, hi) in enumerate(s):
            out[lo:hi] = round_trip(partial[p][t][p] / n)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("racks, hosts, ranks", [(1, 2, 2), (2, 3, 1), (2, 1, 3)])
def test_nested_exchange_is_the_dense_mean_and_the_sketch_its_definition(tmp_path, racks, hosts, ranks):
    world = racks * hosts * ranks
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}, {racks} rack(s) x {hosts} host(s) x {ranks} rank(s)")
    profile = tmp_path / "nested.yaml"
    profile.write_text(_profile(racks, hosts, ranks))
    results = run_distributed(_run, world, str(profile), seed, timeout=240)
    grads = colayer_grads(world, seed, SIZES)
    expected_radices = [a for a in (ranks, hosts, racks) if a > 1]
    in_host_level = [0] if ranks > 1 else []          # what ranks of one host send each other is exact
    for nics, in_host in ((1, False), (2, False), (1, True)):
        exact = [] if in_host else in_host_level
        # int8's pieces (1031 values: 1/n of them is no multiple of 4) sit in a message off a
        # 4-byte boundary, where its fp32 scales once failed to be read
        lossy = ("sketch", "int8") if nics == 1 and not in_host else ("sketch",)
        references = {codec: [_reference([grads[r][c] for r in range(world)], expected_radices, nics, exact, codec)
                              for c in range(len(SIZES))] for codec in lossy}
        for rank in range(world):
            for compression in ("none", *lossy):
                if compression == "none" and in_host:
                    continue
                mine, sent, predicted, radices, exact_levels = results[rank][(compression, nics, in_host)]
                assert radices == expected_radices and sent == predicted > 0
                assert exact_levels == exact
                for c in range(len(SIZES)):
                    if compression == "none":
                        assert_fp32_mean(mine[c], [grads[r][c] for r in range(world)], (rank, nics, c))
                        # the sum order is the digits', whatever the stream count
                        assert torch.equal(mine[c], results[0][("none", 1, False)][0][c])
                    else:
                        assert torch.equal(mine[c], references[compression][c]), (rank, compression, nics, in_host, c)
    assert math.prod(expected_radices) == world


def _refused(rank: int, world: int):
    from syncplane.algorithms.canary import CanaryConfig
    from syncplane.algorithms.canary.exchange import make_transport
    from syncplane.config import ConfigError
    from syncplane.job import JobContext

    try:
        make_transport(CanaryConfig(exchange="nested"), JobContext.from_environment())
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_nested_on_ranks_that_are_not_grouped_is_refused_on_every_rank():
    messages = run_distributed(_refused, 3, timeout=90)
    assert all(m is not None and m.startswith("exchange: nested needs the ranks grouped") for m in messages), messages
