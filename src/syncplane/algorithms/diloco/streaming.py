"""Streaming DiLoCo's fragments (Douillard et al. 2025): θ_g in P pieces, synced in turn.

Fragment p's round is at the steps where ``(steps_done − p·H // P) mod H = 0``: each fragment is
still synced once per H steps, but only ~1/P of the model is on the wire at a time. With an
overlap of τ ≥ 1 steps its exchange runs on a background thread and its result is merged τ
steps later as ``θ_local ← α·θ_local + (1 − α)·θ_g`` (the paper's mixing; α = 0 overwrites).

Fragments are cut by value count, evenly, even through a tensor: whole layers would leave one
big layer (a classifier head) keeping the peak high, and the cut is exact for the element-wise
outer optimizers ``OuterOptimizer``'s flat buffer assumes. Floating buffers travel with the
last fragment."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.comm.streams import shard_bounds

#: ``average_(flat_slice, offset)``: the slice's mean over ranks in place; True if committed.
Average = Callable[[torch.Tensor, int], bool]


def fragment_bounds(n_params: int, extra: int, fragments: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each fragment of ``[parameters | extras]``: the parameters cut evenly, the
    ``extra`` values joining the last one."""
    if not 1 <= fragments <= n_params:
        raise ValueError(f"cannot split {n_params} parameter values into {fragments} fragments "
                         f"(fragments must be between 1 and {n_params})")
    bounds = shard_bounds(n_params, fragments)
    bounds[-1] = (bounds[-1][0], n_params + extra)
    return bounds


