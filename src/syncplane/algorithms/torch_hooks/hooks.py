"""torch's own DDP communication hooks, configured once for the bench step and the
Lightning strategies: ``torch_fp16`` (``fp16_compress_hook``: the gradient bucket is cast
to fp16, all-reduced, cast back) and ``torch_powersgd`` (``powerSGD_hook``, Vogels et al.:
each gradient matrix is replaced by a rank-r product P Qᵀ, both all-reduced; vectors go
uncompressed; error feedback and warm start as torch does them)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from syncplane.comm.meter import CommMeter, ring_allreduce_bytes
from syncplane.config import ConfigError

HOOK_NAMES = ("torch_fp16", "torch_powersgd")


class SerializedState:
    """PowerSGD's state plus the future of the bucket hooked last.

    torch's ``powerSGD_hook`` launches a bucket's P all-reduce from the autograd thread and
    its Q all-reduce from P's completion callback; with several buckets in flight the order
    in which collectives reach the process group then depends on timing and differs
    between ranks -- on gloo that is a size mismatch and an abort (seen on ``multi_nic``
    with the ResNet-50 payload: "Received data size doesn't match expected size"). Waiting
    for the previous bucket before hooking the next keeps one order on every rank; it
    costs the overlap between buckets, not the overlap with the backward.
    """

    def __init__(self, state: powerSGD_hook.PowerSGDState) -> None:
        self.state = state
        self.last: Any = None


def serialized_powersgd_hook(holder: SerializedState, bucket):  # type: ignore[no-untyped-def]
    """torch's ``powerSGD_hook``, one bucket at a time (see ``SerializedState``). Not
    annotated: DDP rejects a hook whose ``bucket`` annotation is not ``dist.GradBucket``
    itself, and this module's annotations are strings."""
    if holder.last is not None:
        holder.last.wait()
    holder.last = powerSGD_hook.powerSGD_hook(holder.state, bucket)
    return holder.last


@dataclass(frozen=True)
class HookConfig:
    """Args:
        name: ``torch_fp16`` or ``torch_powersgd``.
        matrix_approximation_rank: PowerSGD's r (torch's default 1).
        start_powerSGD_iter: steps of plain all-reduce before compressing. torch's default
            is 1000; ours is 2 (the least torch accepts with error feedback), so short runs
            and the bench measure the compression, not a warm-up.
        min_compression_rate: a matrix compressed less than this goes uncompressed.
        use_error_feedback, warm_start: PowerSGD's (torch's defaults).
    """

    name: str
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 2
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True

    def __post_init__(self) -> None:
        if self.name not in HOOK_NAMES:
            raise ConfigError(f"name: allowed values: {', '.join(HOOK_NAMES)}; got {self.name!r}")
        if isinstance(self.matrix_approximation_rank, bool) or not isinstance(self.matrix_approximation_rank, int) \
                or self.matrix_approximation_rank < 1:
            raise ConfigError(f"matrix_approximation_rank: expected an integer >= 1, got "
                              f"{self.matrix_approximation_rank!r}")
        if not isinstance(self.start_powerSGD_iter, int) or self.start_powerSGD_iter < 2:
            raise ConfigError(f"start_powerSGD_iter: expected an integer >= 2 (torch needs one plain step for "
                              f"error feedback and warm start), got {self.start_powerSGD_iter!r}")
        if not self.min_compression_rate >= 1:
            raise ConfigError(f"min_compression_rate: expected >= 1, got {self.min_compression_rate!r}")

    @classmethod
    def of(cls, name: str, settings: Mapping[str, Any]) -> HookConfig:
        """``name``'s settings from a bench or plan row's (``torch_powersgd[matrix_approximation_rank=4]``:
        the strategy's own keys; the rest, such as the bench's spec, are not the hook's)."""
        if name != "torch_powersgd":
            return cls(name=name)
        keys = [f.name for f in fields(cls) if f.name != "name"]
        return cls(name=name, **{key: settings[key] for key in keys if key in settings})

    def hook(self) -> tuple[Any, Callable[..., Any]]:
        """(state, hook) for ``DistributedDataParallel.register_comm_hook`` (the default
        process group: ``None`` makes torch use it when the hook runs). PowerSGD's hook is
        serialized over buckets (``SerializedState``)."""
        if self.name == "torch_fp16":
            return None, default_hooks.fp16_compress_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.matrix_approximation_rank,
            start_powerSGD_iter=self.start_powerSGD_iter, min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.use_error_feedback, warm_start=self.warm_start)
        return SerializedState(state), serialized_powersgd_hook

    def sent(self, state: Any, shapes: list[tuple[int, ...]], numel: int) -> tuple[int, int]:
        """(elements, bytes per element) one rank all-reduces for a bucket of ``numel`` values
        holding gradients of ``shapes``, when the hook (with its ``state``) runs now:
        PowerSGD sends the whole bucket until ``start_powerSGD_iter``, then its low-rank factors."""
        if self.name == "torch_fp16":
            return numel, 2
        inner = state.state if isinstance(state, SerializedState) else state
        if inner.iter < inner.start_powerSGD_iter:
            return numel, 4
        return sum(self.compressed_elements(shape) for shape in shapes), 4

    def factors(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """PowerSGD's P and Q elements for a matrix gradient of ``shape`` (rows × the rest),
        at rank r = min(matrix_approximation_rank, rows, cols)."""
        rows = shape[0]
        cols = math.prod(shape) // rows
        r = min(self.matrix_approximation_rank, rows, cols)
        return rows * r, cols * r

    def compressed_elements(self, shape: tuple[int, ...]) -> int:
        """Elements one rank all-reduces for a gradient of ``shape`` (after the warm-up)."""
        numel = math.prod(shape)
        if self.name == "torch_fp16" or len(shape) < 2:
            return numel
        compressed = sum(self.factors(shape))
        return compressed if numel >= self.min_compression_rate * compressed else numel


def metered(hook: Callable[..., Any], config: HookConfig, meter: CommMeter, world: int) -> Callable[..., Any]:
    """``hook`` with each bucket metered from launch to completion, with the bytes the hook
    really sends (DDP takes one comm hook only, so the metering rides in it)."""

    # Unannotated on purpose: DDP checks a hook's annotations against the real classes.
    def run(state, bucket):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        elements, width = config.sent(state, [tuple(p.shape) for p in bucket.parameters()], bucket.buffer().numel())

        def done(fut):  # type: ignore[no-untyped-def]
            meter.record(start, time.perf_counter(), ring_allreduce_bytes(elements * width, world))
            return fut.value()

        return hook(state, bucket).then(done)

    return run
