"""One stream of batches dealt to the replicas as they compute (``time_samples: share``).

With ``inner_steps: time`` a slow replica computes on fewer of a round's H slots. ``drop``
keeps the distributed sampler's equal shards (the batches it has no time for are skipped for
the epoch: a uniformly random subset). ``share`` deals one shuffled permutation of the dataset
per epoch instead, each slot handing its next batches to the replicas that compute on it, in
rank order: every sample is seen once per epoch, and an epoch ends sooner with a straggler.

The deal is a pure function of the permutation (seed + epoch, as ``DistributedSampler``), the
epoch's first slot and the rounds' agreed counts: every rank computes it without communication,
and knows the batches each replica processed (the average's weights). Every replica computes on
a round's slot 0, so the loader may read one batch ahead (Lightning's prefetch), never more."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

log = logging.getLogger(__name__)

#: ``time_samples`` values: what happens to the batches a slow replica has no time for.
TIME_SAMPLES = ("share", "drop")


class DealtBatches(Sampler[list[int]]):
    """A batch sampler for one rank: the batches the stream deals it, slot by slot, until the slot
    that deals the stream's last batch. A rank that gets no batch on a slot (it skips it, or the
    stream ran out) gets a one-sample placeholder its training step skips (``computes``). No
    length: an epoch's slots depend on the speeds.

    Args:
        n_samples, batch_size, drop_last, shuffle, seed: the dataset's length; the training loader's.
        world_size, rank, slots: the replicas, this one, and H.
        counts: ``counts(round)`` -> every replica's agreed steps (raises before the decision).
        start: ``start()`` -> (the epoch, the global step it starts at), read when the epoch's first
            batch is drawn (Lightning sets no epoch on a batch sampler)."""

    def __init__(self, n_samples: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int, world_size: int,
                 rank: int, slots: int, counts: Callable[[int], Sequence[int]],
                 start: Callable[[], tuple[int, int]]) -> None:
        if n_samples < batch_size * world_size:
            raise ValueError(f"time_samples=share: the dataset's {n_samples} samples do not make one batch of "
                             f"{batch_size} for each of the {world_size} replicas")
        self.n_samples, self.batch_size, self.drop_last, self.shuffle = n_samples, batch_size, drop_last, shuffle
        self.seed, self.world_size, self.rank, self.slots = seed, world_size, rank, slots
        self._counts, self._start = counts, start
        #: slot -> the ranks that got a batch of the stream on it (kept for two rounds)
        self.dealt: dict[int, tuple[int, ...]] = {}

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's permutation (``randperm`` from ``seed + epoch``) cut into batches."""
        if self.shuffle:
            order = torch.randperm(self.n_samples, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.n_samples))
        stop = self.n_samples - self.n_samples % self.batch_size if self.drop_last else self.n_samples
        return [order[i:i + self.batch_size] for i in range(0, stop, self.batch_size)]

    def takers(self, slot: int) -> list[int]:
        """The ranks that compute on ``slot``, in rank order (all of them on a round's first)."""
        round_, j = divmod(slot, self.slots)
        if j == 0:
            return list(range(self.world_size))
        return [i for i, n in enumerate(self._counts(round_)) if n > j]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, slot = self._start()
        stream = self.batches(epoch)
        at = 0
        while at < len(stream):
            got = tuple(self.takers(slot)[:len(stream) - at])   # the stream may end mid-slot
            self.dealt[slot] = got
            for old in [s for s in self.dealt if s < slot - 2 * self.slots]:
                del self.dealt[old]
            yield stream[at + got.index(self.rank)] if self.rank in got else stream[0][:1]
            at += len(got)
            slot += 1
        log.debug("time_samples=share: epoch %d dealt %d batches, ending at slot %d", epoch, len(stream), slot)

    def computes(self, slot: int) -> bool:
        """Whether this rank got a batch of the stream on ``slot`` (else its step is skipped)."""
        return self.rank in self.dealt[slot]

    def round_counts(self, round_: int) -> list[int]:
        """Every replica's batches in round ``round_`` (all its slots dealt): the average's weights."""
        takers = [i for slot in range(round_ * self.slots, (round_ + 1) * self.slots) for i in self.dealt[slot]]
        return [takers.count(i) for i in range(self.world_size)]

    def state_dict(self, step: int) -> dict[str, Any]:
        """At global step ``step`` (the next slot to run): the deal of the round's slots already run,
        the weights of the round in progress. Nothing else is needed: a resume starts an epoch
        (syncplane checkpoints at epoch ends and when training stops, and Lightning resumes a
        stopped run at the next epoch), whose stream is dealt from its start."""
        first = step - step % self.slots
        return {"dealt": [[s, list(self.dealt[s])] for s in range(first, step)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.dealt = {int(s): tuple(int(i) for i in got) for s, got in state["dealt"]}


def dealt_loader(loader: Any, world_size: int, rank: int, slots: int, counts: Callable[[int], Sequence[int]],
                 start: Callable[[], tuple[int, int]]) -> Any:
    """The training ``loader`` (Lightning's: a ``DataLoader`` with a ``DistributedSampler``) on ``DealtBatches``."""
    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, DistributedSampler):
        raise ValueError(f"time_samples=share deals the training set's batches itself and needs a DataLoader over "
                         f"a map-style dataset with Lightning's distributed sampler (use_distributed_sampler=True); "
                         f"got {type(loader).__name__} with sampler "
                         f"{type(getattr(loader, 'sampler', None)).__name__}: use time_samples=drop")
    if loader.num_workers > 0:
        raise ValueError(f"time_samples=share deals each slot's batches once the round's step counts are agreed, "
                         f"and a loader with num_workers={loader.num_workers} reads batches further ahead: use "
                         f"num_workers=0 or time_samples=drop")
    if loader.batch_size is None:
        raise ValueError("time_samples=share needs the loader's batch_size (a custom batch_sampler cannot be dealt): "
                         "use time_samples=drop")
    sampler = loader.sampler
    dealt = DealtBatches(len(loader.dataset), loader.batch_size, loader.drop_last, sampler.shuffle, sampler.seed,
                         world_size, rank, slots, counts, start)
    return DataLoader(loader.dataset, batch_sampler=dealt, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory)


def check_resumed(state: Mapping[str, Any], time_samples: str) -> None:
    """A checkpoint's rounds must have dealt their batches as this run does: a round in progress is
    weighted by the batches dealt in it, which a ``drop`` checkpoint does not hold."""
    saved = "share" if "dealt" in state else "drop"
    if saved != time_samples:
        raise ValueError(f"time_samples: the checkpoint's rounds ran with time_samples={saved}, this job asks for "
                         f"{time_samples}: resume with time_samples={saved}")


def check_schedulers(intervals: Sequence[str]) -> None:
    """Refuse a per-step learning-rate schedule: sized from Lightning's estimated steps (the loader has
    no length), it would be wrong without a word."""
    if "step" in intervals:
        raise ValueError("time_samples=share: an epoch's number of steps depends on the replicas' speeds, so a "
                         "learning-rate scheduler stepped every step (interval='step', sized from the run's "
                         "estimated steps) cannot be sized; use a constant or epoch-interval schedule (e.g. "
                         "recipe.schedule=constant) or time_samples=drop")
