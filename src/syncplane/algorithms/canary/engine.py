"""Canary's piece-level gradient exchange (paper 004, §4.3.3 and the mesh algorithm of §4.4).

Each colayer (a group of gradients, in backward order) is cut into n pieces for n ranks;
piece j of every rank goes, compressed, to rank j; rank j decodes the n contributions,
sums them in rank order, averages, re-encodes the reduced piece and sends it to every
rank. Error feedback on both compressions: each rank keeps what its own pieces lost, each
owner what its re-encoded piece lost (residuals per position of the whole gradient, so
every colayer keeps its own). All of that is the transport's piece layout
(``syncplane.comm.ShardedAllReduce(layout="pieces")``: piece j travels on the gloo group
of NIC ``j mod k``); the engine owns the colayers, their positions and their residuals.

Lightning-free, and the transport is injected, so tests run it on any exchange that has
``allreduce_mean_(flat, meter, offset=, total=)``, ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from syncplane.comm import CommMeter
from syncplane.config import ConfigError

log = logging.getLogger(__name__)


class Transport(Protocol):
    """What the engine needs from the piece-level mesh exchange."""

    def allreduce_mean_(self, flat: torch.Tensor, meter: CommMeter | None = None, *,
                        offset: int = 0, total: int | None = None) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ExchangeFailed(RuntimeError):
    """A colayer's exchange was discarded on every rank (a peer failed or timed out). Canary
    does not step on a local gradient (replicas would drift apart): the step fails."""


class CanaryEngine:
    """Averages colayers of a fixed layout through the piece-level exchange.

    Args:
        colayer_sizes: element count of every colayer, in exchange (backward) order.
        pieces: pieces per colayer (the world size: piece j is owned by rank j).
        transport: the exchange (``ShardedAllReduce(layout="pieces")`` in production).
    """

    def __init__(self, colayer_sizes: Sequence[int], pieces: int, transport: Transport) -> None:
        if pieces < 1:
            raise ConfigError(f"pieces: must be at least 1, got {pieces}")
        # the cube exchange (BCube) cuts a colayer into β pieces per rank
        needed = int(getattr(transport, "beta", 1)) * pieces
        for i, size in enumerate(colayer_sizes):
            if size < needed:
                raise ConfigError(f"pieces: {needed} pieces per colayer exceed colayer {i}'s "
                                  f"{size} elements; give it more parameters (a larger bucket_cap_mb) or use "
                                  f"fewer ranks")
        self.sizes = list(colayer_sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.pieces = pieces
        self.transport = transport
        self.rounds = 0

    def exchange_(self, index: int, flat: torch.Tensor, meter: CommMeter | None = None) -> None:
        """Replace colayer ``index``'s flat fp32 CPU gradient by its mean over all ranks
        (through the compressed pieces); raises ``ExchangeFailed`` if it was discarded."""
        if flat.numel() != self.sizes[index]:
            raise ValueError(f"colayer {index} has {self.sizes[index]} elements, got a buffer of {flat.numel()}")
        if not self.transport.allreduce_mean_(flat, meter, offset=self.offsets[index], total=self.total):
            detail = getattr(self.transport, "last_error", None)
            raise ExchangeFailed(f"canary: the exchange of colayer {index} was discarded on every rank"
                                 + (f" ({detail})" if detail else ""))

    def exchange_all_(self, colayers: Sequence[torch.Tensor], meter: CommMeter | None = None) -> None:
        """Every colayer in order (one step)."""
        if len(colayers) != len(self.sizes):
            raise ValueError(f"expected {len(self.sizes)} colayers, got {len(colayers)}")
        for index, flat in enumerate(colayers):
            self.exchange_(index, flat, meter)
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (per-rank state: each rank saves its own)."""
        return {"sizes": list(self.sizes), "transport": self.transport.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state.get("sizes", self.sizes)) != self.sizes:
            log.warning("canary: the checkpoint's colayers %s differ from this model's %s; "
                        "error-feedback residuals start from zero", state.get("sizes"), self.sizes)
            return
        self.transport.load_state_dict(state.get("transport", {}))


class BackwardPipeline:
    """Exchanges colayers on one worker thread while the backward goes on.

    The glue calls ``ready(i)`` when colayer i's gradients are all produced; colayers are
    handed to the worker strictly in index order (a colayer that completes early waits for
    the ones before it), so every rank runs the same sequence of exchanges whatever the
    timing. ``finish()`` hands over whatever is left (unused parameters never report
    ready) and waits; ``take`` returns colayer i's averaged values.

    Args:
        engine: the exchange (colayer layout, transport).
        pack: colayer index -> its flat fp32 CPU gradient (called on the worker thread).
        meter: where the exchanges are counted.
    """

    def __init__(self, engine: CanaryEngine, pack: Callable[[int], torch.Tensor],
                 meter: CommMeter | None = None) -> None:
        self.engine, self._pack, self._meter = engine, pack, meter
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary")
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._next = 0
        self._futures: list[Future[torch.Tensor]] = []
        self.early = 0   # colayers handed over during the backward (before ``finish``), in total

    def ready(self, index: int) -> None:
        """Colayer ``index`` is complete (thread-safe; autograd may call it from its threads)."""
        with self._lock:
            self._done.add(index)
            self._submit_in_order(stop_at_gap=True)

    def finish(self) -> list[torch.Tensor]:
        """Every colayer's averaged values, in order (submits the rest, then waits)."""
        with self._lock:
            self._submit_in_order(stop_at_gap=False)
            futures, self._futures = self._futures, []
            self._done.clear()
            self._next = 0
        return [f.result() for f in futures]

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _submit_in_order(self, stop_at_gap: bool) -> None:
        while self._next < len(self.engine.sizes) and (self._next in self._done or not stop_at_gap):
            self._futures.append(self._worker.submit(self._exchange, self._next))
            self._next += 1
            self.early += stop_at_gap

    def _exchange(self, index: int) -> torch.Tensor:
        flat = self._pack(index)
        self.engine.exchange_(index, flat, self._meter)
        return flat
