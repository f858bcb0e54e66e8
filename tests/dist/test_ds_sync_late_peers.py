"""DS-Sync's late-member averaging (``max_staleness``) on 3 real gloo ranks against the dense reference.

Each rank takes a random local "update" per step, then averages within its DS-Sync group of
the step (``DSSync.sync_``). Without a late member, ``max_staleness`` > 0 gives the group mean
(a pair: bit for bit the blocking pair swap; a group of three: within float tolerance). With
rank 2 held back at step 2 until the others have combined that step (a store key, no sleep),
ranks 0 and 1 use rank 2's message of step 1, and every rank's result is the mean over its
group of the messages it recorded, each at most ``max_staleness`` steps old. Through the
Trainer: on time, the strategy trains bit for bit as without the option (pairs); with a rank
late at one step, the job finishes and reports the stale value it used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from tests.helpers.distributed import mix_steps_with_a_late_rank, run_distributed

STEPS, LATE_RANK, LATE_STEP = 5, 2, 2
ONE_RACK, TWO_RACKS = [[0, 1, 2]], [[0, 1], [2]]   # a group of three every step; pairs and a rank alone


def _sync(rank: int, world: int, seed: int, racks: list[list[int]], max_staleness: int, late: bool,
          late_after_s: float = 0.0):
    import torch.distributed as dist

    from syncplane.algorithms.ds_sync.engine import DSSync
    from syncplane.comm import make_buckets

    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tensors = [torch.randn(7, generator=generator), torch.randn(3, 4, generator=generator)]
    runtime = DSSync(racks, np.full((world, world), 1e8), pair_streams=1, max_staleness=max_staleness,
                     late_after_s=late_after_s, timeout_s=60.0)
    buckets = make_buckets(tensors, cap_bytes=64)   # two buckets
    sent, mixed = mix_steps_with_a_late_rank(tensors, generator, lambda _: runtime.sync_(buckets), STEPS,
                                             LATE_RANK if late else None, LATE_STEP)
    runtime.drain()
    runtime.close()
    used = list(runtime.late.used) if runtime.late is not None else []
    dist.barrier()
    return sent, mixed, used, [runtime.pattern.group_of(rank, s) for s in range(STEPS)]


@pytest.mark.parametrize("racks", [ONE_RACK, TWO_RACKS], ids=["group_of_3", "pairs"])
def test_without_a_late_member_every_rank_holds_its_groups_mean(racks):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())   # fresh inputs every run
    exact = run_distributed(_sync, 3, seed, racks, 0, False)
    tolerant = run_distributed(_sync, 3, seed, racks, 2, False, 60.0)   # on time: every message within the grace
    for rank, ((_, want, _, groups), (sent, got, used, _)) in enumerate(zip(exact, tolerant)):
        for step, group in enumerate(groups):
            mean = torch.stack([tolerant[r][0][step].double() for r in group]).mean(0).float()
            torch.testing.assert_close(got[step], mean, rtol=1e-6, atol=1e-6)   # the dense reference
            if len(group) <= 2:   # round(a + b)/2 either way: bit for bit the blocking swap
                assert torch.equal(got[step], want[step]), f"rank {rank} step {step} differs"
            else:
                torch.testing.assert_close(got[step], want[step], rtol=1e-6, atol=1e-6)
        assert [step for step, _ in used] == [s for s, g in enumerate(groups) if len(g) > 1]
        assert all(s == step for step, by_peer in used for s in by_peer.values())


def test_a_late_member_counts_with_its_last_message_within_the_bound():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())   # fresh inputs every run
    results = run_distributed(_sync, 3, seed, ONE_RACK, 1, True)   # finishes: nobody waits for the late rank
    for rank, (sent, mixed, used, groups) in enumerate(results):
        assert [step for step, _ in used] == list(range(STEPS))
        for step, by_peer in used:
            assert set(by_peer) == set(groups[step]) - {rank}
            assert all(step - 1 <= s <= step for s in by_peer.values()), f"rank {rank} step {step}: {by_peer}"
            values = [sent[step].double()] + [results[peer][0][s].double() for peer, s in by_peer.items()]
            torch.testing.assert_close(mixed[step], torch.stack(values).mean(0).float(), rtol=0, atol=1e-6)
    for rank in range(3):
        if rank != LATE_RANK:   # rank 2 had not even started step 2 when they combined it
            assert results[rank][2][LATE_STEP][1][LATE_RANK] == LATE_STEP - 1


def test_bad_late_peer_settings_are_refused_naming_the_key():
    from syncplane.algorithms.ds_sync.config import DSSyncConfig

    with pytest.raises(ValueError, match="max_staleness"):
        DSSyncConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="late_after_s"):
        DSSyncConfig(max_staleness=1, late_after_s=-0.5)
    with pytest.raises(ValueError, match="pair_streams=4 with max_staleness=2"):
        DSSyncConfig(max_staleness=2, pair_streams=4)
    assert DSSyncConfig(max_staleness=2).streams == 1 and DSSyncConfig().streams == "auto"


#: 3 ranks in two racks: DS-Sync pairs (0, 2) then (1, 2), the other rank alone
PROFILE = {"name": "test_2_1", "racks": [
    {"name": "r0", "uplink_mbit": 100, "hosts": [{"name": "a0", "nic_mbit": 400}, {"name": "a1", "nic_mbit": 400}]},
    {"name": "r1", "uplink_mbit": 100, "hosts": [{"name": "b0", "nic_mbit": 400}]},
]}


def _late_at(step: int, late_rank: int, tag: str = "synced", grace_s: float | None = None):
    """A callback holding ``late_rank`` back at ``step`` until the others have synced it (no sleep;
    store keys under ``tag``, one per fit of a process group). With ``grace_s`` the others wait
    that long for a message (``late_after_s``) except at ``step``, where they give up at once: a
    run whose every choice is known in advance."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.distributed import distributed_c10d

    store, world = distributed_c10d._get_default_store(), dist.get_world_size()

    def grace(trainer, seconds: float | None) -> None:
        if seconds is not None:
            trainer.strategy.runtime.late.late_after_s = seconds

    class Late(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == step and dist.get_rank() == late_rank:
                store.wait([f"{tag}/{step}/{r}" for r in range(world) if r != late_rank])
            elif trainer.global_step == step:
                grace(trainer, grace_s and 0.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            store.set(f"{tag}/{trainer.global_step - 1}/{dist.get_rank()}", "1")
            grace(trainer, grace_s)

    return Late()


def _fit(rank: int, world: int, tmp_dir: str, profile: str, kwargs: dict, late: bool):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.ds_sync import DSSyncStrategy
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    torch.manual_seed(123)
    model = TinyRegressor()
    strategy = DSSyncStrategy(topology=profile, adjust_every=0, pair_streams=1,
                              cluster_environment=TorchElasticEnvironment(), **kwargs)
    callbacks = [_late_at(LATE_STEP, LATE_RANK)] if late else []
    trainer_for(strategy, tmp_dir, max_steps=STEPS, limit_val_batches=0, callbacks=callbacks).fit(
        model, RegressionData(seed=rank))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dict(strategy.details)


def test_through_the_trainer_on_time_is_bit_for_bit_and_a_late_rank_does_not_hold_the_job(tmp_path):
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    exact = run_distributed(_fit, 3, str(tmp_path), str(profile), {}, False, timeout=240)
    on_time = run_distributed(_fit, 3, str(tmp_path), str(profile), {"max_staleness": 2, "late_after_s": 60.0},
                              False, timeout=240)
    for (want, _), (got, details) in zip(exact, on_time):
        assert torch.equal(got, want)
        assert details["late_peers"]["stale_values"] == 0 and details["late_peers"]["neighbour_values"] > 0
    late = run_distributed(_fit, 3, str(tmp_path), str(profile), {"max_staleness": 1, "late_after_s": 0.0},
                           True, timeout=240)
    # rank 0 pairs with rank 2 at the late step: it went on with rank 2's message of the step before
    assert late[0][1]["late_peers"]["stale_values"] >= 1
    assert "late_peers" not in exact[0][1]


def _resume(rank: int, world: int, tmp_dir: str, profile: str, seed: int):
    """Straight through 2 epochs of 3 steps vs. stopped after the first, checkpointed and
    resumed; rank 2 is late at step 3, the first step after the resume: its mate must count
    with its message of step 2, the newest one the checkpoint holds."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from syncplane.strategies.ds_sync import DSSyncStrategy
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    def fit(tag: str, epochs: int, ckpt_path: str | None = None, init_seed: int = seed):
        torch.manual_seed(init_seed)
        model = TinyRegressor()
        strategy = DSSyncStrategy(topology=profile, adjust_every=0, max_staleness=2, late_after_s=60.0,
                                  cluster_environment=TorchElasticEnvironment())
        trainer = trainer_for(strategy, tmp_dir, max_epochs=epochs, limit_val_batches=0,
                              callbacks=[_late_at(3, LATE_RANK, tag, 60.0)])
        trainer.fit(model, RegressionData(n=72, seed=seed + rank), ckpt_path=ckpt_path)   # 3 steps an epoch
        return trainer, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), strategy

    _, params, strategy = fit("straight", 2)
    straight = params, strategy.runtime.late.state_dict()
    trainer, _, _ = fit("first", 1)
    trainer.save_checkpoint(f"{tmp_dir}/mid.ckpt")
    _, params, strategy = fit("resumed", 2, f"{tmp_dir}/mid.ckpt", init_seed=seed + 1)   # the checkpoint restores it
    return straight, (params, strategy.runtime.late.state_dict())


def test_resume_with_max_staleness_continues_bit_for_bit(tmp_path):
    """The checkpoint drains the messages in flight and keeps each rank's late-peer mixer
    (message counters, every mate's newest message, the counts): the resumed run makes the
    same choices -- a stale value at the step after the resume -- and ends bit for bit equal."""
    from syncplane.strategies.replicas import load_replicas

    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    seed = int(torch.randint(0, 2**31 - 2, ()).item())   # fresh inputs every run
    results = run_distributed(_resume, 3, str(tmp_path), str(profile), seed, timeout=240)
    for (want, want_late), (got, got_late) in results:
        assert torch.equal(got, want)
        for key in ("sent", "received", "values", "stale_values", "used"):
            assert got_late[key] == want_late[key], key
        assert got_late["latest"].keys() == want_late["latest"].keys()
        for peer, message in want_late["latest"].items():
            assert all(torch.equal(a, b) for a, b in zip(got_late["latest"][peer]["buffers"], message["buffers"]))
    stale = [(rank, step, by_peer) for rank, (_, (_, late)) in enumerate(results) for step, by_peer in late["used"]
             if any(s != step for s in by_peer.values())]
    # the one late message: rank 2's newest to its mate of step 3, from step 1 (pairs alternate mates)
    assert [(step, by_peer) for _, step, by_peer in stale] == [(3, {LATE_RANK: 1})]
    saved = [r["rank_state"]["late_peers"] for r in load_replicas(tmp_path / "mid.ckpt")]
    assert all(state["values"] > 0 and state["latest"] for state in saved)   # weights_only, every rank
