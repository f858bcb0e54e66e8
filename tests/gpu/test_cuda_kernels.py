"""The CUDA kernels (pack, unpack, weighted_combine) and every codec on CUDA tensors,
against the CPU references, on seeded random inputs (the seed is printed)."""

from __future__ import annotations

import pytest
import torch

from syncplane import kernels
from syncplane.comm import codecs

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES_LISTS = [
    [()], [(7,)], [(3, 5), (0,), (17,), (2, 3, 4)], [(1,)] * 50, [(1024, 257), (33,), (64, 64)],
    [(8, 4, 3, 3), (5,)],                  # a conv weight (made channels_last below)
]
SEED = 20261122


def exact_or(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}.get(
        dtype, dict(rtol=1e-6, atol=1e-6))


def random_tensors(shapes, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    return [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tensors]


def test_cuda_kernels_are_the_ones_that_run():
    before = kernels.call_counts[("pack", "cuda_ext")]
    kernels.pack([torch.ones(3, device="cuda")])
    assert kernels.call_counts[("pack", "cuda_ext")] == before + 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES_LISTS)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_pack_unpack_match_cpu_reference(shapes, dtype, scale):
    print(f"seed {SEED}")
    cpu = random_tensors(shapes, dtype, SEED)
    gpu = [t.cuda() for t in cpu]
    assert all(g.stride() == c.stride() for g, c in zip(gpu, cpu))   # .cuda() keeps channels_last
    numel = kernels.numel_total(cpu)
    expected = kernels.pack_reference(cpu, torch.empty(numel, dtype=dtype), scale)
    flat = kernels.pack(gpu, scale=scale)
    torch.testing.assert_close(flat.cpu(), expected, **exact_or(dtype))
    # unpack into fresh tensors of the same layouts, against the CPU reference
    targets = [torch.zeros_like(t) for t in gpu]
    kernels.unpack(flat, targets, scale=2.0)
    reference = [torch.zeros_like(t) for t in cpu]
    kernels.unpack_reference(expected, reference, 2.0)
    for got, want in zip(targets, reference):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want, **exact_or(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,buffers", [(1, 1), (1000, 3), (4097, 20), (0, 2)])   # 20 > one launch batch
def test_weighted_combine_matches_cpu_reference(dtype, n, buffers):
    g = torch.Generator().manual_seed(SEED + n + buffers)
    x = torch.randn(n, generator=g).to(dtype)
    ys = [torch.randn(n, generator=g).to(dtype) for _ in range(buffers)]
    weights = [float(w) for w in torch.rand(buffers, generator=g)]
    expected = kernels.weighted_combine_reference(x, ys, weights, 0.3)
    got = kernels.weighted_combine(x.cuda(), [y.cuda() for y in ys], weights, 0.3)
    torch.testing.assert_close(got.cpu(), expected, **exact_or(dtype))
    # in place (out aliases x), as the neighbour exchange combines a bucket
    inplace = x.cuda()
    kernels.weighted_combine(inplace, [y.cuda() for y in ys], weights, 0.3, out=inplace)
    torch.testing.assert_close(inplace.cpu(), expected, **exact_or(dtype))


def test_kernels_refuse_gapped_and_mixed_device_tensors():
    with pytest.raises(RuntimeError, match="dense"):
        kernels.pack([torch.ones(4, 8, device="cuda")[:, ::2]], torch.empty(16, device="cuda"))
    with pytest.raises(RuntimeError, match="CUDA"):
        kernels.pack([torch.ones(4)], torch.empty(4, device="cuda"))


@pytest.mark.parametrize("name", ["none", "int8"])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 65_537])
def test_codecs_on_cuda_match_cpu(name, n):
    """Same bytes on the wire from a CUDA tensor as from the CPU one; same values back."""
    codec = codecs.make_codec(name, block=256)
    x = torch.randn(n, generator=torch.Generator().manual_seed(SEED + n)) * 3
    data_cpu, data_gpu = codec.compress(x), codec.compress(x.cuda())
    assert data_gpu.device.type == "cuda" and data_gpu.numel() == codec.nbytes(n)
    # a rounding tie may fall the other way on the GPU: at most one quantization level apart
    level = float(x.abs().max()) / 127 if name == "int8" else 0.0
    torch.testing.assert_close(codec.extract(data_gpu, n).cpu(), codec.extract(data_cpu, n),
                               rtol=0, atol=level * 1.001)
    assert (data_gpu.cpu() != data_cpu).float().mean().item() < 1e-3


def test_error_feedback_on_cuda_matches_cpu():
    codec = codecs.make_codec("int8", block=64)
    cpu, gpu = codecs.ErrorFeedback(codec, 5000), codecs.ErrorFeedback(codec, 5000)
    g = torch.Generator().manual_seed(SEED)
    for _ in range(3):
        x = torch.randn(5000, generator=g)
        sent_gpu, sent_cpu = gpu.compress(x.cuda()), cpu.compress(x)
        torch.testing.assert_close(codec.extract(sent_gpu.cpu(), 5000), codec.extract(sent_cpu, 5000),
                                   rtol=0, atol=float((x.abs().max() + 1) / 127 * 1.001))
