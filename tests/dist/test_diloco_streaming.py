"""Streaming ``diloco`` (``fragments`` P > 1, ``overlap_steps`` τ) through Lightning on real gloo.

TinyRegressor has 49 parameter values; P fragments are even ranges of the flat
parameter vector (P = 2: ``[0, 25) [25, 49)``).

- (P = 3, τ = 0 against a dense reference of fragments at their offsets: on the in-process
  fake, ``tests/unit/test_diloco_fake.py``.)
- P = 2, τ = 1, α = 0.5, outer SGD(lr 0.7): every round, by hand, from the replicas
  recorded at launch and just before the merge:
  ``θ_g ← θ_g − 0.7·mean_i(θ_g − θᵢ(launch))`` and ``θᵢ ← 0.5·θᵢ(merge) + 0.5·θ_g``.
- Resume from a checkpoint written while a fragment's round is between its launch and
  its merge (int8 with per-fragment error feedback) is bit-identical to the
  uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from syncplane.strategies.replicas import load_replicas
from tests.dist.test_diloco import _params, resume_vs_uninterrupted
from tests.helpers.distributed import run_distributed

TWO_FRAGMENTS = [(0, 25), (25, 49)]


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return parameters_to_vector(params).detach()


def _recorded_overlap(rank: int, world: int, tmp_dir: str):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.diloco import DiLoCo
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    class Recording(DiLoCo):
        """Keeps θ_g and the replica at every launch, and the replica around every merge."""

        def _launch(self, fragment, done, background):
            self.log.append(("launch", fragment, done, _params(self.lightning_module), self.outer_params))
            super()._launch(fragment, done, background)

        def _merge(self, round_):
            before = _params(self.lightning_module)
            super()._merge(round_)
            self.log.append(("merge", round_.fragment, self.step + 1, before, _params(self.lightning_module),
                             self.outer_params))

    torch.manual_seed(9)
    model = TinyRegressor(lr=0.05)
    strategy = Recording(cluster_environment=TorchElasticEnvironment(), sync_every=4, fragments=2,
                         overlap_steps=1, outer_kwargs={"lr": 0.7, "momentum": 0.0})
    strategy.log = []
    trainer_for(strategy, tmp_dir, max_steps=9, limit_val_batches=0).fit(model, RegressionData(seed=rank))
    return strategy.log, strategy.mix_alpha


def test_an_overlapped_round_mixes_the_new_global_fragment_into_the_replica_tau_steps_later(tmp_path):
    results = run_distributed(_recorded_overlap, 2, str(tmp_path), timeout=180)
    (log0, alpha), (log1, _) = results
    assert alpha == 0.5
    # P = 2, H = 4: fragment 1 starts after steps 2 and 6, fragment 0 after 4 and 8; each merges a step later
    assert [(kind, p, done) for kind, p, done, *_ in log0] == [
        ("launch", 1, 2), ("merge", 1, 3), ("launch", 0, 4), ("merge", 0, 5),
        ("launch", 1, 6), ("merge", 1, 7), ("launch", 0, 8), ("merge", 0, 9)]
    for k in range(0, len(log0), 2):
        start, end = TWO_FRAGMENTS[log0[k][1]]
        theta_g = log0[k][4]                      # θ_g before the round (same on both ranks)
        assert torch.equal(theta_g, log1[k][4])
        mean_delta = sum(theta_g[start:end] - _flat(log[k][3])[start:end] for log in (log0, log1)) / 2
        g_new = theta_g[start:end] - 0.7 * mean_delta
        for log in (log0, log1):
            _, _, _, before, after, outer_after = log[k + 1]
            before, after = _flat(before), _flat(after)
            torch.testing.assert_close(outer_after[start:end], g_new, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(after[start:end], 0.5 * before[start:end] + 0.5 * g_new,
                                       rtol=1e-6, atol=1e-6)
            # the other fragment is not touched by this merge
            assert torch.equal(after[:start], before[:start]) and torch.equal(after[end:], before[end:])
    # after a mixed merge the replicas still differ (α > 0 keeps part of each local replica)
    assert not torch.allclose(_flat(log0[-1][4])[:25], _flat(log1[-1][4])[:25])


@pytest.mark.parametrize("codec,slots", [
    ({"compression": "int8", "block_size": 4}, 2),
    # SparseLoCo on the gather: one accumulator per rank, each fragment its own slice of it
    ({"compression": "sparse", "density": 0.25, "chunk": 8, "outer": "sparseloco"}, 1),
], ids=["int8", "sparse"])
def test_resume_from_a_checkpoint_written_while_a_fragment_is_in_flight_is_bit_identical(tmp_path, codec, slots):
    streaming = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, **codec}
    results = run_distributed(resume_vs_uninterrupted, 2, str(tmp_path), streaming, "in_flight.ckpt", timeout=240)
    checkpoint = torch.load(tmp_path / "in_flight.ckpt", weights_only=True)
    state = checkpoint["syncplane"]["state"]
    # 10 steps done: fragment 1 started after step 10 and merges after step 11
    assert [(r["fragment"], r["due"], r["committed"]) for r in state["pending"]] == [(1, 11, True)]
    assert len(state["outer"]) == 2 and state["fragments"] == 2 and state["overlap_steps"] == 1
    residuals = [r["rank_state"]["exchange"]["residuals"] for r in load_replicas(tmp_path / "in_flight.ckpt")]
    assert [len(r) for r in residuals] == [slots, slots] and not torch.equal(residuals[0], residuals[1])
    for (params, outer), (resumed_params, resumed_outer), rounds in results:
        assert rounds == 9   # merged after steps 3, 5, ..., 19; the round started after 20 is still pending
        assert torch.equal(outer, resumed_outer)
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)
