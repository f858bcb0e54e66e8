"""DiLoCo's round logic on the in-process fake transport (``tests/helpers/fake_transport.py``):
n ranks' ``DiLoCoEngine`` in threads, real tensor math, against a dense single-process
reference of DiLoCo written here (fresh random inputs every run).

- H = 1, outer SGD lr 1, no momentum: the replicas' mean, weighted by their rank count
  (one-rank nodes, and DDP nodes of 2 + 1 + 2 ranks whose outer state is sharded).
- The engine's schedule (``starting``/``launch``/``pop_due``/``merge``) is Streaming DiLoCo
  over fragments at their offsets, overlapped rounds α-mixed τ steps later, Nesterov outer
  steps per fragment; with P = 1, τ = 0 the overlapped path (background, merged at once) is
  the blocking round bit for bit.
- Codecs: int8 on the mesh (each owner's segment encoded, the owner's mean encoded again with
  a residual of its own) and the sparse codec on the gather (encoded once) carry each
  fragment's residuals at their own positions into the next round; a discarded round keeps
  θ_local and the residuals.
- One-rank nodes are ``replica=rank`` (the layout's per-rank path): one shard, the whole model.
- A resume from ``state_dict``/``rank_state_dict`` mid-run continues bit for bit.

What crosses the wire stays on real gloo ranks (``tests/dist/test_diloco*.py``).
"""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.engine import DiLoCoEngine, local_tensors
from syncplane.algorithms.diloco.layout import ReplicaLayout
from syncplane.algorithms.diloco.outer import rule_kwargs
from syncplane.algorithms.diloco.streaming import fragment_bounds, fragment_offsets
from syncplane.comm import CommMeter
from syncplane.comm.streams import shard_bounds
from syncplane.job import JobContext
from tests.helpers.fake_transport import run_ranks

SHAPES = [(5, 3), (7,)]        # 22 parameter values
BUFFER = 3                     # a floating buffer of 3 values (averaged as values, never outer-stepped)
PLAIN = {"outer_optimizer": "torch.optim.SGD", "outer_kwargs": {"lr": 1.0, "momentum": 0.0}}
NESTEROV = {"outer_kwargs": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}


def _module(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    for i, shape in enumerate(SHAPES):
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(*shape, generator=g)))
    module.register_buffer("stat", torch.randn(BUFFER, generator=g))
    return module


