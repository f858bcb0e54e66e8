"""The chunked top-k codec's CUDA kernels against the CPU reference, bit for bit, on random,
heavy-tailed, outlier-laden and all-zero inputs (fresh seeds from ``test_seed``)."""

from __future__ import annotations

import pytest
import torch

from syncplane import kernels
from tests.helpers.sparse_inputs import KINDS, SHAPES, sample


def test_cuda_sparse_kernels_are_the_ones_that_run():
    before = kernels.call_counts[("sparse_encode", "cuda_ext")]
    kernels.sparse_encode(torch.ones(100, device="cuda"), 3, 64, 2)
    assert kernels.call_counts[("sparse_encode", "cuda_ext")] == before + 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel,k,chunk,bits", SHAPES + [(1_000_003, 41, 4096, 2)])
def test_cuda_sparse_codec_equals_cpu_reference(kind, numel, k, chunk, bits, test_seed):
    x = sample(kind, numel, test_seed)
    on_gpu = kernels.sparse_encode(x.cuda(), k, chunk, bits)
    reference = kernels.sparse_encode(x, k, chunk, bits, backend="torch")
    assert torch.equal(on_gpu.cpu(), reference)
    other = kernels.sparse_encode(sample("gaussian", numel, test_seed + 1), k, chunk, bits, backend="torch")
    base = sample("gaussian", numel, test_seed + 2)
    got = kernels.sparse_decode_add([on_gpu, other.cuda(), on_gpu], base.cuda(), k, chunk, bits, 1 / 3)
    want = kernels.sparse_decode_add([reference, other, reference], base.clone(), k, chunk, bits, 1 / 3,
                                     backend="torch")
    assert torch.equal(got.cpu(), want)


def test_cuda_sparse_decode_refuses_a_corrupt_bitmap():
    data = kernels.sparse_encode(torch.randn(128, device="cuda"), 16, 64, 2)   # bitmap chunks
    data[8:16] = 0
    with pytest.raises(RuntimeError, match="corrupt"):
        kernels.sparse_decode_add([data], torch.zeros(128, device="cuda"), 16, 64, 2)
