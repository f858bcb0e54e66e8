"""DiLoCo: H local steps of the user's optimizer, then one outer step on the averaged
pseudo-gradient, with the outer state on CPU and the exchange over gloo.

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay the model (parameters, then floating buffers) out in one flat
  fp32 host buffer, create the outer optimizer over the parameters' part (``θ_g`` on
  CPU) and the sharded gloo exchange -- separate gloo groups, so this works when the
  training itself uses NCCL.
- ``after_optimizer_step``: every ``sync_every`` real steps, counted from
  ``trainer.global_step`` (so a resume stays aligned): ``Δ = θ_g − θ_local`` on CPU,
  averaged over all ranks, one outer step, ``θ_g`` copied back into the model; floating
  buffers (BatchNorm statistics) are averaged in the same exchange. If the exchange is
  discarded (a rank failed or timed out), every rank skips the outer step and keeps its
  local replica: the next round's ``Δ`` then covers both rounds, nothing is lost.
- ``sync_state_dict`` / ``load_sync_state_dict``: outer parameters, outer optimizer
  state, error-feedback residuals and the position within the round, so a resume is
  bit-identical (the base restores each rank's own replica after the initial broadcast).

Host<->device copies run on a side CUDA stream when the model is on a GPU; on CPU the
same calls are plain copies.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Mapping

import torch
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.comm import OuterOptimizer, ShardedAllReduce, make_codec
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
    """

    def __init__(self, sync_every: int = 10, outer_optimizer: str = "torch.optim.SGD",
                 outer_kwargs: dict[str, Any] | None = None, shards: int = 1,
                 compression: Literal["none", "int8"] = "none", block_size: int = 256,
                 sync_timeout_s: float = 600.0, **kwargs: Any) -> None:
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
        self.rounds = 0     # committed outer steps
        self.skipped = 0    # discarded rounds
        self._outer: OuterOptimizer | None = None
        self._exchange: ShardedAllReduce | None = None
        self._stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------ extension points

    @override
    def setup_sync(self) -> None:
        tensors = self.model_tensors()
        self._n_params = sum(p.numel() for p in self.lightning_module.parameters())
        self._spans, offset = [], 0
        for t in tensors:
            self._spans.append((offset, offset + t.numel()))
            offset += t.numel()
        on_gpu = tensors[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device=tensors[0].device) if on_gpu else None
        self._local = torch.empty(offset, dtype=torch.float32, pin_memory=on_gpu)
        self._to_host(tensors)
        self._outer = OuterOptimizer(self._local[: self._n_params], self.outer_optimizer, self.outer_kwargs,
                                     pin=on_gpu)
        if self._exchange is not None:
            self._exchange.close()
        self._exchange = ShardedAllReduce(self.shards, codec=make_codec(self.compression, self.block_size),
                                          timeout_s=self.sync_timeout_s)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        # self.step (trainer.global_step) counts the steps completed *before* this one
        if (self.step + 1) % self.sync_every == 0:
            self.outer_sync()

    def outer_sync(self) -> bool:
        """One round: average Δ (and the floating buffers), outer step, copy back. True if committed."""
        assert self._outer is not None and self._exchange is not None
        tensors = self.model_tensors()
        self._to_host(tensors)
        # self._local = [θ_local | floating buffers], reused in place for Δ and the result
        if not self._outer.round_(self._local, lambda flat: self._exchange.allreduce_mean_(flat, self.comm_meter)):
            self.skipped += 1
            return False
        self._from_host(tensors)
        self.rounds += 1
        return True

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        assert self._outer is not None
        assert self._exchange is not None
        return {"outer": self._outer.state_dict(), "exchange": self._exchange.state_dict(),
                "sync_every": self.sync_every,
                "step_in_round": self.step % self.sync_every, "rounds": self.rounds, "skipped": self.skipped}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if state["sync_every"] != self.sync_every:
            raise ValueError(f"the checkpoint was written with sync_every={state['sync_every']}, this run has "
                             f"sync_every={self.sync_every}: rounds would not line up")
        assert self._outer is not None and self._exchange is not None
        self._outer.load_state_dict(state["outer"])
        self._exchange.load_state_dict(state["exchange"])
        self.rounds, self.skipped = int(state["rounds"]), int(state["skipped"])

    @override
    def teardown(self) -> None:
        if self._exchange is not None:
            self._exchange.close()   # its state stays readable for a checkpoint after fit
        super().teardown()

    # ------------------------------------------------------------ host <-> device copies

    def _side_stream(self) -> AbstractContextManager[Any]:
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    def _to_host(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad(), self._side_stream():
            for t, (a, b) in zip(tensors, self._spans):
                self._local[a:b].copy_(t.reshape(-1), non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()    # the CPU reads the host buffer next

    def _from_host(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad(), self._side_stream():
            for t, (a, b) in zip(tensors, self._spans):
                t.copy_(self._local[a:b].view_as(t), non_blocking=True)
        if self._stream is not None:  # the next forward must see the new weights
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
