"""DiLoCo's outer optimizer: θ_g as one flat fp32 tensor in host memory (pinned with a GPU, for
asynchronous copies), touched once per round, with a torch optimizer over it whose gradient is
``Δ = mean_i(θ_g − θ_i)``. One flat tensor is the per-tensor update of element-wise optimizers
(SGD, Nesterov, Adam(W)); layer-wise ones (LARS/LAMB) would see one big layer."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

DEFAULT_OPTIMIZER = "torch.optim.SGD"
#: DiLoCo's (Douillard et al.) Nesterov momentum. ``foreach``: on CPU torch's single-tensor step
#: allocates a model-sized tensor every round; the foreach one works in place on the gradient.
DEFAULT_KWARGS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True, "foreach": True}
#: The outer rules, each a default ``outer_kwargs`` of SGD: DiLoCo's Nesterov, or SparseLoCo's
#: ``θ_g ← θ_g − α·mean_r(Δ̂_r)`` (no momentum: with ``compression: sparse`` each rank's decayed
#: error feedback stands in for it; on dense Δ, lr 1 makes θ_g the replicas' mean). ``outer_kwargs``
#: override the rule's (α = ``lr``); another optimizer class takes ``outer_kwargs`` alone.
OUTER_RULES = ("nesterov", "sparseloco")
SPARSELOCO_KWARGS: dict[str, Any] = {"lr": 1.0, "momentum": 0.0, "foreach": True}


def rule_kwargs(rule: str, optimizer: str, kwargs: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The outer optimizer's keyword arguments under ``rule`` (``OUTER_RULES``)."""
    if rule not in OUTER_RULES:
        raise ValueError(f"outer: allowed values: {', '.join(OUTER_RULES)}; got {rule!r}")
    if optimizer != DEFAULT_OPTIMIZER:
        return dict(kwargs or {})
    if rule == "nesterov":
        return DEFAULT_KWARGS if kwargs is None else kwargs
    return {**SPARSELOCO_KWARGS, **(kwargs or {})}


def resolve_optimizer(path: str) -> type[Optimizer]:
    """``"torch.optim.SGD"`` -> the class; anything that is not an Optimizer subclass is refused."""
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ValueError(f"outer_optimizer: {path!r} is not an importable torch.optim.Optimizer class "
                         "(e.g. torch.optim.SGD, torch.optim.AdamW)")
    return cls


def check_outer(optimizer: str, kwargs: Mapping[str, Any] | None, rule: str = "nesterov") -> None:
    """The class resolves and takes ``kwargs`` under ``rule`` (built once over one value: what
    the first round would do on every rank, done when the settings are read)."""
    OuterOptimizer(torch.zeros(1), optimizer, kwargs, pin=False, rule=rule)


class OuterOptimizer:
    """``θ_g`` (a copy of ``initial``) and ``optimizer`` (any ``torch.optim.Optimizer``'s class path)
    with ``kwargs``, or ``rule``'s defaults for SGD (``rule_kwargs``); ``pin``: default with CUDA."""

    def __init__(self, initial: torch.Tensor, optimizer: str = DEFAULT_OPTIMIZER,
                 kwargs: Mapping[str, Any] | None = None, pin: bool | None = None, rule: str = "nesterov") -> None:
        cls = resolve_optimizer(optimizer)
        kwargs = rule_kwargs(rule, optimizer, kwargs)
        pin = torch.cuda.is_available() if pin is None else pin
        self.params = torch.empty(initial.numel(), dtype=torch.float32, pin_memory=pin)
        self.params.copy_(initial.reshape(-1))
        try:
            self.optimizer = cls([self.params], **dict(kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"outer_kwargs {dict(kwargs)!r} rejected by {optimizer}: {exc}") from None

    def pseudo_gradient(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``θ_g − θ_local`` (into ``out`` if given): how far this replica moved this round, negated."""
        return torch.sub(self.params, local.reshape(-1), out=out)

    def step(self, mean_delta: torch.Tensor) -> None:
        """One outer step with the averaged pseudo-gradient as the gradient of ``θ_g``."""
        self.params.grad = mean_delta.reshape(-1)
        self.optimizer.step()
        self.params.grad = None

    def begin_round_(self, flat: torch.Tensor) -> None:
        """A round's first half, on ``flat = [θ_local | extras]``: Δ replaces θ_local in the head;
        the caller averages ``flat`` over the replicas (in the background, while training goes on)."""
        head = flat[: self.params.numel()]
        self.pseudo_gradient(head, out=head)

    def finish_round_(self, flat: torch.Tensor) -> None:
        """Its second half, once ``flat`` holds the committed mean: the outer step with the head's
        mean Δ, θ_g written back into the head (a discarded round skips it: θ_local is in the model)."""
        head = flat[: self.params.numel()]
        self.step(head)
        head.copy_(self.params)

    def state_bytes(self) -> int:
        """Host bytes of θ_g and the optimizer's state tensors (momentum, Adam's moments)."""
        tensors = [self.params, *(v for s in self.optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain containers only (``torch.load(weights_only=True)``-loadable)."""
        return {"params": self.params.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params = state["params"]
        if params.numel() != self.params.numel():
            raise ValueError(f"outer state holds {params.numel()} parameters, this model has {self.params.numel()}")
        self.params.copy_(params)
        self.optimizer.load_state_dict(state["optimizer"])
