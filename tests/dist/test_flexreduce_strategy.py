"""``strategy=flexreduce`` through Lightning's Trainer on real gloo processes.

FlexReduce only changes DDP's data path, so with the same seed and data its parameters
after a few steps must equal DDP's (to float rounding: the sums are associated by the
tree, not by torch's ring).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import RemoteError, run_distributed
from tests.helpers.strategies import fit_digits


def _train_digits(rank: int, world: int, tmp_dir: str, name: str, kwargs: dict, **trainer: object) -> torch.Tensor:
    strategy, model = fit_digits(name, kwargs, tmp_dir, **trainer)
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    if name == "flexreduce":
        assert strategy.comm_meter.calls > 0, "the FlexReduce hook never ran"
    return flat


def _both(rank: int, world: int, tmp_dir: str) -> tuple[torch.Tensor, ...]:
    ddp = _train_digits(rank, world, tmp_dir, "ddp", {})
    # hosts of 1 and 3 ranks, tiny chunks: an uneven, pipelined plan
    flex = _train_digits(rank, world, tmp_dir, "flexreduce", {"topology": [1, 3], "chunk_mb": 0.01})
    plain = _train_digits(rank, world, tmp_dir, "flexreduce", {"topology": [1, 3], "chunk_mb": 0})
    # gradient accumulation: DDP's no_sync on the first micro-batch, the hook on the second
    ddp_acc = _train_digits(rank, world, tmp_dir, "ddp", {}, accumulate_grad_batches=2)
    flex_acc = _train_digits(rank, world, tmp_dir, "flexreduce", {"topology": [1, 3]}, accumulate_grad_batches=2)
    # mixed precision (bf16 autocast on CPU): the hook still sees the fp32 gradient buckets
    ddp_amp = _train_digits(rank, world, tmp_dir, "ddp", {}, precision="bf16-mixed")
    flex_amp = _train_digits(rank, world, tmp_dir, "flexreduce", {"topology": [1, 3]}, precision="bf16-mixed")
    return ddp, flex, plain, ddp_acc, flex_acc, ddp_amp, flex_amp


def test_flexreduce_equals_ddp_after_5_steps_on_digits(tmp_path) -> None:
    results = run_distributed(_both, 4, str(tmp_path), timeout=500)
    for ddp, flex, plain, ddp_acc, flex_acc, ddp_amp, flex_amp in results:
        torch.testing.assert_close(flex, ddp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flex_acc, ddp_acc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flex_amp, ddp_amp, rtol=1e-5, atol=1e-5)
        assert not torch.equal(flex_amp, flex)             # bf16 autocast did change the run
        assert torch.equal(flex, plain)                    # pipelining does not change a bit
        assert torch.equal(flex, results[0][1])            # replicas identical
        assert not torch.equal(flex_acc, flex)             # accumulation did change the run
    assert not torch.equal(results[0][0], torch.zeros_like(results[0][0]))


def _bad_tree(rank: int, world: int, tmp_dir: str) -> None:
    _train_digits(rank, world, tmp_dir, "flexreduce", {"topology": [1, 2]})


def test_tree_of_another_size_is_an_error_before_the_first_step(tmp_path) -> None:
    with pytest.raises(RemoteError, match=r"tree: its 3 leaves do not cover the world of 2 ranks|"
                                          r"3 leaves do not cover"):
        run_distributed(_bad_tree, 2, str(tmp_path), timeout=120)
