"""SparseLoCo's algorithm side: error feedback (formula, checkpoint, bit-identical resume),
the outer rule, a round over an in-process transport, and the settings' errors."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.comm import ChunkedTopK
from syncplane.comm.codecs import ErrorFeedback
from tests.helpers.sparseloco import SparseLoCoRound

CODEC = ChunkedTopK(density=0.03, bits=2, chunk=256)


def deltas(seed: int, rounds: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(rounds)]


def test_error_feedback_follows_sparselocos_formula(test_seed):
    """e ← β·e + Δ; p = Q(TopK(e)); e ← e − decode(p), step by step against plain torch."""
    beta, n = 0.9, 2000
    feedback, e = ErrorFeedback(CODEC, n, beta), torch.zeros(n)
    for delta in deltas(test_seed, 4, n):
        payload = feedback.compress(delta)
        e = e * beta + delta
        assert torch.equal(payload, CODEC.compress(e))
        e = e - CODEC.extract(payload, n)
        assert torch.equal(feedback.residual, e)


def test_error_feedback_keeps_what_was_not_sent(test_seed):
    """β = 1: the sum of what was sent plus the accumulator is the sum of the Δ (up to fp32
    rounding); the accumulator stays bounded instead of growing with the rounds."""
    n = 4096
    feedback, sent, total = ErrorFeedback(CODEC, n, 1.0), torch.zeros(n, dtype=torch.float64), torch.zeros(n)
    for delta in deltas(test_seed, 30, n):
        sent += CODEC.extract(feedback.compress(delta), n).double()
        total += delta
    torch.testing.assert_close((sent + feedback.residual.double()).float(), total, rtol=0, atol=1e-3)


def test_state_saves_plainly_and_resumes_bit_identically(test_seed):
    n = 3000
    rounds = deltas(test_seed, 6, n)
    straight = ErrorFeedback(CODEC, n, 0.95)
    payloads = [straight.compress(d) for d in rounds]
    first = ErrorFeedback(CODEC, n, 0.95)
    for d in rounds[:3]:
        first.compress(d)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = ErrorFeedback(CODEC, n, 0.95)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert [torch.equal(resumed.compress(d), p) for d, p in zip(rounds[3:], payloads[3:])] == [True] * 3
    assert torch.equal(resumed.residual, straight.residual)
    with pytest.raises(ValueError, match="holds 3000 values"):
        ErrorFeedback(CODEC, 10).load_state_dict(first.state_dict())


def test_sparseloco_outer_rule_is_sgd_without_momentum(test_seed):
    g = torch.Generator().manual_seed(test_seed)
    theta, mean = torch.randn(500, generator=g), torch.randn(500, generator=g)
    outer = OuterOptimizer(theta, rule="sparseloco", kwargs={"lr": 0.5}, pin=False)
    for _ in range(2):   # no state carries over: two steps are two plain steps
        expected = outer.params.clone().add_(mean, alpha=-0.5)
        outer.step(mean)
        assert torch.equal(outer.params, expected)
    assert OuterOptimizer(theta, rule="sparseloco", pin=False).optimizer.defaults["lr"] == 1.0
    # the rule is SGD's default outer_kwargs: outer_kwargs override it, another class takes them alone
    assert OuterOptimizer(theta, rule="sparseloco", kwargs={"momentum": 0.9}, pin=False).optimizer.defaults[
        "momentum"] == 0.9
    adamw = OuterOptimizer(theta, "torch.optim.AdamW", {"lr": 0.1}, rule="sparseloco", pin=False).optimizer
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["lr"] == 0.1


class ThreadGather:
    """An in-process transport: one thread per rank; each gets every rank's payload in rank
    order once all have posted (``discard``: every rank gets None, as on a failed exchange)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.discard = False

    def for_rank(self, rank: int):
        def all_gather(payload: torch.Tensor):
            self.slots[rank] = payload.clone()
            self.barrier.wait()
            pieces = None if self.discard else list(self.slots)
            self.barrier.wait()
            return pieces
        return all_gather


