"""DiLoCo's per-rank state and its rounds, Lightning-free: the model's fp32 host mirror (its
parameters, then floating buffers, in one flat buffer), the outer optimizer per fragment
(``streaming.FragmentedOuter``) and the exchange of Δ (``exchange.build_exchange``).

A round of fragment f: its slice of the live model is copied to the host (Δ is formed in
place), averaged over the ranks, stepped by the outer optimizer, and -- once committed, at its
due step -- copied back (mixed with ``alpha`` under Streaming DiLoCo). A discarded round
leaves the replica as it was on every rank; the next round's Δ covers both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.exchange import build_exchange, resolve_shards
from syncplane.algorithms.diloco.streaming import FragmentedOuter, Round
from syncplane.comm.host_mirror import HostMirror
from syncplane.comm.meter import CommMeter
from syncplane.job import JobContext


def host_mirror(tensors: Sequence[torch.Tensor]) -> HostMirror:
    """The model's tensors laid out in one flat fp32 host buffer, filled from them (copies on
    a side CUDA stream when the model is on a GPU; plain copies on CPU)."""
    mirror = HostMirror(list(tensors))
    mirror.to_host(list(tensors))
    return mirror


class DiLoCoEngine:
    """A collective to construct (the exchange's stream groups): every rank, same order.

    Args:
        tensors: the model's tensors, parameters first, then floating buffers.
        n_params: how many of their values are parameters (the outer optimizer's part).
        config: the validated settings.
        job: the job's shape (the exchange's tree, NICs, ``shards: auto``).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], n_params: int, config: DiLoCoConfig, job: JobContext) -> None:
        self.config = config
        self.host = host_mirror(tensors)
        self.outer = FragmentedOuter(self.host.buffer, n_params, config.fragments, config.sync_every,
                                     config.outer_optimizer, config.outer_kwargs, pin=self.host.on_gpu,
                                     rule=config.outer)
        self.host.check_cuts(list(tensors), [start for start, _ in self.outer.bounds[1:]])
        # build_exchange logs the pattern it chose (and why) on rank 0
        self.shards = resolve_shards(config.shards, job, config.topology, config.exchange, config.compression)
        # sparse: only the parameters' Δ is top-k'd; the floating buffers (averaged as values) go exact
        self.exchange, self.exchange_name = build_exchange(job, self.shards, config.compression, config.block_size,
                                                           config.sync_timeout_s, config.exchange, config.topology,
                                                           codec=config.codec(),
                                                           error_feedback_beta=config.error_feedback,
                                                           exact_from=n_params)

    def launch(self, tensors: Sequence[torch.Tensor], fragment: int, due: int, background: bool,
               meter: CommMeter, scale: float = 1.0) -> None:
        """Start fragment ``fragment``'s round from the live model (merged at step ``due``).
        ``scale``: this rank's factor on its Δ (and floating buffers) before the mean, so that
        the mean is a weighted one (``adaptive.weight_scale``; 1.0: the plain mean)."""
        exchange, total = self.exchange, self.host.buffer.numel()
        start, end = self.outer.bounds[fragment]
        # the fragment's slice of the host buffer is reused in place for its Δ and the result
        self.host.to_host(list(tensors), start, end)

        def average_(flat: torch.Tensor, offset: int) -> bool:
            if scale != 1.0:
                flat.mul_(scale)
            return exchange.allreduce_mean_(flat, meter, offset=offset, total=total)

        self.outer.launch(fragment, average_, due=due, background=background)

    def merge(self, tensors: Sequence[torch.Tensor], round_: Round, alpha: float) -> bool:
        """A finished round into the live model (nothing when it was discarded); True if applied."""
        if not round_.committed:
            return False
        self.host.from_host(list(tensors), *self.outer.bounds[round_.fragment], alpha=alpha)
        return True

    def outer_state_bytes(self) -> int:
        """θ_g, the outer optimizer's state and Δ (the host mirror) on this rank."""
        return sum(o.state_bytes() for o in self.outer.outers) + self.host.buffer.numel() * 4

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (int8 and sparse; empty for fp32)."""
        return {"exchange": self.exchange.state_dict()}

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        self.exchange.load_state_dict(state.get("exchange", {}))

    def close(self) -> None:
        """Stop the outer's background work and the exchange (its state stays readable)."""
        self.outer.close()
        self.exchange.close()
