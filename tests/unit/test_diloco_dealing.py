"""The deal of ``time_samples: share`` (``syncplane.algorithms.diloco.dealing``), without
processes: every rank's sampler computes the same deal from the same counts, the stream is the
dataset once per epoch, and what cannot be dealt is refused with the key named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from syncplane.algorithms.diloco.adaptive import TimedRounds
from syncplane.algorithms.diloco.dealing import DealtBatches, check_resumed, check_schedulers, dealt_loader


def _deal(n: int, batch: int, world: int, slots: int, counts: list[int], epoch: int = 0, first: int = 0,
          drop_last: bool = True):
    """Every rank's sampler over one epoch: [rank] -> [(slot, indices, computes)]."""
    samplers = [DealtBatches(n, batch, drop_last, True, 7, world, rank, slots, lambda r: counts,
                             lambda: (epoch, first)) for rank in range(world)]
    out = []
    for sampler in samplers:
        out.append([(first + k, b, sampler.computes(first + k)) for k, b in enumerate(sampler)])
    return samplers, out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(24, 200), batch=st.integers(1, 8), world=st.integers(2, 5), slots=st.integers(1, 6),
       data=st.data())
def test_an_epoch_deals_every_batch_of_the_permutation_once(n, batch, world, slots, data):
    if n < batch * world:
        return
    counts = data.draw(st.lists(st.integers(1, slots), min_size=world, max_size=world))
    first = data.draw(st.integers(0, 3 * slots))
    samplers, dealt = _deal(n, batch, world, slots, counts, first=first, drop_last=data.draw(st.booleans()))
    computed = sorted(i for rank in dealt for _, b, computes in rank if computes for i in b)
    expect = sorted(i for b in samplers[0].batches(0) for i in b)
    assert computed == expect                                 # every batch of the stream, once
    assert len({len(rank) for rank in dealt}) == 1            # every rank ends the epoch on the same slot
    for slot, _, _ in dealt[0]:                               # a slot's batches go to its takers, in rank order
        got = [rank for rank in range(world) if dealt[rank][slot - first][2]]
        assert got == samplers[0].takers(slot)[:len(got)]


def test_a_slow_replica_gets_fewer_batches_and_the_epoch_ends_mid_slot():
    samplers, dealt = _deal(104, 8, 3, 3, [3, 1, 3])
    # 13 batches: slot 0 all three, slots 1 and 2 ranks 0 and 2, slot 3 all, slot 4 ranks 0 and 2,
    # slot 5 rank 0 only (the last batch)
    assert [[s for s, _, c in rank if c] for rank in dealt] == [[0, 1, 2, 3, 4, 5], [0, 3], [0, 1, 2, 3, 4]]
    assert samplers[0].round_counts(0) == [3, 1, 3] and samplers[0].round_counts(1) == [3, 1, 2]
    assert all(len(b) == 1 for s, b, c in dealt[1] if not c)   # a skipped slot draws a one-sample placeholder


def test_epochs_are_fresh_permutations_and_the_deal_is_the_same_on_every_rank():
    a, _ = _deal(64, 8, 2, 2, [2, 2], epoch=0)
    b, _ = _deal(64, 8, 2, 2, [2, 2], epoch=1)
    assert a[0].batches(0) == a[1].batches(0) != b[0].batches(1)
    assert sorted(sum(a[0].batches(0), [])) == list(range(64))


def test_the_deal_of_a_round_in_progress_survives_a_checkpoint():
    samplers, _ = _deal(96, 8, 3, 3, [3, 1, 3])
    state = samplers[0].state_dict(5)                         # slots 3, 4 of round 1 run
    assert state == {"dealt": [[3, [0, 1, 2]], [4, [0, 2]]]}
    fresh = DealtBatches(96, 8, True, True, 7, 3, 0, 3, lambda r: [3, 1, 3], lambda: (1, 5))
    fresh.load_state_dict(state)
    next(iter(fresh))                                         # slot 5 dealt in the next epoch
    assert fresh.round_counts(1) == [3, 1, 3]


def test_the_counts_of_a_round_not_yet_decided_are_refused():
    timed = TimedRounds(4, 3, 0)
    assert timed.counts_for(0) == [4, 4, 4]
    with pytest.raises(RuntimeError, match="reads too far ahead"):
        timed.counts_for(1)


def test_what_cannot_be_dealt_is_refused_naming_the_key():
    data = TensorDataset(torch.arange(64.0))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    dealt = dealt_loader(DataLoader(data, batch_size=8, sampler=sampler), 2, 0, 4, lambda r: [4, 4], lambda: (0, 0))
    assert isinstance(dealt.batch_sampler, DealtBatches)
    with pytest.raises(ValueError, match="time_samples=share.*num_workers=2"):
        dealt_loader(DataLoader(data, batch_size=8, sampler=sampler, num_workers=2), 2, 0, 4, list, lambda: (0, 0))
    with pytest.raises(ValueError, match="time_samples=share.*distributed sampler"):
        dealt_loader(DataLoader(data, batch_size=8), 2, 0, 4, list, lambda: (0, 0))
    with pytest.raises(ValueError, match="do not make one batch"):
        DealtBatches(10, 8, True, True, 0, 2, 0, 4, list, lambda: (0, 0))
    with pytest.raises(ValueError, match="time_samples: the checkpoint's rounds ran with time_samples=drop"):
        check_resumed({"timed": {}}, "share")
    with pytest.raises(ValueError, match="resume with time_samples=share"):
        check_resumed({"dealt": {"dealt": []}}, "drop")


def test_a_per_step_learning_rate_schedule_is_refused_with_shared_samples():
    check_schedulers(["epoch"])
    check_schedulers([])
    with pytest.raises(ValueError, match="time_samples=share.*interval='step'.*recipe.schedule=constant"):
        check_schedulers(["epoch", "step"])
