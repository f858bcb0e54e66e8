"""The chunked top-k codec (SparseLoCo's): compiled CPU kernel equal to the torch reference
bit for bit, its layout and sizes, its error bound, and decode-accumulate of several pieces."""

from __future__ import annotations

import math

import pytest
import torch

from syncplane import kernels
from syncplane.comm import ChunkedTopK
from tests.helpers.sparse_inputs import KINDS, SHAPES, sample


def decode(x_numel: int, payloads: list[torch.Tensor], k: int, chunk: int, bits: int, backend: str,
           base: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    out = torch.zeros(x_numel) if base is None else base.clone()
    return kernels.sparse_decode_add(payloads, out, k, chunk, bits, scale, backend=backend)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel,k,chunk,bits", SHAPES)
def test_kernel_equals_reference_bit_for_bit(kind, numel, k, chunk, bits, test_seed):
    x = sample(kind, numel, test_seed)
    before = kernels.call_counts[("sparse_encode", "cpu_ext")]
    data = kernels.sparse_encode(x, k, chunk, bits)
    assert kernels.call_counts[("sparse_encode", "cpu_ext")] == before + 1   # the compiled path ran
    reference = kernels.sparse_encode(x, k, chunk, bits, backend="torch")
    assert data.numel() == kernels.sparse_layout(numel, k, chunk, bits).nbytes
    assert torch.equal(data, reference)
    # decode-accumulate: several pieces, a non-zero base and a scale that rounds
    other = kernels.sparse_encode(sample("gaussian", numel, test_seed + 1), k, chunk, bits)
    base = sample("gaussian", numel, test_seed + 2)
    got = decode(numel, [data, other, data], k, chunk, bits, "ext", base, 1 / 3)
    want = decode(numel, [data, other, data], k, chunk, bits, "torch", base, 1 / 3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_keeps_each_chunks_top_k_within_a_level(kind, bits, test_seed):
    """Per chunk, exactly the k largest magnitudes (ties: lower index) come back, each within
    one level a/M of its value (M = 2^(bits-1); the scale a: the largest magnitude, at most
    c_bits times the median kept one) or, above a, clipped to ±a; every other value is 0."""
    chunk, k, n = 256, 9, 256 * 7 + 100
    x = sample(kind, n, test_seed)
    codec = ChunkedTopK(density=k / chunk, bits=bits, chunk=chunk)
    assert codec.k == k
    y = codec.extract(codec.compress(x), n)
    levels = 2 ** (bits - 1)
    for start in range(0, n, chunk):
        xc, yc = x[start:start + chunk], y[start:start + chunk]
        order = sorted(range(xc.numel()), key=lambda i: (-abs(float(xc[i])), i))[:min(k, xc.numel())]
        kept = torch.zeros(xc.numel(), dtype=torch.bool)
        kept[order] = True
        assert torch.equal(yc[~kept], torch.zeros(int((~kept).sum())))
        largest, median = abs(float(xc[order[0]])), abs(float(xc[order[(len(order) - 1) // 2]]))
        a = min(largest, kernels.SPARSE_CLIP[bits] * median) if median > 0 else largest
        inside = kept & (xc.abs() <= a)
        assert torch.all((yc[inside] - xc[inside]).abs() <= a / levels * (1 + 1e-6))
        above = kept & (xc.abs() > a)
        assert torch.equal(yc[above], torch.sign(xc[above]) * a)
        if a > 0:
            assert torch.all(torch.sign(yc[kept]) == torch.sign(xc[kept]))


def test_relative_error_falls_with_bits(test_seed):
    """On what the codec keeps, 8 bits is closer than 4, and 4 than 2 (measured on the kept
    values alone: the dropped ones are error feedback's business)."""
    x = sample("student_t3", 50_000, test_seed)
    errors = []
    for bits in (2, 4, 8):
        codec = ChunkedTopK(0.03, bits, 1024)
        y = codec.extract(codec.compress(x), x.numel())
        kept = y != 0
        errors.append(float((y[kept] - x[kept]).norm() / x[kept].norm()))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.01


def _index_bits(mode: str, k: int, length: int) -> int:
    """The three encodings' sizes, written out from the layout's definition."""
    if mode == "bitmap":
        return length
    if mode == "offsets":
        return k * max(1, (length - 1).bit_length())
    low = int(math.floor(math.log2(length / k)))
    return k * low + k + (length - 1) // 2**low + 1


@pytest.mark.parametrize("density,chunk,mode", [(0.01, 4096, "elias_fano"), (0.03, 4096, "elias_fano"),
                                                (0.1, 4096, "elias_fano"), (0.3, 4096, "bitmap"),
                                                (1 / 4096, 4096, "offsets"), (0.05, 64, "offsets"),
                                                (0.2, 64, "elias_fano"), (0.5, 64, "bitmap")])
def test_layout_sends_the_smallest_index_encoding(density, chunk, mode):
    codec = ChunkedTopK(density, 2, chunk)
    k = codec.k
    layout = codec.layout(10 * chunk)
    sizes = {m: _index_bits(m, k, chunk) for m in ("bitmap", "offsets", "elias_fano")}
    assert layout.index_mode(chunk) == mode
    assert sizes[mode] == min(sizes.values())
    assert layout.index_bytes(chunk) == math.ceil(sizes[mode] / 8)
    assert codec.nbytes(10 * chunk) == 10 * (4 + layout.index_bytes(chunk) + math.ceil(k * 2 / 8))


@pytest.mark.parametrize("density,chunk", [(0.01, 4096), (0.03, 4096), (0.1, 4096), (1 / 4096, 4096),
                                           (0.05, 64), (0.5, 64), (0.02, 300)])
@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_every_index_encoding_round_trips(density, chunk, backend, test_seed):
    """Each mode, with a tail chunk of its own mode, decodes the kept values back in place."""
    codec = ChunkedTopK(density, 8, chunk)
    n = 5 * chunk + chunk // 3 + 1
    x = sample("student_t3", n, test_seed)
    data = kernels.sparse_encode(x, codec.k, chunk, 8, backend=backend)
    y = kernels.sparse_decode_add([data], torch.zeros(n), codec.k, chunk, 8, backend=backend)
    for start in range(0, n, chunk):
        xc, yc = x[start:start + chunk], y[start:start + chunk]
        top = torch.sort(xc.abs(), descending=True, stable=True).indices[:min(codec.k, xc.numel())]
        assert torch.equal(torch.sort(yc.nonzero().flatten()).values, torch.sort(top).values)


def test_compression_ratios_at_sparselocos_settings():
    """Chunks of 4096 at 2 bits, positions in Elias-Fano: 1 % is 59 bytes per chunk (277x
    smaller than fp32), 3 % is 144 (113x); bit-packed offsets would take 77 and 220."""
    n = 4096 * 100
    assert ChunkedTopK(0.01, 2, 4096).nbytes(n) == 59 * 100
    assert ChunkedTopK(0.03, 2, 4096).nbytes(n) == 144 * 100
    assert 4 * n / ChunkedTopK(0.01, 2, 4096).nbytes(n) > 270
    assert 4 * n / ChunkedTopK(0.03, 2, 4096).nbytes(n) > 110


def test_decode_add_is_the_ordered_sum_of_extracts(test_seed):
    codec = ChunkedTopK(0.05, 4, 512)
    n = 3000
    pieces = [codec.compress(sample("gaussian", n, test_seed + r) * (r + 1)) for r in range(4)]
    expected = torch.zeros(n)
    for p in pieces:
        expected = expected + codec.extract(p, n)   # one rounding per add, in order
    assert torch.equal(codec.decode_add(pieces, torch.zeros(n)), expected)


@pytest.mark.parametrize("kwargs,key", [({"density": 0.0}, "density"), ({"density": 1.01}, "density"),
                                        ({"bits": 3}, "bits"), ({"bits": 16}, "bits"), ({"chunk": 0}, "chunk")])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        ChunkedTopK(**kwargs)


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize("density,chunk", [(0.25, 64), (0.03, 4096)])   # a bitmap, Elias-Fano
def test_malformed_payloads_are_refused(backend, density, chunk):
    codec = ChunkedTopK(density, 2, chunk)
    n = 2 * chunk
    data = codec.compress(torch.randn(n))
    layout = codec.layout(n)
    with pytest.raises(ValueError, match="payload 0"):
        kernels.sparse_decode_add([data[:-1]], torch.zeros(n), codec.k, chunk, 2, backend=backend)
    index_at, index_bytes = 4 * 2, layout.index_bytes(chunk)
    emptied = data.clone()
    emptied[index_at:index_at + index_bytes] = 0   # chunk 0 sends no position
    flooded = data.clone()
    flooded[index_at:index_at + index_bytes] = 255   # chunk 0 sends too many
    for broken in (emptied, flooded):
        with pytest.raises((RuntimeError, ValueError), match="corrupt payload"):
            kernels.sparse_decode_add([broken], torch.zeros(n), codec.k, chunk, 2, backend=backend)
