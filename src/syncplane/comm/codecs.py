"""Codecs for what travels on the wire: a flat fp32 tensor in, a flat byte tensor out.

A codec is a small value (hashable, comparable, no state): ``compress(x)`` returns a
``uint8`` tensor whose length ``nbytes(x.numel())`` depends only on the element count
(so a receiver can allocate before anything arrives), and ``extract(data, numel)``
returns the fp32 values it stands for. Both take ``out=``, a buffer the caller keeps
(``nbytes`` bytes, ``numel`` values) written into instead of a new tensor, so a hot path
neither allocates nor copies again: an exchange encodes straight into its send buffer. Lossy codecs are paired with
``ErrorFeedback``, which keeps what was lost and adds it to the next message so that
nothing is dropped for good (the sum over rounds of what was sent tracks the sum of
what should have been sent).

``Int8Blockwise`` scales each block of ``block`` values by its own largest magnitude:
one outlier only coarsens its own block, unlike a global scale or plain quantile
buckets that average the heavy tail away. Error per element is at most
``max|block| / 254``. Implemented with torch ops (vectorized on the whole tensor);
there is no compiled kernel for it yet.

``GradientSketch`` is an 8-bit quantile-bucket gradient sketch: uint8 codes into a
per-piece codebook of 256 bucket means, plus the largest-magnitude ``exact_fraction`` of
the values sent exactly, so a heavy tail is neither clipped nor allowed to widen the
buckets. Its encode and decode run in the compiled kernels (``kernels.sketch_encode``).

``ChunkedTopK`` is a sparse codec (chunked top-k, as in arXiv 2508.15706): per chunk of
``chunk`` values the largest ``density`` fraction, at 2/4/8 bits against one scale per
chunk, positions as bit-packed offsets or a bitmap (layout in ``kernels.py``). Its pieces
are summed by decoding (``decode_add``), never re-encoded: a sum of top-k vectors is
denser than each, so this codec rides an all-gather, not a reduce-scatter or a tree.
Encode and decode run in the compiled kernels (``kernels.sparse_encode``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from syncplane import kernels

FP32_BYTES = 4


@dataclass(frozen=True)
class Fp32:
    """The identity codec: the raw fp32 bytes (exact)."""

    name = "none"

    def nbytes(self, numel: int) -> int:
        return numel * FP32_BYTES

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_fp32(x)
        if out is not None:
            return _put_floats(_bytes_out(out, self.nbytes(x.numel()), x.device), x.reshape(-1))
        return x.contiguous().view(torch.uint8)

    def extract(self, data: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        values = _floats(_check_bytes(data, self.nbytes(numel)))
        return values if out is None else _into(out, values)


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

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_fp32(x)
        n, nb = x.numel(), self.blocks(x.numel())
        out = _bytes_out(out, self.nbytes(n), x.device)
        if n == 0:
            return out
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.reshape(-1)
        blocks = padded.view(nb, self.block)
        scales = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        _put_floats(out[: nb * FP32_BYTES], scales)
        out[nb * FP32_BYTES:].view(torch.int8).copy_(q.view(-1)[:n])
        return out

    def extract(self, data: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_bytes(data, self.nbytes(numel))
        nb = self.blocks(numel)
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=data.device) if out is None else out
        scales = _floats(data[: nb * FP32_BYTES])
        q = torch.zeros(nb * self.block, dtype=torch.float32, device=data.device)
        q[:numel] = data[nb * FP32_BYTES:].view(torch.int8).to(torch.float32)
        values = (q.view(nb, self.block) * scales[:, None]).view(-1)[:numel]
        return values if out is None else _into(out, values)


@dataclass(frozen=True)
class GradientSketch:
    """A gradient sketch of one piece: 256 buckets, uint8 codes, a codebook of means.

    Layout: ``[codebook: 256 x fp32][k exact values: fp32][their indices: int32][codes: n x
    uint8]`` with ``k = ceil(exact_fraction * n)``, about 1.08 bytes per value at the
    default 1% (fp32: 4) plus 1 KiB per piece -- so pieces of a few thousand values or
    more are worth sketching.

    Why not plain equal-count quantile buckets: on a Gaussian they leave the outermost
    buckets wide (the tail is sparse). Sending the top 1% exactly and placing the boundaries
    at ``quantile_weight`` x the sample's quantiles plus the rest x a uniform grid over its
    range keeps the error below int8's on Gaussian, heavy-tailed and real gradients
    (``docs/design-notes.md``). ``quantile_weight=1`` is the plain quantile rule.
    """

    exact_fraction: float = 0.01
    sample: int = 8192
    quantile_weight: float = 0.3
    name = "sketch"

    def __post_init__(self) -> None:
        if not 0.0 <= self.exact_fraction <= 1.0:
            raise ValueError(f"sketch exact_fraction must be in [0, 1], got {self.exact_fraction}")
        if self.sample < 1:
            raise ValueError(f"sketch sample must be at least 1, got {self.sample}")
        if not 0.0 <= self.quantile_weight <= 1.0:
            raise ValueError(f"sketch quantile_weight must be in [0, 1], got {self.quantile_weight}")

    def exact_count(self, numel: int) -> int:
        """How many of ``numel`` values travel exactly (the largest magnitudes)."""
        return min(numel, math.ceil(numel * self.exact_fraction))

    def nbytes(self, numel: int) -> int:
        return kernels.sketch_nbytes(numel, self.exact_count(numel))

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_fp32(x)
        flat = x.reshape(-1).contiguous()
        return kernels.sketch_encode(flat, self.exact_count(flat.numel()), self.sample, self.quantile_weight,
                                     _bytes_out(out, self.nbytes(flat.numel()), x.device))

    def extract(self, data: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_bytes(data, self.nbytes(numel))
        if out is not None:
            _check_out(out, numel)
        return kernels.sketch_decode(data.contiguous(), self.exact_count(numel), numel, out)


@dataclass(frozen=True)
class ChunkedTopK:
    """Chunked top-k at ``bits`` per kept value (``kernels.sparse_encode``'s layout).

    Keeps ``k = ceil(density * chunk)`` values per chunk (a shorter last chunk keeps at
    most its length), so the payload's size depends on the element count only. Chunks of
    4096 at 2 bits: 77 bytes per chunk at 1 % (41 values: 12-bit offsets 62 B, codes 11 B,
    scale 4 B; 213x smaller than fp32), 220 bytes at 3 % (74x).
    """

    density: float = 0.02
    bits: int = 2
    chunk: int = 4096
    name = "sparse"

    def __post_init__(self) -> None:
        check_sparse_options(self.density, self.bits, self.chunk)

    @property
    def k(self) -> int:
        """Values kept per full chunk."""
        return min(self.chunk, max(1, math.ceil(self.density * self.chunk)))

    def layout(self, numel: int) -> kernels.SparseLayout:
        return kernels.sparse_layout(numel, self.k, self.chunk, self.bits)

    def nbytes(self, numel: int) -> int:
        return self.layout(numel).nbytes

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_fp32(x)
        return kernels.sparse_encode(x.reshape(-1).contiguous(), self.k, self.chunk, self.bits,
                                     _bytes_out(out, self.nbytes(x.numel()), x.device))

    def extract(self, data: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_bytes(data, self.nbytes(numel))
        if out is None:
            out = torch.zeros(numel, dtype=torch.float32, device=data.device)
        else:
            _check_out(out, numel).zero_()
        return self.decode_add([data], out)

    def decode_add(self, payloads: list[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``out += scale * extract(p)`` for every payload in order, without a dense copy of
        each: an all-gather's pieces summed the same way (same bits) on every rank."""
        return kernels.sparse_decode_add(payloads, out, self.k, self.chunk, self.bits, scale)


def check_sparse_options(density: float, bits: int, chunk: int) -> None:
    """Clear errors, naming the key, for settings ``ChunkedTopK`` cannot take."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(f"density: must be in (0, 1] (a fraction of each chunk kept; 0.01-0.03 typical), "
                         f"got {density!r}")
    if isinstance(bits, bool) or bits not in kernels.SPARSE_BITS:
        raise ValueError(f"bits: allowed values: {', '.join(map(str, kernels.SPARSE_BITS))}; got {bits!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk < 2**31:
        raise ValueError(f"chunk: must be an integer in [1, 2^31), got {chunk!r}")


Codec = Fp32 | Int8Blockwise | GradientSketch | ChunkedTopK
CODEC_NAMES = ("none", "int8", "sketch")


def make_codec(name: str, block: int = 256) -> Codec:
    """``"none"`` (exact fp32), ``"int8"`` (blockwise, ``block`` values per scale) or
    ``"sketch"`` (the gradient sketch with its defaults)."""
    if name == "none":
        return Fp32()
    if name == "int8":
        return Int8Blockwise(block)
    if name == "sketch":
        return GradientSketch()
    raise ValueError(f"unknown compression {name!r}; allowed values: {', '.join(CODEC_NAMES)}")


class ErrorFeedback:
    """Per-rank memory of what a lossy codec dropped, over a flat buffer of ``numel`` values.

    ``compress(x, offset)`` sends ``β·e + x`` for the slice ``[offset, offset + len(x))``
    and keeps ``e <- (β·e + x) - extract(sent)``. ``β = 1`` (default) keeps everything
    that was dropped; ``β < 1`` decays it, which makes the accumulator a momentum of what is
    sent. ``snapshot``/``restore`` let a caller undo a round whose exchange was
    discarded (the values will be sent again); ``state_dict`` is for checkpoints.
    """

    def __init__(self, codec: Codec, numel: int, beta: float = 1.0) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"error feedback beta must be in [0, 1], got {beta}")
        self.codec = codec
        self.beta = beta
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def compress(self, x: torch.Tensor, offset: int = 0, undo: Undo | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``undo``: where the slice is saved first (a runner's round); ``out``: the bytes are
        written there (``Codec.compress``)."""
        if isinstance(self.codec, Fp32):
            return self.codec.compress(x, out)   # exact: nothing to remember
        end = offset + x.numel()
        if offset < 0 or end > self.residual.numel():
            raise ValueError(f"slice [{offset}, {end}) is outside the error-feedback buffer of "
                             f"{self.residual.numel()} values")
        if undo is not None:
            undo.save(self, offset, x.numel())
        # in place: the slice becomes β·e + x, is encoded, and keeps what the encoding lost
        # (the same fp32 operations as out of place, without two temporaries and a copy)
        residual = self.residual[offset:end]
        if self.beta != 1.0:
            residual.mul_(self.beta)
        residual.add_(x.reshape(-1).to(residual.device))
        data = self.codec.compress(residual, out)
        add_extracted_(self.codec, data, residual, -1.0)
        return data

    def snapshot(self, offset: int = 0, numel: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the residuals of ``[offset, offset + numel)`` (default: all): only the
        slice a round touches: a caller that exchanges a large buffer a slice at a time then
        copies only that slice, not every residual in full for every slice. ``out``: a
        buffer of that many fp32 values the caller keeps, copied into instead of a new one."""
        end = self.residual.numel() if numel is None else offset + numel
        piece = self.residual[offset:end]
        return piece.clone() if out is None else _check_out(out, piece.numel()).copy_(piece)

    def restore(self, saved: torch.Tensor, offset: int = 0) -> None:
        self.residual[offset:offset + saved.numel()].copy_(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals (a plain tensor: ``torch.load(weights_only=True)``-loadable)."""
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"error-feedback state holds {residual.numel()} values, this buffer has "
                             f"{self.residual.numel()}")
        self.residual.copy_(residual)


class Feedback(Protocol):
    """What an exchange compresses through: an ``ErrorFeedback``, or one an ``Undo`` records."""

    def compress(self, x: torch.Tensor, offset: int = 0, out: torch.Tensor | None = None) -> torch.Tensor: ...


class Undo:
    """What a round's compressions changed in error feedback, to put back if the round is
    discarded: each compression saves the slice it is about to overwrite, so a round copies
    the residuals it touches and no others (not every slot's whole span up front).

    ``recording(feedback)`` is ``feedback`` with its compressions recorded here.

    Args:
        scratch: ``(i, numel) -> buffer`` of ``numel`` fp32 values for the round's i-th saved
            slice, kept by the caller between rounds (a runner's workspace): a copy into a
            fresh tensor every round paid its page faults. Default: fresh copies.
    """

    def __init__(self, scratch: Callable[[int, int], torch.Tensor] | None = None) -> None:
        self._saved: list[tuple[ErrorFeedback, int, torch.Tensor]] = []
        self._scratch = scratch

    def recording(self, feedback: ErrorFeedback) -> _Recorded:
        return _Recorded(feedback, self)

    def save(self, feedback: ErrorFeedback, offset: int, numel: int) -> None:
        out = self._scratch(len(self._saved), numel) if self._scratch is not None else None
        self._saved.append((feedback, offset, feedback.snapshot(offset, numel, out=out)))

    def restore(self) -> None:
        """Every slice as it was before the round (latest first, so overlaps end at the oldest)."""
        for feedback, offset, saved in reversed(self._saved):
            feedback.restore(saved, offset)
        self._saved.clear()


@dataclass(frozen=True)
class _Recorded:
    feedback: ErrorFeedback
    undo: Undo

    def compress(self, x: torch.Tensor, offset: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.feedback.compress(x, offset, self.undo, out)


def add_extracted_(codec: Codec, data: torch.Tensor, out: torch.Tensor, scale: float = 1.0,
                   scratch: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """``out += scale * codec.extract(data, out.numel())`` for ``scale`` 1 or -1 (a sum of
    pieces; what error feedback keeps), bit for bit, without a decoded buffer where the codec
    needs none: the sketch decodes into ``out`` in one pass (``kernels.sketch_decode_add``),
    exact fp32 adds a view of its bytes. Any other codec decodes into ``scratch()`` first (a
    buffer of ``out.numel()`` fp32 the caller keeps), or a fresh one."""
    numel = out.numel()
    if isinstance(codec, GradientSketch):
        _check_bytes(data, codec.nbytes(numel))
        return kernels.sketch_decode_add(data.contiguous(), codec.exact_count(numel), _check_out(out, numel), scale)
    if isinstance(codec, Fp32):
        values = codec.extract(data, numel)
    else:
        values = codec.extract(data, numel, out=scratch() if scratch is not None else None)
    return out.add_(values, alpha=scale)


def _check_fp32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"codecs take float32 tensors, got {x.dtype}")


def _check_bytes(data: torch.Tensor, expected: int) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"expected {expected} bytes (uint8), got {data.numel()} of {data.dtype}")
    return data


def _bytes_out(out: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """``compress``'s destination: the caller's ``out`` (checked), else a new buffer."""
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"compress: out must be a contiguous 1-D uint8 tensor, got shape {tuple(out.shape)}")
    return _check_bytes(out, nbytes)


def _floats(data: torch.Tensor) -> torch.Tensor:
    """``data``'s bytes read as fp32: a view where they start on a 4-byte boundary, else an
    aligned copy (a piece in a message of several starts wherever the one before it ended)."""
    aligned = data if data.storage_offset() % FP32_BYTES == 0 else data.clone()
    return aligned.view(torch.float32)


def _put_floats(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (fp32) written as bytes into ``out``, wherever ``out`` starts."""
    return out.copy_(values.contiguous().view(torch.uint8))


def _check_out(out: torch.Tensor, numel: int) -> torch.Tensor:
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"extract: out must be a contiguous 1-D float32 tensor of {numel} values, got "
                         f"{out.dtype} shape {tuple(out.shape)}")
    return out


def _into(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _check_out(out, values.numel()).copy_(values)
