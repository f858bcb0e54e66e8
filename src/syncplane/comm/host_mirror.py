"""A flat fp32 host copy of a model's tensors, and the copies between the two.

Why a module of its own: strategies whose state lives on the CPU (an outer optimizer's
parameters and state) need the model laid out in one flat host buffer, copied there
and back -- in full or one slice (a fragment) at a time, the slice
possibly cutting a tensor in two. On a GPU the buffer is pinned and the copies run on a
side CUDA stream, so they do not queue behind (or block) the training stream; on the
CPU the same calls are plain copies. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class HostMirror:
    """``buffer = [t₀ | t₁ | …]`` flattened, fp32 (or ``dtype``), on the host; ``spans[i]`` is
    tensor i's range. The one host-side flattening of a model (an outer optimizer's state,
    the float64 consensus distance); device-side fusion is ``Bucket`` (same dtype, kernels)."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        if not tensors:
            raise ValueError("HostMirror needs at least one tensor")
        self.spans: list[tuple[int, int]] = []
        offset = 0
        for t in tensors:
            self.spans.append((offset, offset + t.numel()))
            offset += t.numel()
        device = tensors[0].device
        self.on_gpu = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.on_gpu else None
        self.buffer = torch.empty(offset, dtype=dtype, pin_memory=self.on_gpu)

    def check_cuts(self, tensors: Sequence[torch.Tensor], cuts: Sequence[int]) -> None:
        """Copying a slice that cuts a tensor needs a flat view of it: refuse a cut through a
        non-contiguous tensor (channels_last, say) up front, naming it."""
        for i, (t, (a, b)) in enumerate(zip(tensors, self.spans)):
            if any(a < cut < b for cut in cuts) and not t.is_contiguous():
                raise ValueError(f"a fragment boundary runs through model tensor {i} (shape {tuple(t.shape)}), "
                                 "which is not contiguous (channels_last?): use fewer fragments or a contiguous "
                                 "memory format")

    def to_host(self, tensors: Sequence[torch.Tensor], start: int = 0, end: int | None = None) -> None:
        """``buffer[start:end]`` ← the tensors' values there (waits: the CPU reads it next)."""
        with torch.no_grad(), self._side_stream():
            for t, host in self._within(tensors, start, end):
                self.buffer[host].copy_(t.reshape(-1), non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()

    def from_host(self, tensors: Sequence[torch.Tensor], start: int = 0, end: int | None = None,
                  alpha: float = 0.0) -> None:
        """The tensors' values in ``[start, end)`` ← ``buffer`` there (α = 0), or mixed in as
        ``α·tensor + (1 − α)·buffer``; the training stream waits for it before its next kernel."""
        with torch.no_grad(), self._side_stream():
            for t, host in self._within(tensors, start, end):
                values = self.buffer[host].view_as(t)
                if alpha == 0.0:
                    t.copy_(values, non_blocking=True)
                else:
                    t.mul_(alpha).add_(values.to(t.device, non_blocking=True), alpha=1.0 - alpha)
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def _side_stream(self) -> AbstractContextManager[Any]:
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    def _within(self, tensors: Sequence[torch.Tensor], start: int,
                end: int | None) -> list[tuple[torch.Tensor, slice]]:
        """``(tensor values, host slice)`` for the part of each tensor inside ``[start, end)``:
        the whole tensor (shaped like it) or, where the range cuts through it, a flat part."""
        end = self.buffer.numel() if end is None else end
        parts = []
        for t, (a, b) in zip(tensors, self.spans):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                parts.append((t if (lo, hi) == (a, b) else t.view(-1)[lo - a: hi - a], slice(lo, hi)))
        return parts
