"""ATC/AWC's late-peer mixing (``max_staleness``) on 3 real gloo ranks against the dense reference.

Each rank takes a random local "update" per step, then mixes with its ring neighbours
(``NeighborAverager``, weights 1/3). Without a late peer, ``max_staleness`` > 0 gives the
blocking exchange's result bit for bit. With rank 2 held back at step 2 until the others
have combined that step (a store key, no sleep), ranks 0 and 1 use rank 2's message of
step 1, and every rank's result is ``Σ_j A[j, i] x_j(t_j)`` with the messages it recorded,
each at most ``max_staleness`` steps old.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import mix_steps_with_a_late_rank, run_distributed

STEPS, LATE_RANK, LATE_STEP = 5, 2, 2


def _mix(rank: int, world: int, seed: int, max_staleness: int, late: bool, late_after_s: float = 0.0):
    import torch.distributed as dist

    from syncplane.algorithms.decentralized.engine import NeighborAverager
    from syncplane.algorithms.decentralized.schedule import build_graph, build_schedule

    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tensors = [torch.randn(7, generator=generator), torch.randn(3, 4, generator=generator)]
    schedule = build_schedule("static", build_graph("RingGraph", world))
    averager = NeighborAverager(tensors, schedule, bucket_bytes=64, max_staleness=max_staleness,
                                late_after_s=late_after_s, timeout_s=60.0)
    sent, mixed = mix_steps_with_a_late_rank(tensors, generator, lambda step: (averager.launch(step), averager.wait()),
                                             STEPS, LATE_RANK if late else None, LATE_STEP)
    averager.drain()
    averager.close()
    used = list(averager.late.used) if averager.late is not None else []
    if averager.late is not None:   # the counts summary.json reports
        assert averager.late.values == sum(len(by_peer) for _, by_peer in used)
        assert averager.late.stale_values == sum(s != step for step, by_peer in used for s in by_peer.values())
    dist.barrier()
    return sent, mixed, used, schedule.matrix(0)


def test_on_time_peers_give_the_blocking_result_bit_for_bit():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())   # fresh inputs every run
    exact = run_distributed(_mix, 3, seed, 0, False)
    tolerant = run_distributed(_mix, 3, seed, 2, False, 60.0)   # on time: every message within the grace
    for (_, want, _, _), (_, got, used, _) in zip(exact, tolerant):
        for step in range(STEPS):
            assert torch.equal(got[step], want[step]), f"step {step} differs"
    assert all(s == step for _, _, used, _ in tolerant for step, by_peer in used for s in by_peer.values())


def test_a_late_peer_is_mixed_with_its_last_value_within_the_bound():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())   # fresh inputs every run
    results = run_distributed(_mix, 3, seed, 1, True)
    matrix = results[0][3]
    for rank, (sent, mixed, used, _) in enumerate(results):
        assert [step for step, _ in used] == list(range(STEPS))
        for step, by_peer in used:
            assert all(step - 1 <= s <= step for s in by_peer.values()), f"rank {rank} step {step}: {by_peer}"
            want = matrix[rank, rank] * sent[step].double()
            for peer, s in by_peer.items():
                want += matrix[peer, rank] * results[peer][0][s].double()
            torch.testing.assert_close(mixed[step], want.float(), rtol=0, atol=1e-6)
    for rank in range(3):
        if rank != LATE_RANK:   # rank 2 had not even started step 2 when they combined it
            assert results[rank][2][LATE_STEP][1][LATE_RANK] == LATE_STEP - 1


def _through_the_trainer(rank: int, world: int, tmp_dir: str, name: str):
    from tests.dist.test_decentralized import _train

    exact = _train(rank, world, tmp_dir, name, {"schedule": "one_peer"}, 4, 0.9)[0]
    tolerant = _train(rank, world, tmp_dir, name, {"schedule": "one_peer", "max_staleness": 2, "late_after_s": 60.0},
                      4, 0.9)[0]
    return exact, tolerant


@pytest.mark.parametrize("name", ["atc", "awc"])
def test_the_strategies_with_on_time_peers_train_bit_for_bit_as_without(name, tmp_path):
    for exact, tolerant in run_distributed(_through_the_trainer, 3, str(tmp_path), name, timeout=240):
        assert torch.equal(tolerant, exact)


def _resume(rank: int, world: int, tmp_dir: str, name: str, seed: int):
    """2 epochs of 3 steps straight through vs. 1 epoch, a checkpoint and a resume, nobody late:
    the parameters, and the late-peer mixer the resumed run starts from (the one the first run
    checkpointed: message counters, each neighbour's newest message)."""
    from lightning.pytorch.callbacks import Callback

    from tests.dist.test_decentralized import _flat, _strategy
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    started = []

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            started.extend(mixer.state_dict() for mixer in trainer.strategy.late_mixers())

    def fit(epochs: int, ckpt: str | None = None, init_seed: int = seed):
        torch.manual_seed(init_seed)
        model = TinyRegressor()
        strategy = _strategy(name, schedule="one_peer", max_staleness=2, late_after_s=60.0, consensus_every=0)
        trainer = trainer_for(strategy, tmp_dir, max_epochs=epochs, limit_val_batches=0, callbacks=[AtStart()])
        trainer.fit(model, RegressionData(n=72, seed=seed + rank), ckpt_path=ckpt)
        return trainer, model, strategy

    _, model, _ = fit(2)
    straight = _flat(model.parameters())
    trainer, _, strategy = fit(1)
    trainer.save_checkpoint(f"{tmp_dir}/{name}.ckpt")
    saved = [mixer.state_dict() for mixer in strategy.late_mixers()]
    started.clear()
    _, model, _ = fit(2, f"{tmp_dir}/{name}.ckpt", init_seed=seed + 1)   # the checkpoint restores everything
    return straight, _flat(model.parameters()), saved, started


@pytest.mark.parametrize("name", ["atc", "awc"])
def test_a_resume_restores_the_late_peer_mixers_and_is_bit_identical(name, tmp_path):
    seed = int(torch.randint(0, 2**31 - 2, ()).item())   # fresh inputs every run
    for straight, resumed, saved, started in run_distributed(_resume, 3, str(tmp_path), name, seed, timeout=240):
        assert torch.equal(resumed, straight)
        assert len(saved) == len(started) >= 1
        for want, got in zip(saved, started):
            for key in ("sent", "received", "values", "stale_values", "used"):
                assert got[key] == want[key], key
            assert want["values"] > 0 and got["latest"].keys() == want["latest"].keys()
            for peer, message in want["latest"].items():
                assert all(torch.equal(a, b) for a, b in zip(got["latest"][peer]["buffers"], message["buffers"]))
