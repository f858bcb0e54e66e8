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
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer

from syncplane.comm.collectives import gather_to_rank0
from syncplane.comm.process_groups import control_group


def replica_state(module: torch.nn.Module, optimizers: Sequence[Optimizer],
                  stash: Mapping[int, torch.Tensor], rank_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's model and optimizer state, and the strategy's per-rank state; ``stash``
    substitutes the rank's own values for tensors that currently hold the consensus (during
    validation)."""
    model = {k: stash.get(v.data_ptr(), v).detach().clone() for k, v in module.state_dict().items()}
    return {"model": model, "optimizers": [opt.state_dict() for opt in optimizers],
            "rank_state": dict(rank_state or {})}


def gather_replicas(module: torch.nn.Module, optimizers: Sequence[Optimizer],
                    stash: Mapping[int, torch.Tensor],
                    rank_state: Mapping[str, Any] | None = None) -> list[dict[str, Any]] | None:
    """Collective: rank 0 gets a list with every rank's ``replica_state``, others None.
    The one place per-rank state is gathered (replicas, EMAs, error-feedback residuals)."""
    state = replica_state(module, optimizers, stash, rank_state)
    return gather_to_rank0(state, group=control_group())   # CPU objects: the control plane


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
