"""Global collectives over buckets, on real gloo processes, against a dense reference."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _allreduce_mean(rank: int, world: int, shapes, dtype_name: str, seed: int):
    import torch

    from syncplane.comm import CommMeter, allreduce_mean_, make_buckets

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed + rank)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    original = [t.clone() for t in tensors]
    meter = CommMeter()
    allreduce_mean_(make_buckets(tensors, cap_bytes=256), meter=meter)
    return original, tensors, meter.bytes_sent


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_allreduce_mean_equals_dense_mean(world, dtype_name, test_seed):
    seed = test_seed
    shapes = [(5, 3), (40,), (1,), (7, 7)]
    results = run_distributed(_allreduce_mean, world, shapes, dtype_name, seed)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype_name == "float32" else dict(rtol=2e-2, atol=2e-2)
    for i in range(len(shapes)):
        expected = torch.stack([r[0][i].double() for r in results]).mean(dim=0)
        for rank in range(world):
            torch.testing.assert_close(results[rank][1][i].double(), expected, **tol)
    payload = sum(torch.Size(s).numel() for s in shapes) * torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    assert results[0][2] == pytest.approx(2 * (world - 1) / world * payload, abs=4 * world)


def _distance(rank: int, world: int, seed: int):
    import torch

    from syncplane.comm import mean_and_distance

    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(50, generator=g)
    return x, mean_and_distance([x[:20], x[20:]])


def test_consensus_distance_matches_definition(test_seed):
    seed = test_seed
    results = run_distributed(_distance, 3, seed)
    xs = torch.stack([r[0].double() for r in results])
    mean = xs.mean(dim=0)
    expected = float(((xs - mean).norm(dim=1) / mean.norm()).mean())
    for _, got in results:
        assert got == pytest.approx(expected, rel=1e-9)
