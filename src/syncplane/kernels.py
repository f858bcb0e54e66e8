"""Hot-loop kernels with their pure-torch references.

``pack``/``unpack`` move many tensors into and out of one flat buffer (tensor fusion),
``weighted_combine`` computes ``out = a*x + sum_j w_j*y_j`` (the neighbour-averaging
step) in one pass. Each dispatches on the tensor's device to the compiled CPU or CUDA
module -- the only place CPU and GPU code paths differ. ``backend="torch"`` runs the
reference instead; it exists for tests and benchmarks, never as a silent fallback.
"""

from __future__ import annotations

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


# ---------------------------------------------------------------- references


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
