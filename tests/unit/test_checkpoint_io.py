"""Atomic checkpoint writes and weights-only reads."""

from __future__ import annotations

import pytest
import torch

from syncplane.runtime.checkpoint_io import AtomicCheckpointIO


def test_round_trip_loads_with_weights_only(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "last.ckpt"
    state = {"state_dict": {"w": torch.arange(4.0)}, "syncplane": {"state": {"step": 3}}}
    io.save_checkpoint(state, path)
    assert torch.load(path, weights_only=True)["syncplane"]["state"]["step"] == 3
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.arange(4.0))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary left behind


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"v": torch.tensor(1)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"v": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["v"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"obj": AtomicCheckpointIO}, path)  # a class: needs unpickling code
    with pytest.raises(Exception, match="(?i)weights_only|unsupported"):
        AtomicCheckpointIO().load_checkpoint(path)
