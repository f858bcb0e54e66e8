"""The CUDA kernels compile and link against the installed torch with this machine's nvcc.

They cannot run without a GPU; on a GPU machine the same comparisons as the CPU tests
run against them.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from syncplane import ext, kernels

pytestmark = pytest.mark.cuda_build


@pytest.mark.skipif(torch.version.cuda is None, reason="CPU-only torch build: CUDA kernels cannot be linked")
@pytest.mark.skipif(ext._find_cuda_home() is None and shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_compile_and_load():
    module = ext.load_cuda()
    assert {"pack", "unpack", "weighted_combine", "sketch_encode", "sketch_decode", "sparse_encode",
            "sparse_decode_add"} <= set(dir(module))
    assert ext.status()["cuda_kernels"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine: CUDA kernels compile-only")
def test_cuda_kernels_match_reference_on_gpu():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).cuda() for s in [(3, 5), (17,), (1000,)]]
    flat = kernels.pack(tensors, scale=0.5)
    torch.testing.assert_close(flat.cpu(), kernels.pack_reference([t.cpu() for t in tensors],
                                                                  torch.empty(1032), 0.5))
    ys = [torch.randn(1032, generator=g).cuda() for _ in range(20)]  # > one launch batch
    got = kernels.weighted_combine(flat, ys, [0.1] * 20, 0.3)
    torch.testing.assert_close(got, kernels.weighted_combine_reference(flat, ys, [0.1] * 20, 0.3))
    # the gradient sketch: bit-identical to the CPU reference (codes, codebook, exact values)
    x = torch.randn(70_001, generator=g)
    x[::1000] *= 1000.0
    x[[3, 5, 7]] = torch.tensor([float("nan"), float("inf"), -float("inf")])     # sent exactly, coded too
    k = 351
    on_gpu = kernels.sketch_encode(x.cuda(), k, 8192, 0.3)
    assert torch.equal(on_gpu.cpu(), kernels.sketch_encode(x, k, 8192, 0.3, backend="torch"))
    assert torch.equal(kernels.sketch_decode(on_gpu, k, 70_001).cpu().view(torch.int32),
                       kernels.sketch_decode(on_gpu.cpu(), k, 70_001, backend="torch").view(torch.int32))
    start = torch.randn(70_001, generator=g)
    torch.testing.assert_close(kernels.sketch_decode_add(on_gpu, k, start.cuda(), -1.0).cpu(),  # decoded, then added
                               kernels.sketch_decode_add(on_gpu.cpu(), k, start.clone(), -1.0, backend="torch"),
                               rtol=0, atol=0, equal_nan=True)      # a GPU's NaN need not keep its payload
