"""Optimizer pieces the large recipes share: decay groups, LAMB, Muon with AdamW, warm-up schedules.

Kept out of the recipes so ResNet-50 (Goyal et al.) and BERT (Devlin et al. / You et
al.) build their optimizers from the same small, separately tested parts, and ``tiny_lm``
its Muon (MuLoCo's inner optimizer).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from syncplane.config import ConfigError

ScheduleKind = Literal["constant", "cosine", "step", "linear"]


def check_schedule(schedule: str) -> None:
    """A recipe's ``schedule`` setting names one of ``ScheduleKind``'s."""
    if schedule not in typing.get_args(ScheduleKind):
        *first, last = typing.get_args(ScheduleKind)
        raise ConfigError(f"schedule: {', '.join(first)} or {last}, got {schedule!r}")

# Parameters of these layers are scale/shift terms: decaying them only fights the
# normalization (Goyal et al. §5.1 leave BN out; BERT leaves LayerNorm out).
_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed group.

    Biases and every parameter of a normalization layer get no weight decay; the rest
    (conv and linear weights, embeddings) get ``weight_decay``. Shared (tied)
    parameters are listed once.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or name.endswith("bias"):
                no_decay_ids.add(id(param))
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if id(param) in no_decay_ids else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def schedule_factor(kind: ScheduleKind, total_steps: int, warmup_steps: int = 0, warmup_start: float = 0.0,
                    milestones: Sequence[int] = (), gamma: float = 0.1) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at optimizer step ``s`` (for ``LambdaLR``).

    Linear warm-up from ``warmup_start`` to 1 over ``warmup_steps``, then ``kind``:
    ``constant``; ``cosine`` to 0 at ``total_steps``; ``linear`` to 0 at ``total_steps``;
    ``step``: times ``gamma`` at each milestone step (Goyal et al.: epochs 30, 60, 80).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    if warmup_steps < 0 or not 0.0 <= warmup_start <= 1.0:
        raise ValueError(f"bad warm-up: warmup_steps={warmup_steps}, warmup_start={warmup_start}")
    ordered = sorted(milestones)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return warmup_start + (1.0 - warmup_start) * step / warmup_steps
        if kind == "constant":
            return 1.0
        if kind == "step":
            return gamma ** sum(step >= m for m in ordered)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if kind == "linear":
            return 1.0 - progress
        raise ValueError(f"unknown schedule {kind!r}; allowed values: constant, cosine, linear, step")

    return factor


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """What an optimizer's ``step(closure)`` returns: the closure's loss, computed with grad on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2020, Algorithm 2): Adam's update, rescaled per tensor by a trust ratio.

    ``r = m̂ / (sqrt(v̂) + eps) + weight_decay * w`` and ``w -= lr * (‖w‖ / ‖r‖) * r``
    (the ratio is 1 when either norm is 0). This layer-wise scaling is what lets BERT
    pre-train with a 64k batch; torch ships no LAMB, and apex's is CUDA-only.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, object]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid LAMB hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(update * (group["lr"] * trust))
        return loss


def hidden_matrices(model: nn.Module) -> set[int]:
    """Ids of ``model``'s 2-D parameters that are not an embedding's (nor tied to one): the
    matrices Muon orthogonalizes. Embeddings, an output head tied to them, norms and biases
    are left to AdamW, as Muon's authors and MuLoCo do."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in embedded}


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups marked ``muon: True``, ``torch.optim.AdamW`` on the
    others, as one optimizer: Lightning's automatic optimization and every sync strategy see a
    single optimizer (its ``param_groups`` the two's, so an LR schedule moves both; one
    ``state``, so checkpoints hold both).

    Muon's step is scaled to AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``, Liu et
    al. 2025), so one peak learning rate and schedule serve both halves.
    """

    def __init__(self, groups: Sequence[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 momentum: float = 0.95, weight_decay: float = 0.0) -> None:
        groups = [dict(g) for g in groups]
        muon = [g for g in groups if g.get("muon")]
        rest = [g for g in groups if not g.get("muon")]
        for group in groups:
            group["muon"] = bool(group.get("muon"))
        # the inner optimizers take the group dicts; this one lists the same dicts
        self._muon = torch.optim.Muon(muon, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      adjust_lr_fn="match_rms_adamw") if muon else None
        self._adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay) if rest else None
        super().__init__(groups, {"lr": lr})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after a load)."""
        for inner, muon in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["muon"] is muon]
                inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()
