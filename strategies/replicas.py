"""Every rank's replica in the checkpoint, so decentralized training resumes exactly.

Lightning writes checkpoints from rank 0 only. With DDP that loses nothing; with
strategies whose replicas (and optimizer states, e.g. momentum) differ per rank, a
resume from rank 0's state alone would not continue the run. Here rank 0 gathers each
rank's model and optimizer state into the checkpoint (plain tensors and containers,
loadable with ``weights_only=True``); on resume each rank takes back its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from syncplane.comm.process_groups import control_group
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer


def replica_state(module: torch.nn.Module, optimizers: Sequence[Optimizer],
                  stash: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """This rank's model and optimizer state; ``stash`` substitutes the rank's own values
    for tensors that currently hold the consensus (during validation)."""
    model = {k: stash.get(v.data_ptr(), v).detach().clone() for k, v in module.state_dict().items()}
    return {"model": model, "optimizers": [opt.state_dict() for opt in optimizers]}


def gather_replicas(module: torch.nn.Module, optimizers: Sequence[Optimizer],
                    stash: Mapping[int, torch.Tensor], is_rank0: bool) -> list[dict[str, Any]] | None:
    """Collective: rank 0 gets a list with every rank's ``replica_state``, others None."""
    state = replica_state(module, optimizers, stash)
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_rank0 else None
    dist.gather_object(state, gathered, dst=0, group=control_group())
    return gathered


def own_replica(checkpoint: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's saved replica, or None when the checkpoint has none for this world size."""
    saved = (checkpoint.get("syncplane") or {}).get("replicas")
    if not saved:
        return None
    if len(saved) != world_size:
        rank_zero_warn(
            f"the checkpoint holds {len(saved)} replicas but this run has {world_size} ranks: every rank "
            "resumes from the consensus model and rank 0's optimizer state"
        )
        return None
    return saved[rank]
