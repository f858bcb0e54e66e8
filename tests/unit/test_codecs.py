"""Codecs as values: exact identity, int8 blockwise error bound, error feedback, shard bounds."""

from __future__ import annotations

import pytest
import torch

from syncplane.comm import (ChunkedTopK, ErrorFeedback, Fp32, GradientSketch, Int8Blockwise, make_codec,
                            shard_bounds)
from syncplane.comm.codecs import Undo, add_extracted_
from syncplane.comm.streams import kept


def _tensors(n: int = 5000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)   # StudentT samples from the global generator
    outliers = torch.randn(n, generator=g)
    outliers[torch.randint(0, n, (10,), generator=g)] *= 1000.0
    return {"gaussian": torch.randn(n, generator=g),
            "student_t3": torch.distributions.StudentT(3.0).sample((n,)),
            "outliers": outliers}


def test_fp32_is_exact_and_sized(test_seed):
    x = torch.randn(37, generator=torch.Generator().manual_seed(test_seed))
    data = Fp32().compress(x)
    assert data.dtype == torch.uint8 and data.numel() == Fp32().nbytes(37) == 37 * 4
    assert torch.equal(Fp32().extract(data, 37), x)


@pytest.mark.parametrize("block", [1, 7, 64, 256])
@pytest.mark.parametrize("kind", ["gaussian", "student_t3", "outliers"])
def test_int8_error_is_within_half_a_step_of_its_block(block, kind):
    x = _tensors()[kind]
    codec = Int8Blockwise(block)
    data = codec.compress(x)
    assert data.numel() == codec.nbytes(x.numel()) == -(-x.numel() // block) * 4 + x.numel()
    y = codec.extract(data, x.numel())
    padded = torch.zeros(-(-x.numel() // block) * block)
    padded[: x.numel()] = x
    step = padded.view(-1, block).abs().amax(dim=1).repeat_interleave(block)[: x.numel()] / 127
    assert torch.all((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30)
    # per-block scaling keeps the heavy tail: the relative error stays small on every
    # distribution (measured: <= 1.7% at block 256), and below one global scale's
    relative = ((y - x).norm() / x.norm()).item()
    assert relative < 0.02
    whole = Int8Blockwise(x.numel())
    assert relative <= ((whole.extract(whole.compress(x), x.numel()) - x).norm() / x.norm()).item() + 1e-9


def test_int8_handles_zeros_and_empty():
    codec = Int8Blockwise(4)
    assert torch.equal(codec.extract(codec.compress(torch.zeros(10)), 10), torch.zeros(10))
    assert codec.compress(torch.zeros(0)).numel() == 0
    assert codec.extract(codec.compress(torch.zeros(0)), 0).numel() == 0


def test_error_feedback_keeps_the_running_sum_close():
    """Sent values summed over rounds differ from the true sum by at most one residual."""
    codec = Int8Blockwise(32)
    feedback = ErrorFeedback(codec, 1000)
    g = torch.Generator().manual_seed(1)
    true_sum, sent_sum, plain_sum = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    for _ in range(50):
        x = torch.randn(1000, generator=g) * 1e-3 + 1e-4   # a small bias int8 rounding would lose
        true_sum += x
        sent_sum += codec.extract(feedback.compress(x), 1000)
        plain_sum += codec.extract(codec.compress(x), 1000)
    assert torch.allclose(true_sum - sent_sum, feedback.residual, atol=1e-6)
    assert (true_sum - sent_sum).abs().max() < (true_sum - plain_sum).abs().max()


def test_error_feedback_slices_and_restore(test_seed):
    g = torch.Generator().manual_seed(test_seed)
    feedback = ErrorFeedback(Int8Blockwise(8), 20)
    before = feedback.snapshot()
    feedback.compress(torch.randn(10, generator=g), offset=10)
    assert torch.equal(feedback.residual[:10], torch.zeros(10)) and feedback.residual[10:].abs().sum() > 0
    feedback.restore(before)
    assert torch.equal(feedback.residual, torch.zeros(20))
    with pytest.raises(ValueError, match=r"slice \[15, 25\) is outside"):
        feedback.compress(torch.randn(10, generator=g), offset=15)
    # a round saves and puts back only the slice it touches; the rest is not copied
    feedback.compress(torch.randn(10, generator=g), offset=0)
    kept = feedback.residual[:10].clone()
    saved = feedback.snapshot(10, 10)
    assert saved.numel() == 10
    feedback.compress(torch.randn(10, generator=g), offset=10)
    feedback.restore(saved, 10)
    assert torch.equal(feedback.residual[10:], torch.zeros(10)) and torch.equal(feedback.residual[:10], kept)


CODECS = [Fp32(), Int8Blockwise(64), GradientSketch(), ChunkedTopK(density=0.05, bits=4, chunk=512)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: type(c).__name__)
def test_extract_into_a_buffer_gives_the_same_bits(codec, test_seed):
    """``extract(out=)`` writes into the caller's buffer what ``extract`` returns, whatever the
    buffer held before, and refuses a buffer of the wrong size or type."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(test_seed))
    data = codec.compress(x)
    out = torch.full((3000,), float("nan"))
    assert codec.extract(data, 3000, out=out) is out
    assert torch.equal(out, codec.extract(data, 3000))
    for bad in (torch.empty(2999), torch.empty(3000, dtype=torch.float64)):
        with pytest.raises(ValueError, match="out must be a contiguous 1-D float32 tensor of 3000 values"):
            codec.extract(data, 3000, out=bad)


@pytest.mark.parametrize("start", [4, 1, 3], ids=lambda s: f"at{s}")
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: type(c).__name__)
def test_compress_into_a_buffer_gives_the_same_bytes(codec, start, test_seed):
    """``compress(out=)`` (an exchange's send buffer, a slice of a larger message) writes what
    ``compress`` returns, whatever the buffer held and wherever the slice starts (a piece
    follows one of any length: int8's and fp32's fp32 fields then sit off a 4-byte
    boundary), and ``extract`` reads it back there; it refuses a buffer of the wrong size,
    type or shape; ``ErrorFeedback`` passes it through and updates the same residuals."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(test_seed))
    nbytes = codec.nbytes(3000)
    message = torch.full((nbytes + start + 4,), 0xA5, dtype=torch.uint8)
    place = message[start:start + nbytes]
    assert codec.compress(x, out=place).data_ptr() == place.data_ptr()
    assert torch.equal(place, codec.compress(x))
    assert torch.equal(message[:start], torch.full((start,), 0xA5, dtype=torch.uint8))
    assert torch.equal(message[-4:], torch.full((4,), 0xA5, dtype=torch.uint8))
    assert torch.equal(codec.extract(place, 3000), codec.extract(codec.compress(x), 3000))
    for bad in (torch.empty(nbytes - 1, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.int8),
                torch.empty(2 * nbytes, dtype=torch.uint8)[::2]):
        with pytest.raises(ValueError, match="out must be|bytes"):
            codec.compress(x, out=bad)
    fresh, into = ErrorFeedback(codec, 3000), ErrorFeedback(codec, 3000)
    for _ in range(2):
        expected = fresh.compress(x)
        assert torch.equal(into.compress(x, out=place), expected)
        assert torch.equal(into.residual, fresh.residual)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: type(c).__name__)
def test_add_extracted_is_out_plus_scale_times_extract_bit_for_bit(codec, test_seed):
    """``add_extracted_`` (the sketch's in one pass, the others through a scratch buffer or a
    fresh one) equals ``out + scale * extract``, signed zeros included."""
    g = torch.Generator().manual_seed(test_seed)
    data = codec.compress(torch.randn(3000, generator=g))
    start = torch.randn(3000, generator=g)
    start[::5] = -0.0
    for scale in (1.0, -1.0):
        wanted = start + scale * codec.extract(data, 3000)
        for scratch in (None, lambda: torch.full((3000,), float("nan"))):
            got = add_extracted_(codec, data, start.clone(), scale, scratch=scratch)
            assert torch.equal(got.view(torch.int32), wanted.view(torch.int32)), (scale, scratch)


@pytest.mark.parametrize("beta", [1.0, 0.9])
@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: type(c).__name__)
def test_error_feedback_in_place_is_its_definition_bit_for_bit(codec, beta, test_seed):
    """``e <- (β·e + x) - extract(compress(β·e + x))``, computed out of place here, equals the
    in-place update over several rounds and slices."""
    g = torch.Generator().manual_seed(test_seed)
    feedback, e = ErrorFeedback(codec, 4000, beta), torch.zeros(4000)
    for offset, n in [(0, 4000), (1000, 2000), (0, 4000), (3000, 1000)]:
        x = torch.randn(n, generator=g)
        wanted = (e[offset:offset + n] if beta == 1.0 else e[offset:offset + n] * beta) + x
        expected = codec.compress(wanted)
        e[offset:offset + n] = wanted - codec.extract(expected, n)
        assert torch.equal(feedback.compress(x, offset), expected)
        assert torch.equal(feedback.residual, e)


def test_undo_puts_back_exactly_what_a_round_overwrote(test_seed):
    """An ``Undo`` saves each slice just before a compression overwrites it (overlaps too) and
    restores them all; a compression it did not record stays."""
    g = torch.Generator().manual_seed(test_seed)
    a, b = ErrorFeedback(Int8Blockwise(8), 100), ErrorFeedback(Int8Blockwise(8), 100)
    for f in (a, b):
        f.compress(torch.randn(100, generator=g))
    before_a, before_b = a.residual.clone(), b.residual.clone()
    undo = Undo()
    ra, rb = undo.recording(a), undo.recording(b)
    ra.compress(torch.randn(40, generator=g), offset=10)
    ra.compress(torch.randn(40, generator=g), offset=30)       # overlaps the first slice
    rb.compress(torch.randn(20, generator=g), offset=80)
    assert not torch.equal(a.residual, before_a) and not torch.equal(b.residual, before_b)
    undo.restore()
    assert torch.equal(a.residual, before_a) and torch.equal(b.residual, before_b)
    a.compress(torch.randn(10, generator=g))
    kept = a.residual.clone()
    undo.restore()                                             # nothing recorded since
    assert torch.equal(a.residual, kept)


def test_undo_into_kept_buffers_restores_each_round(test_seed):
    """Rounds whose ``Undo`` saves into the same kept buffers (a runner's workspace, reused by
    the next round) each put back exactly their own round's slices."""
    g = torch.Generator().manual_seed(test_seed)
    feedback, workspace = ErrorFeedback(GradientSketch(), 5000), {}

    def scratch(i: int, numel: int) -> torch.Tensor:
        return kept(workspace, ("undo", i), numel, torch.float32)

    for offset, n in [(0, 5000), (1000, 2000), (0, 1500)]:
        before = feedback.residual.clone()
        undo = Undo(scratch)
        recorded = undo.recording(feedback)
        recorded.compress(torch.randn(n, generator=g), offset)
        recorded.compress(torch.randn(n // 2, generator=g), offset + n // 4)     # overlaps the first
        undo.restore()
        assert torch.equal(feedback.residual, before)
        feedback.compress(torch.randn(n, generator=g), offset)                  # the round that counts
    assert {key for key in workspace} == {("undo", 0), ("undo", 1)}
    assert workspace["undo", 0].numel() == 5000                                  # the largest, reused


def test_bad_codec_inputs_name_the_value():
    with pytest.raises(ValueError, match="unknown compression 'zip'; allowed values: none, int8"):
        make_codec("zip")
    with pytest.raises(ValueError, match="block size must be at least 1, got 0"):
        Int8Blockwise(0)
    with pytest.raises(TypeError, match="float32"):
        Int8Blockwise().compress(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected 7 bytes"):
        Int8Blockwise(4).extract(torch.zeros(6, dtype=torch.uint8), 3)


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 13, 97, 1009, 4096])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8, 16])
def test_shards_cover_the_buffer_without_gap_or_overlap(numel, shards):
    bounds = shard_bounds(numel, shards)
    assert len(bounds) == shards
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c and a <= b
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == numel
    covered = torch.zeros(numel, dtype=torch.int64)
    for a, b in bounds:
        covered[a:b] += 1
    assert torch.all(covered == 1)


def test_shard_bounds_reject_bad_values():
    with pytest.raises(ValueError, match="shards must be at least 1, got 0"):
        shard_bounds(10, 0)
    with pytest.raises(ValueError, match="numel must be non-negative, got -1"):
        shard_bounds(-1, 2)
