"""Hot-loop kernels with their pure-torch references.

``pack``/``unpack`` move many tensors into and out of one flat buffer (tensor fusion),
``weighted_combine`` computes ``out = a*x + sum_j w_j*y_j`` (the neighbour-averaging
step) in one pass, ``sketch_encode``/``sketch_decode`` are Canary's gradient sketch (the
``GradientSketch`` codec's hot path; layout and rules in ``csrc/cpu_kernels.cpp``). Each dispatches on the tensor's device to the compiled CPU or CUDA
module -- the only place CPU and GPU code paths differ. ``backend="torch"`` runs the
reference instead; it exists for tests and benchmarks, never as a silent fallback.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from syncplane import ext

Backend = Literal["ext", "torch"]

#: How many times each (kernel, implementation) ran in this process; tests use it to
#: prove the compiled path is the one that executed. Kernels run on several threads (the
#: hierarchical pipeline, DiLoCo's streaming worker): ``_count`` takes a lock.
call_counts: Counter[tuple[str, str]] = Counter()
_count_lock = threading.Lock()


def _count(kernel: str, implementation: str) -> None:
    with _count_lock:
        call_counts[(kernel, implementation)] += 1


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
    if backend == "torch":
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
    if backend == "torch":
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
    if backend == "torch":
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
    if backend == "torch":
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
    if backend == "torch":
        _count("sketch_decode", "torch")
        return sketch_decode_reference(data, k, out)
    module, name = _module_for(data.device)
    _count("sketch_decode", name)
    module.sketch_decode(data, int(k), out)
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
