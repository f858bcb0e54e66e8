"""Compiled kernels against their pure-torch references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from syncplane import ext, kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES_LISTS = [
    [()],                                   # a single scalar
    [(7,)],
    [(3, 5), (0,), (17,), (2, 3, 4)],       # includes an empty tensor
    [(1,)] * 50,                            # many tiny tensors
    [(1024, 257), (33,), (64, 64)],         # larger than one parallel grain
]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}.get(
        dtype, dict(rtol=1e-6, atol=1e-6))


def random_tensors(shapes, dtype, generator):
    return [torch.randn(s, generator=generator, dtype=torch.float32).to(dtype) for s in shapes]


def test_compiled_cpu_extension_is_built_and_used():
    module = ext.load_cpu()
    assert {"pack", "unpack", "weighted_combine"} <= set(dir(module))
    before = kernels.call_counts[("pack", "cpu_ext")]
    kernels.pack([torch.ones(3)])
    assert kernels.call_counts[("pack", "cpu_ext")] == before + 1
    assert ext.status()["built"] is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES_LISTS, ids=lambda s: f"{len(s)}tensors")
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_pack_unpack_match_reference(dtype, shapes, scale, test_seed):
    g = torch.Generator().manual_seed(test_seed)
    tensors = random_tensors(shapes, dtype, g)
    total = sum(t.numel() for t in tensors)
    flat = kernels.pack(tensors, scale=scale)
    expected = kernels.pack_reference(tensors, torch.empty(total, dtype=dtype), scale)
    torch.testing.assert_close(flat, expected, **tolerance(dtype))
    if scale == 1.0:
        assert torch.equal(flat, expected)   # a plain pack is an exact copy

    targets = [torch.empty_like(t) for t in tensors]
    references = [torch.empty_like(t) for t in tensors]
    kernels.unpack(flat, targets, scale=1.0 / scale)
    kernels.unpack_reference(flat, references, scale=1.0 / scale)
    for got, want, original in zip(targets, references, tensors):
        torch.testing.assert_close(got, want, **tolerance(dtype))
        torch.testing.assert_close(got, original, **tolerance(dtype))


def test_pack_into_a_longer_buffer_leaves_the_tail():
    out = torch.full((10,), -1.0)
    kernels.pack([torch.arange(3.0), torch.arange(4.0)], out)
    assert out.tolist() == [0, 1, 2, 0, 1, 2, 3, -1, -1, -1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neighbours", [0, 1, 3, 17])
@pytest.mark.parametrize("numel", [1, 1000, 100_003])
def test_weighted_combine_matches_reference(dtype, neighbours, numel):
    g = torch.Generator().manual_seed(numel * 31 + neighbours)
    x = torch.randn(numel, generator=g).to(dtype)
    ys = [torch.randn(numel, generator=g).to(dtype) for _ in range(neighbours)]
    weights = torch.rand(neighbours, generator=g).tolist()
    self_weight = float(torch.rand(1, generator=g))
    got = kernels.weighted_combine(x, ys, weights, self_weight)
    # the reference in float64: the kernel accumulates in float32 and rounds once
    exact = x.double() * self_weight
    for w, y in zip(weights, ys):
        exact += w * y.double()
    torch.testing.assert_close(got, exact.to(dtype), **tolerance(dtype))
    torch.testing.assert_close(got, kernels.weighted_combine(x, ys, weights, self_weight, backend="torch"),
                               **tolerance(dtype))


def test_weighted_combine_in_place():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g)
    y = torch.randn(5000, generator=g)
    expected = 0.5 * x + 0.5 * y
    kernels.weighted_combine(x, [y], [0.5], 0.5, out=x)
    torch.testing.assert_close(x, expected)


def test_kernels_reject_mismatched_inputs():
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.pack([torch.ones(2, dtype=torch.float16)], torch.empty(2))
    with pytest.raises(RuntimeError, match="elements"):
        kernels.pack([torch.ones(5)], torch.empty(2))
    with pytest.raises(RuntimeError, match="not dense"):
        kernels.pack([torch.ones(4, 8)[:, ::2]], torch.empty(16))   # every other column: gaps
    with pytest.raises(RuntimeError, match="buffer 0"):
        kernels.weighted_combine(torch.ones(3), [torch.ones(4)], [1.0], 1.0)
    with pytest.raises(ValueError, match="2 buffers but 1 weights"):
        kernels.weighted_combine(torch.ones(3), [torch.ones(3)] * 2, [1.0], 1.0)


@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_pack_accepts_every_memory_format_in_memory_order(backend):
    """channels_last / channels_last_3d / transposed tensors are dense: packed as raw
    memory (so compiled kernels and reference agree) and unpacked back exactly."""
    g = torch.Generator().manual_seed(11)
    tensors = [torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
               torch.randn(2, 3, 2, 4, 5, generator=g).to(memory_format=torch.channels_last_3d),
               torch.randn(6, 7, generator=g).t(), torch.randn(9, generator=g)]
    flat = kernels.pack(tensors, backend=backend)
    # memory order, built independently: permute each tensor so its strides decrease
    expected = torch.cat([t.permute(*sorted(range(t.dim()), key=lambda d: -t.stride(d))).reshape(-1)
                          for t in tensors])
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)
    targets = [torch.zeros_like(t) for t in tensors]   # zeros_like keeps the memory format
    kernels.unpack(flat * 3, targets, scale=0.5, backend=backend)
    for t, target in zip(tensors, targets):
        assert target.stride() == t.stride()
        torch.testing.assert_close(target, 1.5 * t)


def test_flat_view_shares_memory_and_refuses_gaps():
    t = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    view = kernels.flat_view(t)
    view.mul_(0).add_(1)
    assert bool((t == 1).all())
    with pytest.raises(ValueError, match="gaps"):
        kernels.flat_view(torch.ones(4, 8)[:, ::2])
