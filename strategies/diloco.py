"""DiLoCo: H local steps of the user's optimizer, then one outer step on the averaged
pseudo-gradient, with the outer state on CPU and the exchange over gloo.

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay the model (parameters, then floating buffers) out in one flat
  fp32 host buffer, create the outer optimizer over the parameters' part (``θ_g`` on
  CPU; one per fragment) and the sharded gloo exchange -- separate gloo groups, so this
  works when the training itself uses NCCL.
- ``after_optimizer_step``: every ``sync_every`` real steps, counted from
  ``trainer.global_step`` (so a resume stays aligned): ``Δ = θ_g − θ_local`` on CPU,
  averaged over all ranks, one outer step, ``θ_g`` copied back into the model; floating
  buffers (BatchNorm statistics) are averaged in the same exchange. If the exchange is
  discarded (a rank failed or timed out), every rank skips the outer step and keeps its
  local replica: the next round's ``Δ`` then covers both rounds, nothing is lost.
  Streaming (``fragments`` P > 1, ``overlap_steps`` τ > 0; ``syncplane.comm.streaming``):
  the same round per fragment at that fragment's offset, its exchange on a background
  thread for τ steps, its result mixed in as ``α·θ_local + (1 − α)·θ_g``.
- ``finish_pending_sync``: completes the exchanges in flight and their outer steps; the
  merges stay at their scheduled step, so a checkpoint or a validation in between does
  not change the trajectory.
- ``sync_state_dict`` / ``load_sync_state_dict``: outer parameters, outer optimizer
  state (per fragment), error-feedback residuals, the rounds waiting to be merged and the
  position within the round, so a resume is bit-identical (the base restores each rank's
  own replica after the initial broadcast).

Host<->device copies run on a side CUDA stream when the model is on a GPU; on CPU the
same calls are plain copies.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Mapping

import torch
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.comm import ShardedAllReduce, make_codec
from syncplane.comm.streaming import FragmentedOuter, Round
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("diloco", description="DiLoCo: H local steps, then an outer Nesterov step on the gloo-averaged "
                                "pseudo-gradient (CPU outer state, sharded multi-stream sync)")
class DiLoCo(SyncplaneStrategy):
    """Args (besides ``SyncplaneStrategy``'s):

    sync_every: H, inner steps per round.
    outer_optimizer: class path of the outer torch optimizer.
    outer_kwargs: its arguments; None = lr 0.7, momentum 0.9, Nesterov (for SGD).
    shards: S concurrent gloo streams for the exchange (bound to the host's NICs in turn).
    compression: ``none`` (exact fp32) or ``int8`` (blockwise scale + error feedback).
    block_size: values per int8 scale.
    sync_timeout_s: an exchange slower than this is discarded on every rank.
    fragments: P, Streaming DiLoCo's fragments, each synced at its own offset in the
        round (1 = plain DiLoCo); at most ``sync_every``. Cut by value count, evenly.
    overlap_steps: τ, inner steps a fragment's exchange runs in the background before its
        result is merged (0 = blocking); below ``sync_every // fragments``, so at most one
        fragment is on the wire at a time.
    mix_alpha: α of the merge ``θ_local ← α·θ_local + (1 − α)·θ_g``; None = 0.5 with
        overlap (the paper's value) and 0 (overwrite) without, which is the only value
        allowed then.
    """

    def __init__(self, sync_every: int = 10, outer_optimizer: str = "torch.optim.SGD",
                 outer_kwargs: dict[str, Any] | None = None, shards: int = 1,
                 compression: Literal["none", "int8"] = "none", block_size: int = 256,
                 sync_timeout_s: float = 600.0, fragments: int = 1, overlap_steps: int = 0,
                 mix_alpha: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        make_codec(compression, block_size)   # validates both
        if sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s must be positive, got {sync_timeout_s}")
        self.sync_every, self.shards, self.sync_timeout_s = sync_every, shards, sync_timeout_s
        self.outer_optimizer, self.outer_kwargs = outer_optimizer, outer_kwargs
        self.compression, self.block_size = compression, block_size
        self.fragments, self.overlap_steps = fragments, overlap_steps
        self.mix_alpha = _check_streaming(sync_every, fragments, overlap_steps, mix_alpha)
        self.rounds = 0     # committed outer steps (one per fragment round)
        self.skipped = 0    # discarded rounds
        self._outer: FragmentedOuter | None = None
        self._exchange: ShardedAllReduce | None = None
        self._stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------ extension points

    @override
    def setup_sync(self) -> None:
        tensors = self.model_tensors()
        n_params = sum(p.numel() for p in self.lightning_module.parameters())
        self._spans, offset = [], 0
        for t in tensors:
            self._spans.append((offset, offset + t.numel()))
            offset += t.numel()
        on_gpu = tensors[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device=tensors[0].device) if on_gpu else None
        self._local = torch.empty(offset, dtype=torch.float32, pin_memory=on_gpu)
        self._to_host(tensors, 0, offset)
        if self._outer is not None:
            self._outer.close()
        self._outer = FragmentedOuter(self._local, n_params, self.fragments, self.sync_every,
                                      self.outer_optimizer, self.outer_kwargs, pin=on_gpu)
        _check_cut_tensors_contiguous(tensors, self._spans, self._outer.bounds)
        if self._exchange is not None:
            self._exchange.close()
        self._exchange = ShardedAllReduce(self.shards, codec=make_codec(self.compression, self.block_size),
                                          timeout_s=self.sync_timeout_s)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        assert self._outer is not None
        done = self.step + 1   # self.step (trainer.global_step) counts the steps before this one
        for fragment in self._outer.starting(done):
            if self.overlap_steps == 0:
                self.outer_sync(fragment)
            else:
                self._launch(fragment, done, background=True)
        for round_ in self._outer.pop_due(done):
            self._merge(round_)

    def outer_sync(self, fragment: int = 0) -> bool:
        """One blocking round of a fragment (the whole model when P = 1): average Δ (and
        the floating buffers), outer step, copy back. True if committed."""
        assert self._outer is not None
        self._launch(fragment, self.step + 1, background=False)
        round_ = self._outer.pop(fragment)
        self._merge(round_)
        return bool(round_.committed)

    @property
    def outer_params(self) -> torch.Tensor:
        """θ_g, the global parameters (a flat copy)."""
        assert self._outer is not None
        return self._outer.params

    @override
    def finish_pending_sync(self) -> None:
        if self._outer is not None:
            self._outer.wait()

    def _launch(self, fragment: int, done: int, background: bool) -> None:
        assert self._outer is not None and self._exchange is not None
        exchange, total = self._exchange, self._local.numel()
        start, end = self._outer.bounds[fragment]
        # self._local = [θ_local | floating buffers]; the fragment's slice is reused in place
        # for its Δ and the result
        self._to_host(self.model_tensors(), start, end)
        self._outer.launch(fragment, lambda flat, offset: exchange.allreduce_mean_(
            flat, self.comm_meter, offset=offset, total=total), due=done + self.overlap_steps, background=background)

    def _merge(self, round_: Round) -> None:
        if not round_.committed:
            self.skipped += 1
            return
        assert self._outer is not None
        self._from_host(self.model_tensors(), *self._outer.bounds[round_.fragment], alpha=self.mix_alpha)
        self.rounds += 1

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        assert self._outer is not None
        assert self._exchange is not None
        return {**self._outer.state_dict(), "exchange": self._exchange.state_dict(),
                "sync_every": self.sync_every, "fragments": self.fragments, "overlap_steps": self.overlap_steps,
                "step_in_round": self.step % self.sync_every, "rounds": self.rounds, "skipped": self.skipped}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        before_streaming = {"fragments": 1, "overlap_steps": 0}   # what older checkpoints imply
        for key in ("sync_every", *before_streaming):
            saved, ours = state.get(key, before_streaming.get(key)), getattr(self, key)
            if saved != ours:
                raise ValueError(f"the checkpoint was written with {key}={saved}, this run has "
                                 f"{key}={ours}: rounds would not line up")
        assert self._outer is not None and self._exchange is not None
        self._outer.load_state_dict(state)
        self._exchange.load_state_dict(state["exchange"])
        self.rounds, self.skipped = int(state["rounds"]), int(state["skipped"])

    @override
    def teardown(self) -> None:
        if self._outer is not None:
            self._outer.close()
        if self._exchange is not None:
            self._exchange.close()   # its state stays readable for a checkpoint after fit
        super().teardown()

    # ------------------------------------------------------------ host <-> device copies

    def _side_stream(self) -> AbstractContextManager[Any]:
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    def _within(self, tensors: list[torch.Tensor], start: int, end: int) -> list[tuple[torch.Tensor, slice]]:
        """``(tensor values, host slice)`` for the part of each tensor inside ``[start, end)``:
        the whole tensor (shaped like it) or, where a fragment cut runs through it, a flat part."""
        parts = []
        for t, (a, b) in zip(tensors, self._spans):
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            whole = (lo, hi) == (a, b)
            parts.append((t if whole else t.view(-1)[lo - a: hi - a], slice(lo, hi)))
        return parts

    def _to_host(self, tensors: list[torch.Tensor], start: int, end: int) -> None:
        with torch.no_grad(), self._side_stream():
            for t, host in self._within(tensors, start, end):
                self._local[host].copy_(t.reshape(-1), non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()    # the CPU reads the host buffer next

    def _from_host(self, tensors: list[torch.Tensor], start: int, end: int, alpha: float = 0.0) -> None:
        """The host buffer's ``[start, end)`` into the model: copied (α = 0) or mixed in as
        ``α·θ_local + (1 − α)·host``."""
        with torch.no_grad(), self._side_stream():
            for t, host in self._within(tensors, start, end):
                values = self._local[host].view_as(t)
                if alpha == 0.0:
                    t.copy_(values, non_blocking=True)
                else:
                    t.mul_(alpha).add_(values.to(t.device, non_blocking=True), alpha=1.0 - alpha)
        if self._stream is not None:  # the next forward must see the new weights
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)


def _check_cut_tensors_contiguous(tensors: list[torch.Tensor], spans: list[tuple[int, int]],
                                  bounds: list[tuple[int, int]]) -> None:
    """A fragment cut through a tensor copies a flat part of it: that needs a flat view."""
    cuts = {start for start, _ in bounds[1:]}
    for i, (t, (a, b)) in enumerate(zip(tensors, spans)):
        if any(a < cut < b for cut in cuts) and not t.is_contiguous():
            raise ValueError(f"a fragment boundary runs through model tensor {i} (shape {tuple(t.shape)}), "
                             "which is not contiguous (channels_last?): use fewer fragments or a contiguous "
                             "memory format")


def _check_streaming(sync_every: int, fragments: int, overlap_steps: int, mix_alpha: float | None) -> float:
    """Validate the streaming options; return the effective α."""
    if not 1 <= fragments <= sync_every:
        raise ValueError(f"fragments must be between 1 and sync_every={sync_every} (one offset per "
                         f"fragment within the round), got {fragments}")
    if not 0 <= overlap_steps < sync_every // fragments:
        raise ValueError(f"overlap_steps must be >= 0 and below sync_every // fragments = "
                         f"{sync_every} // {fragments} = {sync_every // fragments} (a fragment's round "
                         f"must end before the next one starts), got {overlap_steps}")
    if mix_alpha is None:
        return 0.5 if overlap_steps else 0.0
    if not 0.0 <= mix_alpha < 1.0:
        raise ValueError(f"mix_alpha must be in [0, 1) (0 = take the global fragment), got {mix_alpha}")
    if overlap_steps == 0 and mix_alpha != 0.0:
        raise ValueError(f"mix_alpha={mix_alpha} needs overlap_steps >= 1: without overlap the merged "
                         "fragment is the global one (mix_alpha must be 0)")
    return float(mix_alpha)
