"""The flat host copy of a model's tensors: whole, by slices that cut tensors, mixed in."""

from __future__ import annotations

import pytest
import torch

from syncplane.comm.host_mirror import HostMirror


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, 3, generator=g), torch.randn(4, generator=g), torch.randn(3, 1, generator=g)]


def test_round_trip_and_slices_that_cut_tensors():
    tensors = _tensors()
    mirror = HostMirror(tensors)
    assert mirror.spans == [(0, 6), (6, 10), (10, 13)] and mirror.buffer.numel() == 13
    mirror.to_host(tensors)
    torch.testing.assert_close(mirror.buffer, torch.cat([t.reshape(-1) for t in tensors]), rtol=0, atol=0)
    fresh = [torch.zeros_like(t) for t in tensors]
    mirror.from_host(fresh, 4, 11)                       # cuts tensor 0 and tensor 2
    flat = torch.cat([t.reshape(-1) for t in fresh])
    want = torch.zeros(13)
    want[4:11] = mirror.buffer[4:11]
    torch.testing.assert_close(flat, want, rtol=0, atol=0)


def test_mixing_in_keeps_alpha_of_the_tensor():
    tensors = _tensors()
    mirror = HostMirror(tensors)
    mirror.buffer.fill_(2.0)
    before = [t.clone() for t in tensors]
    mirror.from_host(tensors, alpha=0.25)
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, 0.25 * b + 0.75 * 2.0)


def test_a_cut_through_a_non_contiguous_tensor_is_refused():
    tensors = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(3)]
    mirror = HostMirror(tensors)
    mirror.check_cuts(tensors, [120])                    # between the tensors: fine
    with pytest.raises(ValueError, match=r"model tensor 0 \(shape \(2, 3, 4, 5\)\), which is not contiguous"):
        mirror.check_cuts(tensors, [60])
    with pytest.raises(ValueError, match="at least one tensor"):
        HostMirror([])
