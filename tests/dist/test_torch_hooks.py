"""torch's DDP comm hooks (``torch_fp16``, ``torch_powersgd``) on 2 real gloo processes.

- fp16: the reduced gradient equals the float64 reference round_fp16(Σ_r round_fp16(g_r)/n).
- PowerSGD (rank r, error feedback), from its definition: the first two steps (before
  ``start_powerSGD_iter``) are the exact mean; afterwards every matrix's output O has rank
  <= r and is the orthogonal projection of the mean of M_r = g_r + e_r onto O's own column
  space (O = P̂ P̂ᵀ M̄, P̂ = orth(M̄ Q)), with e_r = M_r - O carried to the next step;
  vectors stay exact means.
- Both as ``strategy=`` through Lightning: replicas identical; fp16 stays close to ddp.
"""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.strategies import fit_digits

SEED = 4321
SHAPES = [(16, 12), (9, 5), (7,)]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 100 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _reduce(name: str, rank_r: int, steps: int) -> list[list[torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel

    from syncplane.algorithms.torch_hooks import HookConfig
    from syncplane.algorithms.torch_hooks.bench import _Payload

    config = HookConfig(name=name, matrix_approximation_rank=rank_r, min_compression_rate=1.0)
    model = DistributedDataParallel(_Payload(SHAPES))
    model.register_comm_hook(*config.hook())
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=False)
        model(_grads(torch.distributed.get_rank(), step)).backward()
        out.append([w.grad.clone() for w in model.module.weights])
    return out


def _all(rank: int, world: int, tmp_dir: str):  # type: ignore[no-untyped-def]
    fp16 = _reduce("torch_fp16", 1, 2)
    powersgd = {r: _reduce("torch_powersgd", r, 5) for r in (1, 2)}
    fits = {}
    for name in ("ddp", "torch_fp16", "torch_powersgd"):
        _, model = fit_digits(name, {}, tmp_dir)
        fits[name] = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return fp16, powersgd, fits


def test_torch_hooks_against_their_definitions(tmp_path) -> None:
    print("seed", SEED)
    world = 2
    results = run_distributed(_all, world, str(tmp_path), timeout=300)
    fp16, powersgd, fits = results[0]
    for other in results[1:]:                       # every rank holds the same reduced gradients
        assert all(torch.equal(a, b) for sa, sb in zip(fp16, other[0]) for a, b in zip(sa, sb))
        for r in powersgd:
            assert all(torch.equal(a, b) for sa, sb in zip(powersgd[r], other[1][r]) for a, b in zip(sa, sb))
        for name in fits:
            assert torch.equal(fits[name], other[2][name]), name

    for step, got in enumerate(fp16):
        for i, g in enumerate(got):
            halves = [(_grads(r, step)[i].half() / world).double() for r in range(world)]
            assert torch.equal(g, sum(halves).half().float())

    for r, steps in powersgd.items():
        errors = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
        for step, got in enumerate(steps):
            for i, shape in enumerate(SHAPES):
                m = [_grads(rank, step)[i].double() + errors[rank][i] for rank in range(world)]
                mean = sum(m) / world
                o = got[i].double()
                if len(shape) == 1 or step < 2:     # vectors, and the warm-up (start_powerSGD_iter=2): exact
                    torch.testing.assert_close(o, sum(g[i].double() for g in (_grads(k, step) for k in range(world)))
                                               / world, rtol=1e-5, atol=1e-6)
                    continue
                assert torch.linalg.matrix_rank(o, atol=1e-4) <= r
                basis = torch.linalg.svd(o, full_matrices=False).U[:, :r]
                torch.testing.assert_close(o, basis @ basis.T @ mean, rtol=1e-4, atol=1e-4)
                assert (o - mean).norm() > 1e-3                     # it did compress
                for rank in range(world):
                    errors[rank][i] = m[rank] - o

    # the hooks did run through Lightning (it drops them on CPU unless the strategy registers them)
    assert not torch.equal(fits["torch_fp16"], fits["ddp"])
    torch.testing.assert_close(fits["torch_fp16"], fits["ddp"], rtol=2e-3, atol=2e-3)
    assert not torch.equal(fits["torch_powersgd"], fits["ddp"])
    assert ((fits["torch_powersgd"] - fits["ddp"]).norm() / fits["ddp"].norm()) < 0.2
