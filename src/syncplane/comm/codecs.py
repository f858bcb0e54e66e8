"""Codecs for what travels on the wire: a flat fp32 tensor in, a flat byte tensor out.

A codec is a small value (hashable, comparable, no state): ``compress(x)`` returns a
``uint8`` tensor whose length ``nbytes(x.numel())`` depends only on the element count
(so a receiver can allocate before anything arrives), and ``extract(data, numel)``
returns the fp32 values it stands for. Lossy codecs are paired with
``ErrorFeedback``, which keeps what was lost and adds it to the next message so that
nothing is dropped for good (the sum over rounds of what was sent tracks the sum of
what should have been sent).

``Int8Blockwise`` scales each block of ``block`` values by its own largest magnitude:
one outlier only coarsens its own block, unlike a global scale or plain quantile
buckets that average the heavy tail away. Error per element is at most
``max|block| / 254``. Implemented with torch ops (vectorized on the whole tensor);
there is no compiled kernel for it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_BYTES = 4


@dataclass(frozen=True)
class Fp32:
    """The identity codec: the raw fp32 bytes (exact)."""

    name = "none"

    def nbytes(self, numel: int) -> int:
        return numel * FP32_BYTES

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        _check_fp32(x)
        return x.contiguous().view(torch.uint8)

    def extract(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check_bytes(data, self.nbytes(numel))
        return data.view(torch.float32)


@dataclass(frozen=True)
class Int8Blockwise:
    """int8 values with one fp32 scale per ``block`` consecutive values.

    Layout: ``[scales: ceil(n/block) x fp32][values: n x int8]``, about 1/4 of fp32 for
    blocks of a few hundred. ``q = round(x / s)`` with ``s = max|block| / 127``; an
    all-zero block has scale 0 and decodes to zeros.
    """

    block: int = 256
    name = "int8"

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"int8 block size must be at least 1, got {self.block}")

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def nbytes(self, numel: int) -> int:
        return self.blocks(numel) * FP32_BYTES + numel

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        _check_fp32(x)
        n, nb = x.numel(), self.blocks(x.numel())
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        if n == 0:
            return out
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.reshape(-1)
        blocks = padded.view(nb, self.block)
        scales = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        out[: nb * FP32_BYTES].view(torch.float32).copy_(scales)
        out[nb * FP32_BYTES:].view(torch.int8).copy_(q.view(-1)[:n])
        return out

    def extract(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check_bytes(data, self.nbytes(numel))
        nb = self.blocks(numel)
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=data.device)
        scales = data[: nb * FP32_BYTES].view(torch.float32)
        q = torch.zeros(nb * self.block, dtype=torch.float32, device=data.device)
        q[:numel] = data[nb * FP32_BYTES:].view(torch.int8).to(torch.float32)
        return (q.view(nb, self.block) * scales[:, None]).view(-1)[:numel]


Codec = Fp32 | Int8Blockwise


def make_codec(name: str, block: int = 256) -> Codec:
    """``"none"`` (exact fp32) or ``"int8"`` (blockwise, ``block`` values per scale)."""
    if name == "none":
        return Fp32()
    if name == "int8":
        return Int8Blockwise(block)
    raise ValueError(f"unknown compression {name!r}; allowed values: none, int8")


class ErrorFeedback:
    """Per-rank memory of what a lossy codec dropped, over a flat buffer of ``numel`` values.

    ``compress(x, offset)`` sends ``x + e`` for the slice ``[offset, offset + len(x))``
    and keeps ``e <- (x + e) - extract(sent)``. ``snapshot``/``restore`` let a caller
    undo a round whose exchange was discarded (the values will be sent again).
    """

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def compress(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if isinstance(self.codec, Fp32):
            return self.codec.compress(x)   # exact: nothing to remember
        end = offset + x.numel()
        if offset < 0 or end > self.residual.numel():
            raise ValueError(f"slice [{offset}, {end}) is outside the error-feedback buffer of "
                             f"{self.residual.numel()} values")
        residual = self.residual[offset:end]
        wanted = x.reshape(-1).to(residual.device) + residual
        data = self.codec.compress(wanted)
        residual.copy_(wanted - self.codec.extract(data, wanted.numel()))
        return data

    def snapshot(self) -> torch.Tensor:
        return self.residual.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self.residual.copy_(saved)


def _check_fp32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"codecs take float32 tensors, got {x.dtype}")


def _check_bytes(data: torch.Tensor, expected: int) -> None:
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"expected {expected} bytes (uint8), got {data.numel()} of {data.dtype}")
