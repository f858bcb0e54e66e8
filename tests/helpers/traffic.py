"""A data group that refuses control traffic: proof that no control collective rides it.

On a GPU the default process group is NCCL and a CPU-side control collective on it fails
("No backend type associated with device type cpu"). On this CPU machine the default
group is gloo and would carry anything, so ``refuse_control_on_data_group()`` makes it
strict: every ``torch.distributed`` collective that *syncplane code* issues on the
default group must carry model data -- float32/float16/bfloat16 tensors, or uint8 codec
payloads. Object collectives, barriers, float64 / integer / bool tensors from syncplane
code on it raise ``ControlOnDataGroup``; they belong on ``control_group()``.
Lightning's own collectives (it places their tensors on the model's device itself) and
collectives on any other group pass untouched.

Limit: a float32 CPU copy of model state (what NCCL would also refuse) passes here; the
GPU checks (tests/gpu) catch those on a real NCCL group.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
#: function -> positional index of its ``group`` argument when given positionally (None: keyword only)
COLLECTIVES = {
    "all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2, "gather": 3,
    "broadcast": 2, "reduce_scatter_tensor": 3, "all_to_all_single": 4, "barrier": 0,
    "all_gather_object": 2, "gather_object": 3, "broadcast_object_list": 2, "scatter_object_list": 3,
}
OBJECT_OR_SYNC = {"barrier", "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"}


class ControlOnDataGroup(RuntimeError):
    """Control traffic was sent on the model-data group."""


def _caller_module() -> str:
    """The module of the first frame outside torch.distributed and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch.") or name == __name__ or name.startswith("functools")):
            return name
        frame = frame.f_back
    return ""


def _group_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    position = COLLECTIVES[name]
    return args[position] if 0 < position < len(args) or (position == 0 and args) else None


def _check(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    group = _group_of(name, args, kwargs)
    if group is not None and group is not dist.group.WORLD:
        return
    caller = _caller_module()
    if not caller.startswith("syncplane"):
        return
    if name in OBJECT_OR_SYNC:
        raise ControlOnDataGroup(f"{caller} sent dist.{name} on the model-data group")
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.dtype not in MODEL_DTYPES:
            raise ControlOnDataGroup(f"{caller} sent a {t.dtype} tensor with dist.{name} on the model-data group")


@contextmanager
def refuse_control_on_data_group() -> Iterator[None]:
    """Within the block, syncplane's control collectives on the default group raise."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def guarded(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _check(name, args, kwargs)
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, guarded(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
