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


def make_buckets(tensors: Iterable[torch.Tensor], cap_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Split ``tensors`` into buckets in their given order (deterministic on every rank).

    A bucket closes when adding the next tensor would pass ``cap_bytes`` or when dtype or
    device changes; a single tensor larger than the cap gets a bucket of its own.
    Tensors may be in any memory format (``channels_last`` on a GPU): the kernels copy
    each one's memory in memory order (``kernels.is_dense``). Views with gaps are refused.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for t in tensors:
        if not kernels.is_dense(t):
            raise ValueError(f"tensor of shape {tuple(t.shape)} and strides {t.stride()} has gaps in memory; "
                             "buckets need dense tensors (any memory format)")
        size = t.numel() * t.element_size()
        compatible = not current or (t.dtype == current[0].dtype and t.device == current[0].device)
        if current and (not compatible or current_bytes + size > cap_bytes):
            buckets.append(Bucket(current))
            current, current_bytes = [], 0
        current.append(t)
        current_bytes += size
    if current:
        buckets.append(Bucket(current))
    return buckets
