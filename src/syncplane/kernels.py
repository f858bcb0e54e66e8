"""Hot-loop kernels with their pure-torch references.

``pack``/``unpack`` move many tensors into and out of one flat buffer (tensor fusion),
``weighted_combine`` computes ``out = a*x + sum_j w_j*y_j`` (the neighbour-averaging
step) in one pass, ``sketch_encode``/``sketch_decode``/``sketch_decode_add`` are Canary's gradient sketch (the
``GradientSketch`` codec's hot path; layout and rules in ``csrc/cpu_kernels.cpp``). Each dispatches on the tensor's device to the compiled CPU or CUDA
module -- the only place CPU and GPU code paths differ. ``backend="torch"`` runs the
reference instead (tests and benchmarks). Where the kernels cannot be compiled -- no C++
compiler, ninja or nvcc -- every kernel runs its reference, said once in the log; a compiler
that is present but fails is an error (``ext.ExtensionError``), never a silent fallback.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from syncplane import ext

Backend = Literal["ext", "torch"]

log = logging.getLogger(__name__)

#: How many times each (kernel, implementation) ran in this process; tests use it to
#: prove the compiled path is the one that executed. Kernels run on several threads (the
#: hierarchical pipeline, DiLoCo's streaming worker): ``_count`` takes a lock.
call_counts: Counter[tuple[str, str]] = Counter()
_count_lock = threading.Lock()


def _count(kernel: str, implementation: str) -> None:
    with _count_lock:
        call_counts[(kernel, implementation)] += 1


_said_reference: set[str] = set()


def _use_reference(backend: Backend, device: torch.device) -> bool:
    """Whether to run the pure-torch reference: asked for (``backend="torch"``), or the kernels
    for ``device`` cannot be compiled here (no C++ compiler, ninja or nvcc: said once in the
    log). A compiler that is present but fails raises (``ext.ExtensionError``), never hidden."""
    if backend == "torch":
        return True
    if device.type not in ("cpu", "cuda"):
        return False   # _module_for names what is supported
    reason = ext.cannot_compile(device.type)
    if reason is None:
        return False
    if device.type not in _said_reference:
        _said_reference.add(device.type)
        log.warning("syncplane: the %s kernels cannot be compiled here (%s); running their pure-torch references "
                    "instead (slower; install the compiler and they build on first use)", device.type.upper(), reason)
    return True


def _module_for(device: torch.device) -> tuple[ModuleType, str]:
    if device.type == "cuda":
        return ext.load_cuda(), "cuda_ext"
    if device.type == "cpu":
        return ext.load_cpu(), "cpu_ext"
    raise ValueError(f"syncplane kernels support cpu and cuda tensors, not {device.type}")


def numel_total(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free block of memory (any dimension order).

    Every memory format is dense -- contiguous, ``channels_last`` (ResNet-50 on a GPU),
    ``channels_last_3d`` -- so the kernels may copy such a tensor as raw memory: in
    memory order, which ``pack`` and ``unpack`` share, so a round trip is exact and two
    ranks with the same layout agree element for element. Views with gaps (a slice of
    every other column) are not, and are refused by name.
    """
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order (shares its storage).

    ``t.view(-1)`` refuses a ``channels_last`` tensor; this is the view the kernels copy
    from and to, so a single-tensor bucket can be sent and combined in place.
    """
    if t.is_contiguous():
        return t.view(-1)
    if not is_dense(t):
        raise ValueError(f"tensor of shape {tuple(t.shape)} and strides {t.stride()} has gaps in memory; "
                         "the kernels need dense tensors (any memory format)")
    return t.as_strided((t.numel(),), (1,))


def pack(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    backend: Backend = "ext",
) -> torch.Tensor:
    """Concatenate ``tensors`` (flattened, times ``scale``) into one 1-D buffer.

    All tensors must share dtype and device and be dense in any memory format
    (``is_dense``); each is copied in memory order. ``out`` may be longer than needed
    (a reusable bucket); the tail is left untouched.
    """
    if not tensors and out is None:
        raise ValueError("pack: nothing to pack and no output buffer given")
    ref = tensors[0] if tensors else out
    assert ref is not None
    if out is None:
        out = torch.empty(numel_total(tensors), dtype=ref.dtype, device=ref.device)
    if _use_reference(backend, out.device):
        _count("pack", "torch")
        return pack_reference(tensors, out, scale)
    module, name = _module_for(out.device)
    _count("pack", name)
    module.pack(list(tensors), out, float(scale))
    return out


def unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    backend: Backend = "ext",
) -> None:
    """Copy consecutive slices of ``flat`` (times ``scale``) back into ``tensors``, in place."""
    if _use_reference(backend, flat.device):
        _count("unpack", "torch")
        unpack_reference(flat, tensors, scale)
        return
    module, name = _module_for(flat.device)
    _count("unpack", name)
    module.unpack(flat, list(tensors), float(scale))


def weighted_combine(
    x: torch.Tensor,
    ys: Sequence[torch.Tensor],
    weights: Sequence[float],
    self_weight: float,
    out: torch.Tensor | None = None,
    backend: Backend = "ext",
) -> torch.Tensor:
    """``out = self_weight * x + sum_j weights[j] * ys[j]``, rounded once at the end.

    Accumulates in float32 for 16-bit inputs and in float64 for float32/float64 ones
    (weights kept in that precision), so a k-neighbour fp32 average is the correctly
    rounded value of the float64 sum rather than k+1 fp32 roundings.

    ``out`` may alias ``x`` (in-place update); it is allocated when not given.
    """
    if len(ys) != len(weights):
        raise ValueError(f"weighted_combine: {len(ys)} buffers but {len(weights)} weights")
    if out is None:
        out = torch.empty_like(x)
    if _use_reference(backend, x.device):
        _count("weighted_combine", "torch")
        return weighted_combine_reference(x, ys, weights, self_weight, out)
    module, name = _module_for(x.device)
    _count("weighted_combine", name)
    module.weighted_combine(out, x, float(self_weight), list(ys), [float(w) for w in weights])
    return out


SKETCH_BUCKETS = 256
SKETCH_HEADER_BYTES = SKETCH_BUCKETS * 4   # the codebook


def sketch_nbytes(numel: int, k: int) -> int:
    """Bytes of the sketch of ``numel`` values of which ``k`` travel exactly."""
    return SKETCH_HEADER_BYTES + 8 * k + numel


def sketch_encode(
    x: torch.Tensor,
    k: int,
    sample: int,
    quantile_weight: float,
    out: torch.Tensor | None = None,
    backend: Backend = "ext",
) -> torch.Tensor:
    """Gradient sketch of the 1-D fp32 piece ``x``: ``[codebook 256 x fp32][k exact values
    fp32][their indices int32][n codes uint8]``, bit-identical between the compiled kernel
    and ``sketch_encode_reference``.

    The k exact values are the largest magnitudes (ties: lower index first); the 255
    bucket boundaries blend the quantiles of a strided sample of about ``sample`` values
    (exact ones excluded) with a uniform grid over that sample's range,
    ``quantile_weight * quantile + (1 - quantile_weight) * uniform``; each code's value
    is the mean of the (non-exact) values that fell in its bucket.
    """
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"sketch_encode: expected a contiguous 1-D float32 tensor, got {x.dtype} "
                         f"shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty(sketch_nbytes(x.numel(), k), dtype=torch.uint8, device=x.device)
    if _use_reference(backend, x.device):
        _count("sketch_encode", "torch")
        return sketch_encode_reference(x, k, sample, quantile_weight, out)
    module, name = _module_for(x.device)
    _count("sketch_encode", name)
    module.sketch_encode(x, int(k), int(sample), float(quantile_weight), out)
    return out


def sketch_decode(
    data: torch.Tensor,
    k: int,
    numel: int,
    out: torch.Tensor | None = None,
    backend: Backend = "ext",
) -> torch.Tensor:
    """The ``numel`` fp32 values a sketch stands for (codebook lookup, exact values put back)."""
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=data.device)
    if _use_reference(backend, data.device):
        _count("sketch_decode", "torch")
        return sketch_decode_reference(data, k, out)
    module, name = _module_for(data.device)
    _count("sketch_decode", name)
    module.sketch_decode(data, int(k), out)
    return out


def sketch_decode_add(
    data: torch.Tensor,
    k: int,
    out: torch.Tensor,
    scale: float = 1.0,
    backend: Backend = "ext",
) -> torch.Tensor:
    """``out += scale * sketch_decode(data, k, out.numel())`` for ``scale`` of 1 or -1 (a sum
    of pieces; what error feedback keeps), bit for bit, in one pass on the CPU: no decoded
    buffer to allocate, write and read again. On a GPU it decodes into a buffer, then adds."""
    if scale not in (1.0, -1.0):
        raise ValueError(f"sketch_decode_add: scale must be 1 or -1, got {scale}")
    if _use_reference(backend, out.device):
        _count("sketch_decode_add", "torch")
        return sketch_decode_add_reference(data, k, out, scale)
    if out.device.type != "cpu":
        return out.add_(sketch_decode(data, k, out.numel(), backend=backend), alpha=scale)
    _count("sketch_decode_add", "cpu_ext")
    ext.load_cpu().sketch_decode_add(data, int(k), out, float(scale))
    return out

# ---------------------------------------------------------------- chunked top-k (sparse)
#
# The ``ChunkedTopK`` codec's payload (SparseLoCo's pseudo-gradient compression). The
# flat fp32 input is cut into chunks of ``chunk`` values (the last one may be shorter);
# each chunk keeps its ``k`` largest magnitudes (ties: lower index first; a chunk of
# L < k values keeps all L), quantized to ``bits`` in {2, 4, 8} against one fp32 scale
# per chunk ``a``:
#   code = sign << (bits - 1) | m,  m = clamp(round((|v| / a) * M) - 1, 0, M - 1),  M = 2^(bits-1)
#   value = ±(m + 1) * (a / M)            (levels a/M, 2a/M, ..., a; a = 0 decodes to 0)
# Top-k values are never near zero, so the levels skip 0 (a zero level would waste a quarter
# of a 2-bit code). The scale is the chunk's largest magnitude, clipped to ``c_bits`` times the
# median kept magnitude s (the ceil(k/2)-th largest; not clipped when s = 0):
# a = min(max|x|, c·s) with c = 2 at 2 bits, 16 at 4, none at 8. Why: with the maximum alone,
# one heavy-tailed value puts every other kept value on the lowest level; on Student-t(3)
# values at 1 % density the kept values' relative error was 1.21 at 2 bits (worse than
# sending nothing) and 0.43 with the clip (0.19 -> 0.18 at 4 bits; 8 bits is best unclipped,
# 0.0075). What a clip cuts off stays in the sender's error feedback for the next round.
# The kept positions (ascending) travel in the smallest of three encodings (ties: the first):
#   bitmap       L bits, one per value;
#   offsets      k*w bits, each position in w = bit_length(L - 1) bits;
#   elias_fano   k*l + k + ((L - 1) >> l) + 1 bits, l = floor(log2(L / k)): position j's low
#                l bits at [j*l, (j+1)*l), then one set bit at k*l + (i >> l) + j per position
#                (the high parts in unary). About 2 + log2(L/k) bits a position: 7 at 3 % of
#                4,096 against 12 for offsets, which makes a 2-bit payload a third smaller.
# The choice is a function of (k, L) alone: every full chunk makes the same one, so the
# payload's size depends on the element count only and a receiver can allocate it ahead.
# Byte layout, sections so that every scale is 4-byte aligned and every chunk's index
# and value bits start on a byte of their own (chunks are encoded in parallel):
#   [scales: chunks x fp32][indices: per chunk ceil(bits_i / 8) bytes][codes: per chunk ceil(k * bits / 8)]
# Bits are packed LSB-first: item j of width w occupies stream bits [j*w, (j+1)*w), stream
# bit i is bit (i % 8) of byte i // 8. Decoding adds ``scale * value`` into a dense buffer,
# one fp32 rounding per value, payloads in the order given (bit-identical on every rank).
# Inputs are expected finite: a NaN or inf is kept (its |x| bits are the largest) and makes
# its chunk's scale, and so every value decoded from that chunk, non-finite.

SPARSE_BITS = (2, 4, 8)
IndexMode = Literal["bitmap", "offsets", "elias_fano"]
#: c_bits above: the scale is at most this many times the median kept magnitude
SPARSE_CLIP = {2: 2.0, 4: 16.0, 8: math.inf}


@dataclass(frozen=True)
class SparseLayout:
    """Sizes of a chunked top-k payload of ``numel`` values (all derived from the arguments)."""

    numel: int
    k: int
    chunk: int
    bits: int

    @property
    def full_chunks(self) -> int:
        return self.numel // self.chunk

    @property
    def tail(self) -> int:
        """Length of the last, shorter chunk (0: none)."""
        return self.numel % self.chunk

    @property
    def chunks(self) -> int:
        return self.full_chunks + (self.tail > 0)

    def kept(self, length: int) -> int:
        return min(self.k, length)

    def low_width(self, length: int) -> int:
        """Elias-Fano's low bits per position: floor(log2(length / kept))."""
        return max(0, (length // self.kept(length)).bit_length() - 1)

    def elias_fano_bits(self, length: int) -> int:
        kept, low = self.kept(length), self.low_width(length)
        return kept * low + kept + ((length - 1) >> low) + 1

    def index_mode(self, length: int) -> IndexMode:
        """How a chunk of ``length`` values sends its positions: the smallest encoding."""
        offsets, elias_fano = self.kept(length) * index_width(length), self.elias_fano_bits(length)
        if length <= offsets and length <= elias_fano:
            return "bitmap"
        return "offsets" if offsets <= elias_fano else "elias_fano"

    def index_bits(self, length: int) -> int:
        mode = self.index_mode(length)
        if mode == "bitmap":
            return length
        return self.kept(length) * index_width(length) if mode == "offsets" else self.elias_fano_bits(length)

    def index_bytes(self, length: int) -> int:
        return -(-self.index_bits(length) // 8) if length else 0

    def value_bytes(self, length: int) -> int:
        return -(-self.kept(length) * self.bits // 8)

    @property
    def index_section(self) -> int:
        return self.full_chunks * self.index_bytes(self.chunk) + self.index_bytes(self.tail)

    @property
    def value_section(self) -> int:
        return self.full_chunks * self.value_bytes(self.chunk) + self.value_bytes(self.tail)

    @property
    def nbytes(self) -> int:
        return 4 * self.chunks + self.index_section + self.value_section


def index_width(length: int) -> int:
    """Bits of one offset inside a chunk of ``length`` values."""
    return max(1, (length - 1).bit_length())


def sparse_layout(numel: int, k: int, chunk: int, bits: int) -> SparseLayout:
    """The checked layout (clear errors for bad arguments)."""
    if bits not in SPARSE_BITS:
        raise ValueError(f"sparse codec: bits must be one of {SPARSE_BITS}, got {bits}")
    if chunk < 1 or chunk >= 2**31:
        raise ValueError(f"sparse codec: chunk must be in [1, 2^31), got {chunk}")
    if not 1 <= k <= chunk:
        raise ValueError(f"sparse codec: k must be in [1, chunk={chunk}], got {k}")
    if numel < 0:
        raise ValueError(f"sparse codec: numel must be non-negative, got {numel}")
    return SparseLayout(numel, k, chunk, bits)


def sparse_encode(
    x: torch.Tensor,
    k: int,
    chunk: int,
    bits: int,
    out: torch.Tensor | None = None,
    backend: Backend = "ext",
) -> torch.Tensor:
    """Chunked top-k payload of the contiguous 1-D fp32 ``x`` (layout above), bit-identical
    between the compiled kernels and ``sparse_encode_reference``."""
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"sparse_encode: expected a contiguous 1-D float32 tensor, got {x.dtype} "
                         f"shape {tuple(x.shape)}")
    layout = sparse_layout(x.numel(), k, chunk, bits)
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    if out.numel() != layout.nbytes or out.dtype != torch.uint8:
        raise ValueError(f"sparse_encode: out must be {layout.nbytes} bytes (uint8), got {out.numel()} of {out.dtype}")
    if _use_reference(backend, x.device):
        _count("sparse_encode", "torch")
        return sparse_encode_reference(x, layout, out)
    module, name = _module_for(x.device)
    _count("sparse_encode", name)
    module.sparse_encode(x, int(k), int(chunk), int(bits), out)
    return out


def sparse_decode_add(
    payloads: Sequence[torch.Tensor],
    out: torch.Tensor,
    k: int,
    chunk: int,
    bits: int,
    scale: float = 1.0,
    backend: Backend = "ext",
) -> torch.Tensor:
    """``out += scale * decode(p)`` for each payload ``p`` in order (what an all-gather of
    sparse pieces needs): every value is scaled, then added with one fp32 rounding, payloads
    in the order given -- the same bits on every rank that passes them in the same order."""
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"sparse_decode_add: out must be a contiguous 1-D float32 tensor, got {out.dtype} "
                         f"shape {tuple(out.shape)}")
    layout = sparse_layout(out.numel(), k, chunk, bits)
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or p.numel() != layout.nbytes or p.device != out.device:
            raise ValueError(f"sparse_decode_add: payload {i} has {p.numel()} bytes of {p.dtype} on {p.device}; "
                             f"expected {layout.nbytes} (uint8) on {out.device}")
    if _use_reference(backend, out.device):
        _count("sparse_decode_add", "torch")
        return sparse_decode_add_reference(payloads, out, layout, scale)
    module, name = _module_for(out.device)
    _count("sparse_decode_add", name)
    module.sparse_decode_add([p.contiguous() for p in payloads], out, int(k), int(chunk), int(bits), float(scale))
    return out


# ---------------------------------------------------------------- references


def _sketch_abs_keys(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns of |x| as int32: ordered like |x| for non-negative floats."""
    return x.abs().view(torch.int32)


def sketch_encode_reference(x: torch.Tensor, k: int, sample: int, quantile_weight: float,
                            out: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``sketch_encode`` (the definition the compiled kernels must equal bit for bit)."""
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"sketch_encode: k={k} must be in [0, {n}]")
    if out.numel() != sketch_nbytes(n, k):
        raise ValueError(f"sketch_encode: out has {out.numel()} bytes, expected {sketch_nbytes(n, k)}")
    keys = _sketch_abs_keys(x)
    exact = torch.sort(torch.sort(keys, descending=True, stable=True).indices[:k]).values
    is_exact = torch.zeros(n, dtype=torch.bool, device=x.device)
    is_exact[exact] = True
    if k > 0:
        bound_key = int(keys[exact].min())
    else:
        bound_key = int(keys.max()) if n else 0
    stride = max(1, n // sample)
    picks = torch.arange(0, n, stride, device=x.device)
    s = torch.sort(x[picks][~is_exact[picks]]).values
    m = s.numel()
    if m == 0:
        bounds = torch.zeros(SKETCH_BUCKETS - 1, dtype=torch.float32, device=x.device)
    else:
        i = torch.arange(1, SKETCH_BUCKETS, dtype=torch.int64, device=x.device)
        lo, hi = float(s[0]), float(s[-1])
        q = s[(i * m) // SKETCH_BUCKETS].double()
        u = lo + (hi - lo) * (i.double() / SKETCH_BUCKETS)
        bounds = (quantile_weight * q + (1.0 - quantile_weight) * u).float()
    codes = torch.bucketize(x, bounds, right=False)
    frac = 62 - (n + 1).bit_length()
    bound_exp = (bound_key >> 23) - 126          # every summed |v| < 2**bound_exp
    keep = ~is_exact
    fixed = torch.round(x[keep].double() * math.ldexp(1.0, frac - bound_exp)).long()
    sums = torch.zeros(SKETCH_BUCKETS, dtype=torch.int64, device=x.device).index_add_(0, codes[keep], fixed)
    counts = torch.bincount(codes[keep], minlength=SKETCH_BUCKETS)
    means = sums.double() / counts.clamp(min=1).double() * math.ldexp(1.0, bound_exp - frac)
    codebook = torch.where(counts > 0, means, torch.zeros_like(means)).float()
    h = SKETCH_HEADER_BYTES
    out[:h].copy_(codebook.view(torch.uint8))
    out[h : h + 4 * k].copy_(x[exact].contiguous().view(torch.uint8))
    out[h + 4 * k : h + 8 * k].copy_(exact.to(torch.int32).view(torch.uint8))
    out[h + 8 * k :].copy_(codes.to(torch.uint8))
    return out


def sketch_decode_reference(data: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``sketch_decode``."""
    n, h = out.numel(), SKETCH_HEADER_BYTES
    if data.numel() != sketch_nbytes(n, k):
        raise ValueError(f"sketch_decode: {data.numel()} bytes do not hold a sketch of {n} values with {k} exact ones")
    codebook = data[:h].clone().view(torch.float32)
    values = data[h : h + 4 * k].clone().view(torch.float32)
    indices = data[h + 4 * k : h + 8 * k].clone().view(torch.int32).long()
    out.copy_(codebook[data[h + 8 * k :].long()])
    out[indices] = values
    return out


def sketch_decode_add_reference(data: torch.Tensor, k: int, out: torch.Tensor, scale: float) -> torch.Tensor:
    """Pure-torch ``sketch_decode_add``."""
    return out.add_(sketch_decode_reference(data, k, torch.empty_like(out)), alpha=scale)


def _pack_bits(items: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of non-negative ints < 2^width -> rows of ceil(K * width / 8) bytes, LSB-first."""
    rows, count = items.shape
    shifts = torch.arange(width, device=items.device)
    stream = ((items.long()[:, :, None] >> shifts) & 1).reshape(rows, count * width)
    nbytes = -(-count * width // 8)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - count * width))
    weights = 1 << torch.arange(8, device=items.device)
    return (stream.view(rows, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``_pack_bits``: rows of bytes -> rows of ``count`` int64 items."""
    rows = data.shape[0]
    stream = ((data.long()[:, :, None] >> torch.arange(8, device=data.device)) & 1).reshape(rows, -1)
    items = stream[:, : count * width].reshape(rows, count, width)
    return (items << torch.arange(width, device=data.device)).sum(-1)


def _sparse_encode_rows(x: torch.Tensor, layout: SparseLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scales, index bytes and code bytes of chunks of equal length (the rows of ``x``)."""
    rows, length = x.shape
    kept, levels = layout.kept(length), 1 << (layout.bits - 1)
    keys = x.abs().view(torch.int32)   # ordered like |x| (non-negative floats)
    ordered = torch.sort(keys, dim=1, descending=True, stable=True)
    chosen = torch.sort(ordered.indices[:, :kept], dim=1).values
    values = x.gather(1, chosen)
    largest = ordered.values[:, 0].contiguous().view(torch.float32)
    median = ordered.values[:, (kept - 1) // 2].contiguous().view(torch.float32)
    clipped = torch.minimum(largest, median * SPARSE_CLIP[layout.bits])
    scales = torch.where(median > 0, clipped, largest)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    magnitude = (torch.round((values.abs() / safe[:, None]) * float(levels)) - 1).clamp_(0, levels - 1).long()
    codes = (torch.signbit(values).long() << (layout.bits - 1)) | magnitude
    return scales, _pack_positions(chosen, layout, length), _pack_bits(codes, layout.bits)


def _pack_positions(chosen: torch.Tensor, layout: SparseLayout, length: int) -> torch.Tensor:
    """Rows of ascending positions -> rows of index bytes in the chunk's index mode."""
    rows, kept = chosen.shape
    mode = layout.index_mode(length)
    if mode == "offsets":
        return _pack_bits(chosen, index_width(length))
    if mode == "bitmap":
        return _pack_bits(torch.zeros(rows, length, dtype=torch.long, device=chosen.device).scatter_(1, chosen, 1), 1)
    low = layout.low_width(length)
    shifts = torch.arange(low, device=chosen.device)
    low_bits = ((chosen[:, :, None] >> shifts) & 1).reshape(rows, kept * low)
    high = torch.zeros(rows, layout.elias_fano_bits(length) - kept * low, dtype=torch.long, device=chosen.device)
    high.scatter_(1, (chosen >> low) + torch.arange(kept, device=chosen.device), 1)
    return _pack_bits(torch.cat([low_bits, high], dim=1), 1)


def _unpack_positions(index_bytes: torch.Tensor, layout: SparseLayout, length: int) -> torch.Tensor:
    """Inverse of ``_pack_positions``, refusing what a payload of this layout cannot hold."""
    rows, kept = index_bytes.shape[0], layout.kept(length)
    mode = layout.index_mode(length)
    if mode == "offsets":
        chosen = _unpack_bits(index_bytes, index_width(length), kept)
    else:
        bits = _unpack_bits(index_bytes, 1, layout.index_bits(length))
        low = layout.low_width(length) if mode == "elias_fano" else 0
        unary = bits[:, kept * low:]          # a bitmap is all unary (low = 0)
        if not bool((unary.sum(1) == kept).all()):
            raise ValueError(f"sparse_decode_add: a chunk's indices do not hold {kept} positions (corrupt payload)")
        chosen = unary.nonzero()[:, 1].view(rows, kept)
        if mode == "elias_fano":
            weights = 1 << torch.arange(low, device=bits.device)
            low_part = (bits[:, :kept * low].view(rows, kept, low) * weights).sum(-1)
            chosen = ((chosen - torch.arange(kept, device=bits.device)) << low) | low_part
            if not bool((chosen[:, 1:] > chosen[:, :-1]).all()):
                raise ValueError("sparse_decode_add: a chunk's positions are not ascending (corrupt payload)")
    if bool((chosen >= length).any()):
        raise ValueError(f"sparse_decode_add: a position is outside its chunk of {length} values (corrupt payload)")
    return chosen


def _sections(layout: SparseLayout, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales_end = 4 * layout.chunks
    index_end = scales_end + layout.index_section
    return data[:scales_end], data[scales_end:index_end], data[index_end:]


def _row_parts(layout: SparseLayout) -> list[tuple[int, int, int, int, int]]:
    """(first chunk, rows, length, index offset, code offset) of the full chunks and the tail."""
    full = layout.full_chunks
    parts = [(0, full, layout.chunk, 0, 0)] if full else []
    if layout.tail:
        parts.append((full, 1, layout.tail, full * layout.index_bytes(layout.chunk),
                      full * layout.value_bytes(layout.chunk)))
    return parts


def sparse_encode_reference(x: torch.Tensor, layout: SparseLayout, out: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``sparse_encode`` (the definition the compiled kernels must equal bit for bit)."""
    scales_out, index_out, codes_out = _sections(layout, out)
    for first, rows, length, index_at, code_at in _row_parts(layout):
        start = first * layout.chunk
        scales, index_bytes, code_bytes = _sparse_encode_rows(x[start:start + rows * length].view(rows, length), layout)
        scales_out[4 * first:4 * (first + rows)].copy_(scales.view(torch.uint8))
        index_out[index_at:index_at + index_bytes.numel()].copy_(index_bytes.reshape(-1))
        codes_out[code_at:code_at + code_bytes.numel()].copy_(code_bytes.reshape(-1))
    return out


def sparse_decode_add_reference(payloads: Sequence[torch.Tensor], out: torch.Tensor, layout: SparseLayout,
                                scale: float = 1.0) -> torch.Tensor:
    """Pure-torch ``sparse_decode_add``."""
    levels = 1 << (layout.bits - 1)
    for data in payloads:
        scales_in, index_in, codes_in = _sections(layout, data)
        scales_all = scales_in.clone().view(torch.float32)
        for first, rows, length, index_at, code_at in _row_parts(layout):
            kept = layout.kept(length)
            ib, vb = layout.index_bytes(length), layout.value_bytes(length)
            chosen = _unpack_positions(index_in[index_at:index_at + rows * ib].view(rows, ib), layout, length)
            codes = _unpack_bits(codes_in[code_at:code_at + rows * vb].view(rows, vb), layout.bits, kept)
            step = scales_all[first:first + rows] / float(levels)
            values = ((codes & (levels - 1)) + 1).float() * step[:, None]
            values = torch.where((codes >> (layout.bits - 1)) == 1, -values, values) * scale
            positions = chosen + (first + torch.arange(rows, device=out.device)[:, None]) * layout.chunk
            out.index_add_(0, positions.reshape(-1), values.reshape(-1))   # positions are unique
    return out


def combine_accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, float64 for float32/float64 (the compiled kernels' rule)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def pack_reference(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    offset = 0
    for t in tensors:
        n = t.numel()
        segment = out[offset : offset + n]
        if scale == 1.0:
            segment.copy_(flat_view(t))
        else:
            segment.copy_((flat_view(t).float() * scale).to(out.dtype))
        offset += n
    return out


def unpack_reference(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        segment = flat[offset : offset + n]
        target = flat_view(t)
        if scale == 1.0:
            target.copy_(segment)
        else:
            target.copy_((segment.float() * scale).to(t.dtype))
        offset += n


def weighted_combine_reference(
    x: torch.Tensor,
    ys: Sequence[torch.Tensor],
    weights: Sequence[float],
    self_weight: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    acc_dtype = combine_accumulation_dtype(x.dtype)
    acc = x.to(acc_dtype) * self_weight
    for w, y in zip(weights, ys):
        acc.add_(y.to(acc_dtype), alpha=w)
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc.view_as(out))