def run_ranks(rounds: list[SparseLoCoRound], locals_: list[torch.Tensor]) -> list[bool]:
    results: list[bool] = [False] * len(rounds)

    def run(r: int) -> None:
        results[r] = rounds[r].round_(locals_[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(rounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_round_is_the_mean_of_every_ranks_piece_on_every_rank(test_seed):
    """3 ranks: θ_g ← θ_g − α·mean_r(decode(p_r)), the same bits on each, equal to the dense
    reference of the same pieces; a discarded gather leaves the accumulator as it was."""
    world, n, lr = 3, 2048, 1.0
    g = torch.Generator().manual_seed(test_seed)
    theta = torch.randn(n, generator=g)
    transport = ThreadGather(world)
    rounds = [SparseLoCoRound(OuterOptimizer(theta, rule="sparseloco", pin=False), CODEC, 0.95,
                              transport.for_rank(r)) for r in range(world)]
    for step in range(3):
        locals_ = [rounds[r].outer.params - 0.01 * torch.randn(n, generator=g) for r in range(world)]
        before = [rounds[r].feedback.residual.clone() for r in range(world)]
        transport.discard = step == 1
        results = run_ranks(rounds, locals_)
        if step == 1:
            assert results == [False] * world
            assert all(torch.equal(rounds[r].feedback.residual, before[r]) for r in range(world))
            continue
        assert results == [True] * world
        summed = torch.zeros(n)   # the dense reference of the same compressed pieces, rank order
        for piece in transport.slots:
            assert piece is not None
            summed = summed + CODEC.extract(piece, n)
        expected = theta.clone().add_(summed / world, alpha=-lr)
        assert all(torch.equal(local, expected) for local in locals_)
        theta = expected


def test_round_state_resumes_bit_identically(test_seed):
    n = 1024
    g = torch.Generator().manual_seed(test_seed)
    theta = torch.randn(n, generator=g)
    steps = [theta - 0.01 * torch.randn(n, generator=g) for _ in range(4)]

    def solo(payload: torch.Tensor):
        return [payload]

    straight = SparseLoCoRound(OuterOptimizer(theta, rule="sparseloco", pin=False), CODEC, 0.95, solo)
    resumed = SparseLoCoRound(OuterOptimizer(theta, rule="sparseloco", pin=False), CODEC, 0.95, solo)
    for local in steps[:2]:
        straight.round_(local.clone())
    buffer = io.BytesIO()
    torch.save(straight.state_dict(), buffer)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for local in steps[2:]:
        a, b = local.clone(), local.clone()
        straight.round_(a)
        resumed.round_(b)
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    ({"compression": "sparse", "density": 0.0}, "^density:"),
    ({"compression": "sparse", "density": 1.5}, "^density:"),
    ({"compression": "sparse", "bits": 3}, "^bits:"),
    ({"compression": "sparse", "chunk": 0}, "^chunk:"),
    ({"compression": "sparse", "error_feedback_beta": 1.5}, "^error_feedback_beta:"),
    ({"compression": "sparse", "exchange": "tree"}, "exchange='tree' cannot carry compression='sparse'"),
    ({"compression": "sparse", "exchange": "owner"}, "exchange='owner' cannot carry compression='sparse'"),
    ({"compression": "sparse", "exchange": "mesh"}, "exchange='mesh' cannot carry compression='sparse'.*'gather'"),
    ({"outer": "adam"}, "^outer: allowed values"),
    ({"compression": "int8", "outer_kwargs": {"lr": 1}, "outer": "nesterov", "exchange": "tree"}, "exchange='tree'"),
])
def test_bad_diloco_settings_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(**kwargs)


def test_diloco_defaults_are_unchanged():
    config = DiLoCoConfig()
    assert (config.compression, config.outer) == ("none", "nesterov")
    DiLoCoConfig(compression="int8")   # still accepted


@pytest.mark.parametrize("exchange", ["auto", "gather"])
def test_sparse_rides_the_gather(exchange):
    config = DiLoCoConfig(compression="sparse", outer="sparseloco", exchange=exchange, density=0.03, bits=2)
    assert config.codec() == ChunkedTopK(0.03, 2, 4096)
