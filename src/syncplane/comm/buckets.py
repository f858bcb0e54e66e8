"""Tensor fusion: many small tensors travel as a few flat buckets.

A model has hundreds of parameters; sending each alone pays the per-message latency
hundreds of times. Buckets group tensors of one dtype and device up to a byte cap
(counted on the payload) and are packed/unpacked by the compiled kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from syncplane import kernels

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # the same default cap as torch DDP


@dataclass
class Bucket:
    """Tensors that share dtype and device, with a flat buffer large enough for all of them."""

    tensors: list[torch.Tensor]
    buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        first = self.tensors[0]
        numel = kernels.numel_total(self.tensors)
        self.buffer = torch.empty(numel, dtype=first.dtype, device=first.device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def pack(self, scale: float = 1.0) -> torch.Tensor:
        return kernels.pack(self.tensors, self.buffer, scale)

    def unpack(self, source: torch.Tensor | None = None, scale: float = 1.0) -> None:
        kernels.unpack(self.buffer if source is None else source, self.tensors, scale)


def make_buckets(tensors: Iterable[torch.Tensor], cap_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_cap_bytes: int | None = None) -> list[Bucket]:
    """Split ``tensors`` into buckets in their given order (deterministic on every rank).

    A bucket closes when adding the next tensor would pass ``cap_bytes`` (the first bucket:
    ``first_cap_bytes``, where given, as torch DDP's small first bucket lets the exchange
    start early) or when dtype or device changes; a single tensor larger than the cap gets a
    bucket of its own.
    Tensors may be in any memory format (``channels_last`` on a GPU): the kernels copy
    each one's memory in memory order (``kernels.is_dense``). Views with gaps are refused.
    """
    _check_caps(cap_bytes, first_cap_bytes)
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for t in tensors:
        if not kernels.is_dense(t):
            raise ValueError(f"tensor of shape {tuple(t.shape)} and strides {t.stride()} has gaps in memory; "
                             "buckets need dense tensors (any memory format)")
        size = t.numel() * t.element_size()
        compatible = not current or (t.dtype == current[0].dtype and t.device == current[0].device)
        cap = cap_bytes if buckets or first_cap_bytes is None else first_cap_bytes
        if current and (not compatible or current_bytes + size > cap):
            buckets.append(Bucket(current))
            current, current_bytes = [], 0
        current.append(t)
        current_bytes += size
    if current:
        buckets.append(Bucket(current))
    return buckets


def _check_caps(cap_bytes: int, first_cap_bytes: int | None) -> None:
    for what, value in (("bucket cap", cap_bytes), ("first bucket cap", first_cap_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"{what} must be positive, got {value} bytes")


def flat_bucket_sizes(numel: int, element_size: int, cap_bytes: int, first_cap_bytes: int | None = None) -> list[int]:
    """The elements of each bucket ``make_buckets`` would cut from one flat buffer of ``numel``
    values if it were made of single values: ``first_cap_bytes`` first (where given), then
    ``cap_bytes`` each, the rest last (the bench's payload stands in for a model this way)."""
    _check_caps(cap_bytes, first_cap_bytes)
    sizes: list[int] = []
    done = 0
    while done < numel:
        cap = cap_bytes if sizes or first_cap_bytes is None else first_cap_bytes
        size = min(max(1, cap // element_size), numel - done)
        sizes.append(size)
        done += size
    return sizes