def _noise(seed: int, replica: int, step: int, numel: int) -> torch.Tensor:
    """A replica's inner progress at a step (every rank of a node takes its node's, as DDP would)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1009 + replica * 97 + step)) * 0.1


def _drive(transport, rank: int, world: int, sizes: list[int], kwargs: dict, seed: int, steps: int,
           resume_at: int | None = None, background: bool | None = None):
    """The strategy's schedule over ``steps`` steps; ``resume_at``: the engine rebuilt from its
    state there. ``background``: launch τ = 0 rounds in the background (default: blocking)."""
    config = DiLoCoConfig(replica="rank" if max(sizes) == 1 else "node", **{"exchange": "mesh", **kwargs})
    layout, job = ReplicaLayout.of_sizes(sizes), JobContext(rank=rank, world_size=world)
    replica = layout.replica_of(rank)

    def build(module):
        return DiLoCoEngine(module, config, job, layout, transport=transport)

    engine = build(_module(seed))
    tensors = local_tensors(engine.module)
    for done in range(1, steps + 1):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat += _noise(seed, replica, done, flat.numel())
        torch.nn.utils.vector_to_parameters(flat, tensors)
        for fragment in engine.starting(done):
            if config.overlap_steps == 0 and not background:
                engine.launch(tensors, fragment, done, False, CommMeter())
                engine.merge(tensors, engine.pop(fragment), config.alpha)
            else:
                engine.launch(tensors, fragment, done + config.overlap_steps, True, CommMeter())
        for round_ in engine.pop_due(done):
            engine.merge(tensors, round_, config.alpha)
        if done == resume_at:
            engine.wait()
            state, mine = engine.state_dict(), engine.rank_state_dict()
            engine.close()
            module = _module(seed + 1)   # other values: the state must bring everything back
            for t, saved in zip(local_tensors(module), tensors):
                t.copy_(saved)
            engine = build(module)
            engine.load_state_dict(state)
            engine.load_rank_state_dict(mine)
            tensors = local_tensors(engine.module)
    engine.close()
    return torch.cat([t.reshape(-1) for t in tensors]), engine.params, list(engine.owned)


def _reference(sizes: list[int], kwargs: dict, seed: int, steps: int, fail: set[tuple[int, int]] = frozenset()):
    """Streaming DiLoCo by hand on the replicas' flat models (module doc): each replica's model
    after ``steps`` steps. ``fail``: (fragment, round) pairs discarded everywhere."""
    config = DiLoCoConfig(**{k: v for k, v in kwargs.items() if k != "exchange"})
    start = torch.cat([t.reshape(-1) for t in local_tensors(_module(seed))])
    n_params, numel = start.numel() - BUFFER, start.numel()
    bounds = fragment_bounds(n_params, BUFFER, config.fragments)
    offsets = fragment_offsets(config.sync_every, config.fragments)
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    models = [start.clone() for _ in sizes]
    outer = start.clone()
    optimizers = []
    for a, b in bounds:
        piece = torch.nn.Parameter(outer[a:min(b, n_params)].clone())
        optimizers.append((piece, torch.optim.SGD([piece], **rule_kwargs(config.outer, config.outer_optimizer,
                                                                config.outer_kwargs))))
    codec = config.codec() if config.compression != "none" else None
    mesh = kwargs.get("exchange", "mesh") == "mesh"
    residual = [torch.zeros(numel) for _ in sizes]
    owned = torch.zeros(numel)      # the mesh's owners' residuals (each owns its segments)
    exact_from = n_params if config.compression == "sparse" else numel
    pending: dict[int, tuple[int, torch.Tensor]] = {}
    rounds = [0] * config.fragments
    for done in range(1, steps + 1):
        for r in range(len(sizes)):
            models[r] += _noise(seed, r, done, numel)
        for f, (a, b) in enumerate(bounds):
            if (done - offsets[f]) % config.sync_every:
                continue
            piece, optimizer = optimizers[f]
            m = min(b, n_params)
            sent, before = [], ([e.clone() for e in residual], owned.clone())
            # the mesh encodes each owner's segment on its own, the gather the whole slice
            cuts = [(a + lo, a + hi) for lo, hi in shard_bounds(b - a, len(sizes))] if mesh else [(a, b)]
            for r, model in enumerate(models):
                x = model[a:b].clone()
                x[:m - a] = piece.detach() - x[:m - a]
                x *= len(sizes) * float(weights[r])
                for lo, hi in cuts:
                    hi = min(hi, exact_from)
                    if codec is not None and hi > lo:
                        x[lo - a:hi - a] = _encoded(codec, residual[r][lo:hi], x[lo - a:hi - a], config.error_feedback)
                sent.append(x)
            failed = (f, rounds[f]) in fail
            rounds[f] += 1
            if failed:   # the residuals go back to before the round
                residual, owned = before
                continue
            mean = sum(sent) / len(sizes)
            for lo, hi in cuts if mesh and codec is not None else []:   # the owner encodes its mean again
                mean[lo - a:hi - a] = _encoded(codec, owned[lo:hi], mean[lo - a:hi - a], config.error_feedback)
            piece.grad = mean[:m - a].clone()
            optimizer.step()
            mean[:m - a] = piece.detach()
            pending[f] = (done + config.overlap_steps, mean)
        for f in sorted(pending):
            due, mean = pending[f]
            if due <= done:
                a, b = bounds[f]
                for model in models:
                    model[a:b] = config.alpha * model[a:b] + (1 - config.alpha) * mean
                del pending[f]
    return models


def _encoded(codec, e: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    """What error feedback sends of ``x`` with residual ``e`` (updated in place): β·e + x, coded."""
    e.mul_(beta).add_(x)
    sent = codec.extract(codec.compress(e), e.numel())
    e.sub_(sent)
    return sent


def _check(results, sizes, reference, atol=1e-5):
    replica = ReplicaLayout.of_sizes(sizes).replica_of
    for rank, (model, _, _) in enumerate(results):
        torch.testing.assert_close(model, reference[replica(rank)], rtol=atol, atol=atol)


@pytest.mark.parametrize("sizes", [[1, 1, 1], [2, 1, 2]], ids=str)
def test_h1_plain_outer_sgd_is_the_rank_weighted_mean(sizes):
    seed = int(torch.randint(0, 2**20, ()))
    kwargs = {"sync_every": 1, **PLAIN}
    results = run_ranks(_drive, sum(sizes), sizes, dict(kwargs), seed, 3)
    start = torch.cat([t.reshape(-1) for t in local_tensors(_module(seed))])
    # by hand: every round the models are the rank-weighted mean of the replicas' moved models
    expected = start.clone()
    for step in range(1, 4):
        expected = sum(n * (expected + _noise(seed, r, step, expected.numel())) for r, n in enumerate(sizes)) / sum(sizes)
    for model, _, _ in results:
        torch.testing.assert_close(model, expected, rtol=1e-6, atol=1e-6)
    if sizes == [2, 1, 2]:   # the outer state sharded: the lone rank of the small node owns both shards
        assert [owned for _, _, owned in results] == [[0], [1], [0, 1], [0], [1]]


CASES = {
    "nesterov": {"sync_every": 2, **NESTEROV},
    "P3-tau0": {"sync_every": 6, "fragments": 3, **NESTEROV},
    "P2-tau1": {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "mix_alpha": 0.5, **NESTEROV},
    "tau0-mixed": {"sync_every": 2, "mix_alpha": 0.3, **NESTEROV},     # α mixes blocking rounds as well
    "sparseloco-dense": {"sync_every": 2, "outer": "sparseloco"},     # SGD lr 1 on dense Δ: the replicas' mean
    "int8-P2": {"sync_every": 4, "fragments": 2, "compression": "int8", "block_size": 4, **NESTEROV},
    "sparse": {"sync_every": 2, "compression": "sparse", "density": 0.25, "bits": 4, "chunk": 8,
               "exchange": "gather", "outer": "sparseloco"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_replicas_run_streaming_diloco_with_codecs_as_the_dense_reference(case):
    seed, sizes = int(torch.randint(0, 2**20, ())), [1, 1, 1]
    results = run_ranks(_drive, 3, sizes, dict(CASES[case]), seed, 12)
    _check(results, sizes, _reference(sizes, CASES[case], seed, 12))
    assert all(torch.equal(results[0][1], params) for _, params, _ in results)   # one θ_g everywhere


@pytest.mark.parametrize("case", ["nesterov", "P2-tau1", "tau0-mixed"])
def test_ddp_nodes_of_uneven_size_run_the_schedule_of_rank_weighted_replicas(case):
    seed, sizes = int(torch.randint(0, 2**20, ())), [2, 1, 2]
    results = run_ranks(_drive, 5, sizes, dict(CASES[case]), seed, 12)
    _check(results, sizes, _reference(sizes, CASES[case], seed, 12))


def test_fragments1_overlap0_is_the_blocking_round_bit_for_bit():
    seed, kwargs = int(torch.randint(0, 2**20, ())), {"sync_every": 3, "compression": "int8", **NESTEROV}
    blocking = run_ranks(_drive, 3, [1, 1, 1], dict(kwargs), seed, 9)
    overlapped = run_ranks(_drive, 3, [1, 1, 1], dict(kwargs), seed, 9, None, True)
    for (a, ga, _), (b, gb, _) in zip(blocking, overlapped):
        assert torch.equal(a, b) and torch.equal(ga, gb)


def test_a_discarded_round_keeps_the_replicas_and_the_residuals():
    seed, kwargs = int(torch.randint(0, 2**20, ())), CASES["int8-P2"]

    def failing(transport, rank, world, *args):
        transport.wire.fail = lambda members, round_: round_ == 1   # the second exchange: fragment 0's first (1 starts at step 2)
        return _drive(transport, rank, world, *args)

    results = run_ranks(failing, 3, [1, 1, 1], dict(kwargs), seed, 12)
    _check(results, [1, 1, 1], _reference([1, 1, 1], kwargs, seed, 12, fail={(0, 0)}))
    clean = _reference([1, 1, 1], kwargs, seed, 12)
    assert not torch.allclose(results[0][0], clean[0], atol=1e-4)


@pytest.mark.parametrize("sizes", [[1, 1, 1], [2, 1, 2]], ids=str)
def test_a_resume_mid_run_is_bit_identical(sizes):
    seed, kwargs = int(torch.randint(0, 2**20, ())), CASES["int8-P2"]
    straight = run_ranks(_drive, sum(sizes), sizes, dict(kwargs), seed, 12)
    resumed = run_ranks(_drive, sum(sizes), sizes, dict(kwargs), seed, 12, 6)
    for (a, ga, _), (b, gb, _) in zip(straight, resumed):
        assert torch.equal(a, b) and torch.equal(ga, gb)


@pytest.mark.parametrize("sizes", [[2, 1, 2], [3, 2], [4, 4], [1, 3, 2]], ids=str)
def test_fsdp_units_give_every_value_one_holder_per_node_at_its_fsdp_rows(sizes):
    """``ReplicaLayout.fsdp_units``: every value of the whole model sits in one span of one set on
    exactly one rank of each node, the rank whose FSDP2 row chunk (``torch.chunk``) holds it,
    at that rank's local position; the floating buffers ride with every shard group."""
    layout, shapes, buffers = ReplicaLayout.of_sizes(sizes, "fsdp"), [(5, 3), (7,), (1, 4), (2, 2)], 3
    whole = sum(torch.Size(s).numel() for s in shapes)
    ids = torch.arange(whole, dtype=torch.float32)
    params = [t.reshape(s) for t, s in zip(ids.split([torch.Size(s).numel() for s in shapes]), shapes)]
    seen = {n: torch.zeros(whole, dtype=torch.long) for n in range(len(sizes))}
    sets, groups = None, [layout.shard_group(k) for k in range(layout.shards)]
    for rank in range(sum(sizes)):
        node = layout.replica_of(rank)
        j, size = layout.nodes[node].index(rank), sizes[node]
        mine = torch.cat([p.chunk(size)[j].reshape(-1) if j < len(p.chunk(size)) else p[:0].reshape(-1)
                          for p in params] + [torch.full((buffers,), -1.0)])
        got, spans = layout.fsdp_units(rank, shapes, buffers)
        assert sets is None or got == sets   # every rank: the same sets
        sets = got
        for k, runs in spans.items():
            assert sets[k][node] == rank
            for lo, hi, at in runs:
                if at >= whole:
                    assert torch.equal(mine[lo:hi], torch.full((hi - lo,), -1.0)) and sets[k] in groups
                    continue
                assert torch.equal(mine[lo:hi], ids[at:at + hi - lo])   # its own rows, where it keeps them
                seen[node][at:at + hi - lo] += 1
    assert all(torch.equal(count, torch.ones(whole, dtype=torch.long)) for count in seen.values())
