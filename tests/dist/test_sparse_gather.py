"""SparseLoCo's rounds on 3 real gloo ranks: each rank's error-fed sparse payload is
all-gathered as bytes and decode-accumulated in rank order; every rank ends with the same
bits, equal to the dense reference of the same compressed pieces."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed

WORLD, NUMEL, ROUNDS, LR, BETA = 3, 10_007, 3, 0.8, 0.95


def _gloo_all_gather(payload: torch.Tensor) -> list[torch.Tensor]:
    """The transport under test: every rank's payload (same size: a function of the element
    count), in rank order."""
    import torch.distributed as dist

    pieces = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, payload)
    return pieces


def _sparseloco_rank(rank: int, world: int, seed: int):
    from syncplane.algorithms.diloco.outer import OuterOptimizer
    from tests.helpers.sparseloco import SparseLoCoRound
    from syncplane.comm import ChunkedTopK

    codec = ChunkedTopK(density=0.03, bits=2, chunk=1024)
    gathered: list[list[torch.Tensor]] = []

    def all_gather(payload: torch.Tensor) -> list[torch.Tensor]:
        pieces = _gloo_all_gather(payload)
        gathered.append([p.clone() for p in pieces])
        return pieces

    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(NUMEL, generator=g)
    round_ = SparseLoCoRound(OuterOptimizer(theta, rule="sparseloco", kwargs={"lr": LR}, pin=False), codec, BETA,
                             all_gather)
    local_g = torch.Generator().manual_seed(seed + 1 + rank)   # each rank trains on its own data
    params = []
    for _ in range(ROUNDS):
        local = round_.outer.params - 0.01 * torch.randn(NUMEL, generator=local_g) * (rank + 1)
        assert round_.round_(local)
        params.append(local.clone())
    return params, gathered


def test_sparse_pieces_gathered_on_3_ranks_give_the_same_bits_everywhere(test_seed):
    from syncplane.comm import ChunkedTopK

    results = run_distributed(_sparseloco_rank, WORLD, test_seed)
    codec = ChunkedTopK(density=0.03, bits=2, chunk=1024)
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(test_seed))
    for step in range(ROUNDS):
        pieces = results[0][1][step]
        # every rank received the same bytes, its own at its rank
        assert all(all(torch.equal(a, b) for a, b in zip(pieces, r[1][step])) for r in results)
        summed = torch.zeros(NUMEL)   # the dense reference of the same compressed pieces
        for piece in pieces:
            summed = summed + codec.extract(piece, NUMEL)
        theta = theta.add(summed / WORLD, alpha=-LR)
        for rank in range(WORLD):
            assert torch.equal(results[rank][0][step], theta), f"rank {rank}, round {step}"
        assert summed.count_nonzero() > codec.k * (NUMEL // 1024)   # the pieces kept different positions
