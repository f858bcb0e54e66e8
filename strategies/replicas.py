"""Every rank's replica beside the checkpoint, so decentralized training resumes exactly.

Lightning writes checkpoints from rank 0 only. With DDP that loses nothing; with
strategies whose replicas (and optimizer states, e.g. momentum) differ per rank, a
resume from rank 0's state alone would not continue the run. So each rank writes its
own model, optimizer and per-rank strategy state (plain tensors and containers,
loadable with ``weights_only=True``) into ``<checkpoint>.replicas/<tag>.rank<r>.pt``,
and the checkpoint names the ``tag``; on resume each rank reads back its own file.

Why a file per rank and not one file: rank 0 used to gather every replica into the
checkpoint, which moved (world - 1) × (model + optimizer state) through its links at
every save -- on ``two_racks`` (100 Mbit rack uplinks, 8 ranks, a 1.9 M-parameter
model) about 8 s per save, 25-35 s of a 3-epoch run's training clock, and rank 0 held
every replica in memory. Written locally, a save costs each rank one local write.
The price: the checkpoint folder must be shared by every host (as on this machine, or
a shared filesystem), or each host must keep its own ranks' files for a resume.

Crash safety: the shards of a save are all on disk (a barrier) before rank 0 replaces
the checkpoint that names them, and older shards are deleted only after it has; a
crash at any point leaves a checkpoint whose shards exist.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer

from syncplane.algorithms.replicas import agreed_token, control_barrier
from syncplane.algorithms.sharded import local, plain


def replica_state(module: torch.nn.Module, optimizers: Sequence[Optimizer],
                  stash: Mapping[int, torch.Tensor], rank_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's model and optimizer state (its shards, as plain tensors, where FSDP2 shards
    the model), and the strategy's per-rank state; ``stash`` substitutes the rank's own values
    for tensors that currently hold the consensus (during validation)."""
    model = {k: stash.get(v.data_ptr(), v).detach().clone()
             for k, v in ((k, local(v)) for k, v in module.state_dict().items())}
    return {"model": model, "optimizers": [plain(opt.state_dict()) for opt in optimizers],
            "rank_state": dict(rank_state or {})}


def shard_dir(checkpoint_path: str | os.PathLike[str]) -> Path:
    """The folder of a checkpoint's per-rank replicas: ``<checkpoint>.replicas``, beside the
    file a link points to (Lightning's ``save_last="link"`` makes ``last.ckpt`` a link)."""
    path = Path(os.path.realpath(checkpoint_path))
    return path.with_name(f"{path.name}.replicas")


def shard_path(checkpoint_path: str | os.PathLike[str], tag: str, rank: int) -> Path:
    return shard_dir(checkpoint_path) / f"{tag}.rank{rank}.pt"


def save_own_replica(io: CheckpointIO, checkpoint_path: str | os.PathLike[str], state: Mapping[str, Any],
                     rank: int, world_size: int) -> dict[str, Any]:
    """Collective: every rank writes its ``replica_state`` under a tag rank 0 chose for this
    save; returns what the checkpoint records (``{"tag", "world_size"}``). Returns after
    every rank's file is written, so the checkpoint written next never names a missing one."""
    tag = agreed_token()
    io.save_checkpoint(dict(state), shard_path(checkpoint_path, tag, rank))
    control_barrier()
    return {"tag": tag, "world_size": world_size}


def prune_replicas(checkpoint_path: str | os.PathLike[str], rank: int, keep: str | None = None) -> None:
    """Delete this rank's replica files of ``checkpoint_path`` except those tagged ``keep``
    (None: all of them, and the folder once it is empty). Each rank deletes its own: on
    hosts without a shared folder no other rank can see them."""
    folder = shard_dir(checkpoint_path)
    for path in folder.glob(f"*.rank{rank}.pt"):
        if keep is None or not path.name.startswith(f"{keep}."):
            path.unlink(missing_ok=True)
    if keep is None:
        try:
            folder.rmdir()
        except OSError:
            pass   # another rank's files are still there (it removes its own), or no folder


def attach_own_replica(io: CheckpointIO, checkpoint_path: str | os.PathLike[str], checkpoint: dict[str, Any],
                       rank: int, world_size: int) -> None:
    """Read this rank's replica of a loaded checkpoint into ``checkpoint["syncplane"]["own_replica"]``
    (nothing when the checkpoint has no replicas, or has them for another world size)."""
    extra = checkpoint.get("syncplane") or {}
    saved = extra.get("replica_shards")
    if not saved or saved["world_size"] != world_size:
        return
    path = shard_path(checkpoint_path, saved["tag"], rank)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {checkpoint_path}: rank {rank}'s replica {path} is missing. Each rank writes its "
            "replica beside the checkpoint, so resume with the checkpoint folder shared by every host "
            "(or with each host's own files in place)")
    extra["own_replica"] = io.load_checkpoint(path)


def own_replica(checkpoint: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's saved replica, or None when the checkpoint has none for this world size.
    Reads checkpoints of both layouts: replicas beside it (``attach_own_replica`` has read
    this rank's) and, from before, every rank's inside it."""
    extra = checkpoint.get("syncplane") or {}
    inside, beside = extra.get("replicas"), extra.get("replica_shards")
    if not inside and not beside:
        return None
    saved_world = len(inside) if inside else int(beside["world_size"])
    if saved_world != world_size:
        rank_zero_warn(
            f"the checkpoint holds {saved_world} replicas but this run has {world_size} ranks: every rank "
            "resumes from the consensus model and rank 0's optimizer state"
        )
        return None
    if inside:
        return inside[rank]
    if "own_replica" not in extra:
        raise ValueError("this checkpoint's replicas are files beside it: load it with the strategy's "
                         "load_checkpoint(path), which reads this rank's")
    return extra["own_replica"]


def load_replicas(checkpoint_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's replica of a checkpoint, in rank order (inspection and tests; one
    process reads them all, so the folder must hold every rank's file)."""
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    extra = checkpoint.get("syncplane") or {}
    if extra.get("replicas"):
        return list(extra["replicas"])
    saved = extra.get("replica_shards")
    if not saved:
        raise ValueError(f"checkpoint {checkpoint_path} holds no per-rank replicas")
    return [torch.load(shard_path(checkpoint_path, saved["tag"], r), weights_only=True)
            for r in range(int(saved["world_size"]))]