def fragment_offsets(sync_every: int, fragments: int) -> list[int]:
    """Step offset of each fragment's round within the H-step period, spread evenly."""
    return [p * sync_every // fragments for p in range(fragments)]


def streaming_mix_alpha(sync_every: int, fragments: int, overlap_steps: int, mix_alpha: float | None) -> float:
    """Check the streaming options; return the effective α."""
    if not 1 <= fragments <= sync_every or not 0 <= overlap_steps < sync_every // fragments:
        raise ValueError(f"fragments={fragments}, overlap_steps={overlap_steps}, sync_every={sync_every}: each of "
                         f"the P fragments has its own window of sync_every // fragments steps of the round (at "
                         f"least 1: 1 <= fragments <= sync_every), and its exchange must end before the next "
                         f"fragment's starts: 0 <= overlap_steps < sync_every // fragments")
    if mix_alpha is None:
        return 0.5 if overlap_steps else 0.0
    if not 0.0 <= mix_alpha < 1.0:
        raise ValueError(f"mix_alpha must be in [0, 1) (0 = take the global fragment), got {mix_alpha}")
    return float(mix_alpha)


@dataclass
class Round:
    """A fragment's round from launch until its result is merged into the replica."""

    fragment: int
    due: int                             # steps done when the result is merged
    future: Future[bool] | None = None   # the exchange, while in flight
    committed: bool | None = None        # its outcome, once waited for
    parts: dict[int, bool] | None = None  # a replica's round over several shards: each one's outcome


class FragmentedOuter:
    """θ_g as P fragments of the host buffer ``flat = [θ_local | extras]``, each with its own outer
    optimizer, and the rounds launched but not merged yet; moving tensors between the model and
    ``flat`` is the caller's. One optimizer per fragment, because a fragment's momentum must
    advance only at its own rounds: one optimizer over the buffer, stepped with a zero gradient
    elsewhere, would decay the others' momentum and move their θ_g by it.

    Args:
        flat: fragment p works in place on ``flat[a_p:b_p]`` (θ_local, Δ, its mean, what to merge),
            which nothing else touches from its launch to its merge.
        n_params: how many values of ``flat`` are parameters (the rest are extras).
        optimizer, kwargs, pin, rule: as for ``OuterOptimizer``.
        bounds: each fragment's ``[start, end)`` when not the even cut (a node replica's rank keeps
            only its piece of each)."""

    def __init__(self, flat: torch.Tensor, n_params: int, fragments: int, sync_every: int,
                 optimizer: str, kwargs: Mapping[str, Any] | None, pin: bool, rule: str = "nesterov",
                 bounds: list[tuple[int, int]] | None = None) -> None:
        self.flat, self.sync_every = flat, sync_every
        self.bounds = bounds if bounds is not None else fragment_bounds(n_params, flat.numel() - n_params, fragments)
        self.offsets = fragment_offsets(sync_every, fragments)
        self.outers = [OuterOptimizer(flat[a:max(a, min(b, n_params))], optimizer, kwargs, pin=pin, rule=rule)
                       for a, b in self.bounds]
        self.pending: dict[int, Round] = {}
        self._worker: ThreadPoolExecutor | None = None

    @property
    def params(self) -> torch.Tensor:
        """θ_g (a copy: the fragments' concatenation)."""
        return torch.cat([outer.params for outer in self.outers])

    def starting(self, done: int) -> list[int]:
        """Fragments whose round starts once ``done`` steps are complete."""
        return [p for p, offset in enumerate(self.offsets) if (done - offset) % self.sync_every == 0]

    def launch(self, fragment: int, average_: Average, due: int, background: bool) -> None:
        """Δ of the fragment (its θ_local already in ``flat``) and its average, in the background if asked."""
        if fragment in self.pending:
            raise RuntimeError(f"fragment {fragment}'s previous round has not been merged yet")
        a, b = self.bounds[fragment]
        self.outers[fragment].begin_round_(self.flat[a:b])
        round_ = Round(fragment, due)
        if background:
            if self._worker is None:   # one thread: exchanges run one at a time, in launch order
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncplane-streaming")
            round_.future = self._worker.submit(average_, self.flat[a:b], a)
        else:
            round_.committed = average_(self.flat[a:b], a)
            self._finish(round_)
        self.pending[fragment] = round_

    def wait(self) -> None:
        """Complete the exchanges in flight and their outer steps; the merges stay at their ``due``
        step, so waiting early (a checkpoint, a validation) does not change the trajectory."""
        for round_ in self.pending.values():
            if round_.future is not None:
                round_.committed = round_.future.result()
                round_.future = None
                self._finish(round_)

    def pop(self, fragment: int) -> Round:
        """Wait for and remove the fragment's round; ``flat[a:b]`` holds what to merge."""
        self.wait()
        return self.pending.pop(fragment)

    def pop_due(self, done: int) -> list[Round]:
        """The rounds to merge once ``done`` steps are complete (waited for, removed)."""
        return [self.pop(p) for p in sorted(self.pending) if self.pending[p].due <= done]

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the background thread."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def state_dict(self) -> dict[str, Any]:
        """Every fragment's outer state and the rounds waiting to merge (call ``wait`` first)."""
        if any(r.future is not None for r in self.pending.values()):
            raise RuntimeError("a fragment's exchange is still in flight: wait() before state_dict()")
        pending = [{"fragment": r.fragment, "due": r.due, "committed": bool(r.committed),
                    "merge": self.flat[slice(*self.bounds[r.fragment])].clone()}
                   for r in self.pending.values()]
        return {"outer": [outer.state_dict() for outer in self.outers], "pending": pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        outer = state["outer"]
        outers = [outer] if isinstance(outer, Mapping) else list(outer)   # a plain-DiLoCo checkpoint: one
        if len(outers) != len(self.outers):
            raise ValueError(f"the checkpoint holds {len(outers)} fragments, this run has {len(self.outers)}")
        for mine, saved in zip(self.outers, outers):
            mine.load_state_dict(saved)
        self.pending = {}
        for saved in state.get("pending", []):
            p = int(saved["fragment"])
            self.flat[slice(*self.bounds[p])].copy_(saved["merge"])
            self.pending[p] = Round(p, int(saved["due"]), committed=bool(saved["committed"]))

    def _finish(self, round_: Round) -> None:
        if round_.committed:
            a, b = self.bounds[round_.fragment]
            self.outers[round_.fragment].finish_round_(self.flat[a:b])
