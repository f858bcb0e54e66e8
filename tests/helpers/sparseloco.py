"""SparseLoCo's round on one rank (arXiv 2508.15706) as a reference with an injected transport:
the oracle the training path (``GatherExchange`` run by the StreamRunner, ``exchange: gather``)
is checked against. Per round, with the pseudo-gradient Δ:

    e ← β·e + Δ;   send p = Q(TopK_chunked(e));   e ← e − decode(p)

and ``θ_g ← θ_g − α·mean_r(decode(p_r))``, the pieces summed in rank order (never on the way: a
sum of top-k vectors is dense)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.comm.codecs import ChunkedTopK, ErrorFeedback

#: ``all_gather(payload)``: every rank's payload in rank order, or None (discarded round).
AllGather = Callable[[torch.Tensor], Sequence[torch.Tensor] | None]


class SparseLoCoRound:
    """``outer``: θ_g and its optimizer (``rule='sparseloco'`` for the paper's rule); ``beta``:
    the accumulator's decay; ``all_gather``: the transport."""

    def __init__(self, outer: OuterOptimizer, codec: ChunkedTopK, beta: float, all_gather: AllGather) -> None:
        self.outer, self.codec, self.all_gather = outer, codec, all_gather
        self.feedback = ErrorFeedback(codec, outer.params.numel(), beta)

    def round_(self, local: torch.Tensor) -> bool:
        """``local`` (θ_local, flat) becomes the new θ_g when the gather committed (True); a
        discarded gather puts the accumulator back, so the next round sends this one's movement again."""
        saved = self.feedback.snapshot()
        pieces = self.all_gather(self.feedback.compress(self.outer.pseudo_gradient(local)))
        if pieces is None:
            self.feedback.restore(saved)
            return False
        mean = torch.zeros(self.outer.params.numel(), dtype=torch.float32, device=pieces[0].device)
        self.codec.decode_add(list(pieces), mean)
        self.outer.step(mean.div_(len(pieces)))
        local.reshape(-1).copy_(self.outer.params)
        return True

    def state_dict(self) -> dict[str, object]:
        return {"outer": self.outer.state_dict(), "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.outer.load_state_dict(state["outer"])          # type: ignore[arg-type]
        self.feedback.load_state_dict(state["feedback"])    # type: ignore[arg-type]
