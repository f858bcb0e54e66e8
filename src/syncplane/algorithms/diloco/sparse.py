"""SparseLoCo (arXiv 2508.15706) on DiLoCo's pseudo-gradient: the algorithm's side.

Each rank keeps an error-feedback accumulator ``e`` over the model's flat parameters and
per round, with its pseudo-gradient ``Δ``:

    e ← β·e + Δ;   send p = Q(TopK_chunked(e));   e ← e − decode(p)

(``ChunkedTopK``: 1-3 % of each chunk at 2 bits). The round's update is the plain mean of
every rank's decoded piece, ``θ_g ← θ_g − α·mean_r(Δ̂_r)`` (``outer='sparseloco'``: SGD
without momentum; the decayed accumulator is the momentum). The pieces are *gathered* and
summed by each rank in rank order (``mean_of``), never summed on the way: a sum of top-k
vectors is denser than each, so a reduce-scatter or a tree would have to re-encode it.
The transport is injected (``all_gather``: this rank's payload in, every rank's out in rank
order, or None when the exchange was discarded), so the round is testable without
processes. In training the gather is ``syncplane.exchanges.GatherExchange`` run by the
StreamRunner (``exchange: gather``), which keeps the same accumulator per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.comm.codecs import ChunkedTopK, ErrorFeedback, check_sparse_options

#: ``all_gather(payload)``: every rank's payload in rank order, or None (discarded round).
AllGather = Callable[[torch.Tensor], Sequence[torch.Tensor] | None]


def check_compression(density: float, bits: int, chunk: int, beta: float) -> None:
    """SparseLoCo's settings, with errors that name the key (before launch; checked whatever
    the compression: a bad value is a typo)."""
    check_sparse_options(density, bits, chunk)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"error_feedback_beta: must be in [0, 1] (SparseLoCo: 0.95), got {beta!r}")


class SparseFeedback:
    """One rank's error feedback with the sparse codec over ``numel`` values (module doc).

    ``state_dict`` holds plain tensors (``torch.load(weights_only=True)``), and a restored
    accumulator continues bit for bit.
    """

    def __init__(self, codec: ChunkedTopK, numel: int, beta: float = 0.95) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback(codec, numel, beta)

    @property
    def accumulator(self) -> torch.Tensor:
        return self.feedback.residual

    def compress(self, delta: torch.Tensor) -> torch.Tensor:
        """``e ← β·e + Δ``, the payload of ``e``'s top-k, and ``e ← e − decoded``."""
        return self.feedback.compress(delta)

    def snapshot(self) -> torch.Tensor:
        """A copy of the accumulator, to put back if the round is discarded."""
        return self.feedback.snapshot()

    def restore(self, saved: torch.Tensor) -> None:
        self.feedback.restore(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.feedback.load_state_dict(state)


def mean_of(codec: ChunkedTopK, payloads: Sequence[torch.Tensor], numel: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the decoded pieces: summed into zeros in the order given (rank order),
    then divided once -- the same bits on every rank that holds the same pieces."""
    if not payloads:
        raise ValueError("mean_of: no payloads")
    device = payloads[0].device
    out = torch.zeros(numel, dtype=torch.float32, device=device) if out is None else out.zero_()
    codec.decode_add(list(payloads), out)
    return out.div_(len(payloads))


class SparseLoCoRound:
    """SparseLoCo's round on one rank: ``Δ = θ_g − θ_local``, the error-fed sparse payload,
    the gather, the mean of the pieces, the outer step.

    Args:
        outer: the global parameters and their optimizer (``rule='sparseloco'`` for the
            paper's rule; a Nesterov outer optimizer also works, on the same mean).
        codec: the sparse codec.
        beta: the accumulator's decay β.
        all_gather: the transport (module doc).
    """

    def __init__(self, outer: OuterOptimizer, codec: ChunkedTopK, beta: float, all_gather: AllGather) -> None:
        self.outer = outer
        self.codec = codec
        self.feedback = SparseFeedback(codec, outer.params.numel(), beta)
        self.all_gather = all_gather

    def round_(self, local: torch.Tensor) -> bool:
        """One round: ``local`` (θ_local, flat) is overwritten by the new ``θ_g`` when the
        gather committed (True); on a discarded gather the accumulator is put back as it
        was, so the next round sends this round's movement again (False)."""
        numel = self.outer.params.numel()
        saved = self.feedback.snapshot()
        payload = self.feedback.compress(self.outer.pseudo_gradient(local))
        pieces = self.all_gather(payload)
        if pieces is None:
            self.feedback.restore(saved)
            return False
        self.outer.step(mean_of(self.codec, pieces, numel))
        local.reshape(-1).copy_(self.outer.params)
        return True

    def state_dict(self) -> dict[str, object]:
        return {"outer": self.outer.state_dict(), "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.outer.load_state_dict(state["outer"])          # type: ignore[arg-type]
        self.feedback.load_state_dict(state["feedback"])    # type: ignore[arg-type]
