"""Tensor fusion: bucket boundaries and round trips."""

from __future__ import annotations

import pytest
import torch

from syncplane.comm import CommMeter, flat_bucket_sizes, make_buckets, ring_allreduce_bytes


def test_buckets_respect_cap_dtype_and_order():
    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float16), torch.zeros(1)]
    buckets = make_buckets(tensors, cap_bytes=80)  # 20 float32 per bucket
    layout = [[t.numel() for t in b.tensors] for b in buckets]
    assert layout == [[10, 10], [30], [5], [1]]
    assert [b.buffer.dtype for b in buckets] == [torch.float32, torch.float32, torch.float16, torch.float32]
    assert sum(len(b.tensors) for b in buckets) == len(tensors)


def test_a_first_cap_closes_the_first_bucket_only():
    tensors = [torch.zeros(n) for n in (4, 4, 4, 10, 10)]
    layout = [[t.numel() for t in b.tensors] for b in make_buckets(tensors, cap_bytes=80, first_cap_bytes=32)]
    assert layout == [[4, 4], [4, 10], [10]]
    assert [[t.numel() for t in b.tensors] for b in make_buckets(tensors, cap_bytes=80)] == [[4, 4, 4], [10, 10]]


@pytest.mark.parametrize("numel, cap, first", [(1, 8, None), (57, 12, None), (57, 12, 5), (57, 12, 64), (40, 40, 4)])
def test_flat_bucket_sizes_cut_as_make_buckets_cuts_single_values(numel, cap, first):
    singles = [torch.zeros(1) for _ in range(numel)]
    expected = [b.buffer.numel() for b in make_buckets(singles, cap_bytes=cap, first_cap_bytes=first)]
    assert flat_bucket_sizes(numel, 4, cap, first) == expected and sum(expected) == numel


def test_pack_unpack_round_trip_through_buckets():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(4, 4), (3,), (100,)]]
    originals = [t.clone() for t in tensors]
    for bucket in make_buckets(tensors, cap_bytes=64):
        bucket.pack()
        for t in bucket.tensors:
            t.zero_()
        bucket.unpack(scale=2.0)
    for t, o in zip(tensors, originals):
        torch.testing.assert_close(t, 2 * o)


def test_buckets_take_channels_last_tensors():
    """ResNet-50 runs channels_last on a GPU: its conv weights must bucket and round-trip."""
    g = torch.Generator().manual_seed(3)
    conv = torch.randn(8, 4, 3, 3, generator=g).to(memory_format=torch.channels_last)
    tensors = [conv, torch.randn(8, generator=g)]
    originals = [t.clone() for t in tensors]
    (bucket,) = make_buckets(tensors)
    bucket.pack(scale=2.0)
    for t in tensors:
        t.zero_()
    bucket.unpack(scale=0.25)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    for t, o in zip(tensors, originals):
        torch.testing.assert_close(t, 0.5 * o)


def test_bad_bucket_inputs():
    with pytest.raises(ValueError, match="gaps in memory"):
        make_buckets([torch.zeros(3, 8)[:, ::2]])
    with pytest.raises(ValueError, match="positive"):
        make_buckets([torch.zeros(3)], cap_bytes=0)
    with pytest.raises(ValueError, match="first bucket cap must be positive"):
        make_buckets([torch.zeros(3)], first_cap_bytes=0)
    with pytest.raises(ValueError, match="first bucket cap must be positive"):
        flat_bucket_sizes(3, 4, 8, -1)


def test_meter_counts_overlap_once():
    meter = CommMeter()
    meter.record(0.0, 1.0, 10)
    meter.record(0.5, 1.5, 10)    # overlaps the first by 0.5 s
    meter.record(3.0, 4.0, 10)
    assert meter.seconds == pytest.approx(2.5)
    assert meter.bytes_sent == 30 and meter.calls == 3


def test_ring_allreduce_bytes():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 8) == 1750
