"""Where a training step first reads each synchronized tensor.

ATC leaves its neighbour exchange in flight across the step boundary and waits for a
bucket in the forward pre-hook of each module that *owns* one of its parameters. That
misses a parameter read anywhere else: in ``training_step`` itself (a learned
temperature, a tied weight used outside its module), or by a parent module whose
``forward`` uses ``self.child.weight`` directly. Such a read would see the
parameter before its exchange was combined in.

``FirstReads`` watches one real step (every torch call, through a ``TorchFunctionMode``,
plus the stack of modules whose ``forward`` is running) and records, for each bucket
read while no owner's pre-hook has waited for it, the innermost module running at the
time -- or that it was read outside every module. The strategy then waits for those
buckets before that module's forward, or before ``training_step``. One step of
overhead, once per fit; steps after it run with plain hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class FirstReads(TorchFunctionMode):
    """Record reads of watched tensors that their owners' pre-hooks do not cover.

    Args:
        buckets: ``data_ptr`` of every watched tensor -> its bucket index.
        covered: module -> buckets its forward pre-hook already waits for.

    After the ``with`` block, ``by_module`` maps a module to the buckets it must wait for
    before its forward, and ``outside`` holds the buckets read outside every forward.
    """

    def __init__(self, buckets: Mapping[int, int], covered: Mapping[torch.nn.Module, frozenset[int]]) -> None:
        super().__init__()
        self._buckets, self._covered = buckets, covered
        self._stack: list[torch.nn.Module] = []
        self.by_module: dict[torch.nn.Module, set[int]] = {}
        self.outside: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> "FirstReads":
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_forward_pre_hook(lambda m, _args: self._stack.append(m)),
            nn_module.register_module_forward_hook(lambda m, _args, _out: self._pop(m)),
        ]
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pop(self, module: torch.nn.Module) -> None:
        # a forward that raised never pops; unwind to the module that returned
        while self._stack and self._stack.pop() is not module:
            pass

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor):
                self._note(leaf)
        return func(*args, **(kwargs or {}))

    def _note(self, tensor: torch.Tensor) -> None:
        try:
            bucket = self._buckets.get(tensor.data_ptr())
        except RuntimeError:   # tensors without storage (meta, some wrappers): never watched
            return
        if bucket is None:
            return
        if any(bucket in self._covered.get(m, ()) for m in self._stack):
            return          # an enclosing module's pre-hook has already waited for it
        if self._stack:
            self.by_module.setdefault(self._stack[-1], set()).add(bucket)
        else:
            self.outside.add(bucket)
