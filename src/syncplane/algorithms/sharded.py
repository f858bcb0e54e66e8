"""A model sharded by FSDP2's ``fully_shard`` (its parameters DTensors), seen by what every
strategy does with a replica: average it, checkpoint it, load it back. Lightning-free.

Why plain local shards in the files: a rank's replica file (and its optimizer state) holds
the rank's own shard as plain tensors, so it loads with ``torch.load(weights_only=True)`` and
no process group; the DTensor around it (mesh, placements, global shape) is the live
model's, taken from the parameter it goes back into.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

#: A submodule of at least this many parameters (not already in a smaller unit) becomes an
#: FSDP unit of its own, so that only one such unit is unsharded at a time (BERT-large: one
#: encoder layer, 12.6 M, instead of the whole model's 335 M).
UNIT_PARAMS = 8_000_000


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own values of ``tensor``: its FSDP shard (a view: writing it writes the parameter)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_module(module: torch.nn.Module, mesh: DeviceMesh, unit_params: int = UNIT_PARAMS) -> torch.nn.Module:
    """FSDP2 over ``mesh``, in place, the way Lightning's ``ModelParallelStrategy`` expects it:
    every submodule that holds ``unit_params`` parameters of its own subtree (not in a smaller
    unit) and every child of the root that holds any is a unit; the root itself only when it
    has parameters of its own (then its ``forward`` must be what runs). Calling a child
    (``self.net(x)`` in a ``training_step``) unshards what it needs. A submodule that holds a
    parameter tied elsewhere (BERT's word embeddings and its MLM decoder) is no unit of its
    own: a tied parameter belongs to one unit, the one above both."""
    def uses(m: torch.nn.Module) -> dict[int, int]:
        counts: dict[int, int] = {}
        for _, p in m.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        return counts

    everywhere = uses(module)
    tied = {id(m): any(n < everywhere[key] for key, n in uses(m).items()) for m in module.modules()}

    def unsharded(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if not isinstance(p, DTensor))

    def visit(m: torch.nn.Module, top: bool) -> None:
        for child in m.children():
            visit(child, False)
        n = unsharded(m)
        if n and (top or (n >= unit_params and not tied[id(m)])):   # tied: a parameter also used outside m
            fully_shard(m, mesh=mesh)

    for child in module.children():
        visit(child, True)
    if unsharded(module):
        fully_shard(module, mesh=mesh)
    return module


def materialize(module: torch.nn.Module, init: Callable[[str, torch.Tensor], None], device: str = "cpu") -> None:
    """Give values to ``module``, built on the meta device and sharded by ``shard_module``: each
    parameter and buffer is made whole by ``init(name, tensor)``, one at a time and submodule by
    submodule (a tied parameter by its first owner), and this rank keeps its shard. The peak is
    the largest tensor, never the model, and the values are the same whatever the layout (a
    shard of the same whole tensor on every node), so the replicas start as one model.
    ``init`` must be deterministic: seed its randomness by ``name``, or draw from a seeded
    generator in this (every rank's same) order, as ``reset_init`` does."""
    module.to_empty(device=device)
    seen: set[int] = set()
    with torch.no_grad():
        for prefix, owner in module.named_modules():
            for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                init(f"{prefix}.{name}" if prefix else name, whole)
                local(tensor.data).copy_(like(whole, tensor.data).to_local() if isinstance(tensor.data, DTensor)
                                         else whole)


def reset_init(meta_module: torch.nn.Module, device: str = "cpu") -> Callable[[str, torch.Tensor], None]:
    """An ``init`` for ``materialize`` from torch's own initialization: the submodule that owns a
    tensor is made whole on its own (a copy of ``meta_module``'s, taken here, before sharding)
    and its ``reset_parameters()`` run, as Lightning materializes a model built on the meta
    device. The submodules come in the order ``materialize`` asks for them, one at a time, so
    every rank draws the same values from the same seed; a submodule with tensors and no
    ``reset_parameters`` is refused by name."""
    def own_tensors(m: torch.nn.Module) -> bool:
        return any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))

    def refused(prefix: str, m: torch.nn.Module) -> ValueError:
        return ValueError(f"{prefix or 'the root module'} ({type(m).__name__}) has tensors and no "
                          "reset_parameters(): build it on the meta device with an init of its own")

    # the root (a LightningModule, attached to its trainer) is never copied: it has no reset_parameters
    template: dict[str, torch.nn.Module | ValueError] = {
        prefix: (copy.deepcopy(m) if prefix and hasattr(m, "reset_parameters") else refused(prefix, m))
        for prefix, m in meta_module.named_modules() if own_tensors(m)}
    current: dict[str, torch.nn.Module] = {}

    def init(name: str, tensor: torch.Tensor) -> None:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in current:
            owner = template[prefix]
            if isinstance(owner, ValueError):
                raise owner
            for done in current.values():        # one whole submodule at a time
                done.to_empty(device="meta", recurse=False)
            current.clear()
            owner.to_empty(device=device, recurse=False)
            owner.reset_parameters()  # type: ignore[operator]
            current[prefix] = owner
        tensor.copy_(getattr(current[prefix], leaf))

    return init


def on_meta(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a parameter without storage yet (built on the meta device)."""
    return any(p.is_meta or (isinstance(p, DTensor) and p.to_local().is_meta) for p in module.parameters())


def plain(obj: Any) -> Any:
    """``obj`` (a state dict, an optimizer's, nested) with every DTensor replaced by a copy of
    this rank's shard: what a rank's replica file holds."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def like(value: Any, ref: Any) -> Any:
    """``value`` (a plain shard, or a whole tensor) as a DTensor laid out like ``ref``; anything
    else as it is."""
    if not isinstance(ref, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.shape == ref.shape and value.shape != ref.to_local().shape:   # the whole tensor: take our part
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
    return DTensor.from_local(value.to(ref.device), ref.device_mesh, ref.placements, shape=ref.shape,
                              stride=ref.stride(), run_check=False)


def load_module_state(module: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
    """``module.load_state_dict(state)``, where ``state`` holds whole tensors (the consensus) or
    this rank's plain shards (its replica file) of a module that may be FSDP2-sharded."""
    refs = module.state_dict()
    module.load_state_dict({k: like(v, refs.get(k)) for k, v in state.items()}, strict=strict)


def optimizer_state_like(state: Mapping[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` from a replica file (plain shards), its per-parameter
    tensors of a parameter's local shape made DTensors like that parameter (``params`` in the
    optimizer's order), so that ``optimizer.load_state_dict`` gives the step DTensors again."""
    out = dict(state)
    out["state"] = {i: {k: like(v, params[int(i)]) if isinstance(v, torch.Tensor)
                        and v.shape == local(params[int(i)]).shape and v.dim() else v
                        for k, v in s.items()}
                    for i, s in state["state"].items()}
    return out


def has_shards(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2-sharded)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def whole(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor gathered whole (a collective over its mesh: every rank
    calls it, same keys, same order): what the checkpoint that rank 0 writes holds."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 unit of ``module`` back to its shards. A forward without a backward
    (validation) leaves a root unit's parameters whole -- FSDP2 keeps them for the backward it
    expects -- and the next forward would reuse those instead of the shards written since."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
