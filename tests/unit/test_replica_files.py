"""Per-rank replica files beside a checkpoint: naming, reading back, pruning, old layout.

The collective part (every rank writes, a barrier, rank 0 writes the checkpoint) runs in
``tests/dist/test_strategy_base.py`` and the strategies' resume tests; these are the
file rules, which need no process group.
"""

from __future__ import annotations

import pytest
import torch

from syncplane.strategies import replicas
from syncplane.runtime.checkpoint_io import AtomicCheckpointIO


def _write(tmp_path, tag: str, world: int) -> tuple:
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    states = [{"model": {"w": torch.full((3,), float(r))}, "optimizers": [], "rank_state": {"r": r}}
              for r in range(world)]
    for r, state in enumerate(states):
        io.save_checkpoint(state, replicas.shard_path(path, tag, r))
    io.save_checkpoint({"syncplane": {"replica_shards": {"tag": tag, "world_size": world}}}, path)
    return io, path, states


def test_each_rank_reads_back_its_own_replica(tmp_path):
    io, path, states = _write(tmp_path, "t1", 3)
    assert replicas.shard_path(path, "t1", 2) == tmp_path / "last.ckpt.replicas" / "t1.rank2.pt"
    for rank in range(3):
        checkpoint = io.load_checkpoint(path)
        replicas.attach_own_replica(io, path, checkpoint, rank, 3)
        own = replicas.own_replica(checkpoint, rank, 3)
        assert own["rank_state"] == {"r": rank} and torch.equal(own["model"]["w"], states[rank]["model"]["w"])
    assert [r["rank_state"]["r"] for r in replicas.load_replicas(path)] == [0, 1, 2]
    (tmp_path / "link.ckpt").symlink_to(path)      # save_last="link": the replicas are the target's
    assert [r["rank_state"]["r"] for r in replicas.load_replicas(tmp_path / "link.ckpt")] == [0, 1, 2]


def test_another_world_size_resumes_from_the_consensus(tmp_path):
    io, path, _ = _write(tmp_path, "t1", 3)
    checkpoint = io.load_checkpoint(path)
    replicas.attach_own_replica(io, path, checkpoint, 0, 2)     # reads nothing for 2 ranks
    assert "own_replica" not in checkpoint["syncplane"]
    with pytest.warns(UserWarning, match="3 replicas but this run has 2 ranks"):
        assert replicas.own_replica(checkpoint, 0, 2) is None


def test_a_missing_replica_is_a_clear_error(tmp_path):
    io, path, _ = _write(tmp_path, "t1", 2)
    replicas.shard_path(path, "t1", 1).unlink()
    checkpoint = io.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"rank 1's replica .*t1\.rank1\.pt is missing"):
        replicas.attach_own_replica(io, path, checkpoint, 1, 2)
    with pytest.raises(ValueError, match="load_checkpoint"):   # loaded without its replica
        replicas.own_replica(checkpoint, 1, 2)


def test_pruning_keeps_the_named_save_and_removes_only_own_files(tmp_path):
    _write(tmp_path, "old", 2)
    _, path, _ = _write(tmp_path, "new", 2)
    replicas.prune_replicas(path, 0, keep="new")
    assert sorted(p.name for p in replicas.shard_dir(path).iterdir()) == ["new.rank0.pt", "new.rank1.pt",
                                                                         "old.rank1.pt"]
    replicas.prune_replicas(path, 1, keep="new")
    replicas.prune_replicas(path, 0)                            # removing the checkpoint: all of rank 0's
    assert [p.name for p in replicas.shard_dir(path).iterdir()] == ["new.rank1.pt"]
    replicas.prune_replicas(path, 1)
    assert not replicas.shard_dir(path).exists()


def test_checkpoints_with_every_replica_inside_still_load(tmp_path):
    """The layout before per-rank files: rank 0 gathered every replica into the checkpoint."""
    inside = [{"model": {"w": torch.zeros(2)}, "optimizers": [], "rank_state": {"r": r}} for r in range(2)]
    path = tmp_path / "old.ckpt"
    torch.save({"syncplane": {"replicas": inside}}, path)
    checkpoint = torch.load(path, weights_only=True)
    assert replicas.own_replica(checkpoint, 1, 2)["rank_state"] == {"r": 1}
    assert [r["rank_state"]["r"] for r in replicas.load_replicas(path)] == [0, 1]
