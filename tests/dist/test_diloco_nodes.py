"""``replica: node``: a node of L ranks is one DiLoCo replica (DDP inside it), its outer state
sharded over its ranks -- on real gloo ranks, nodes given as ranks per host, fresh random inputs.

- H = 1, outer SGD lr 1, no momentum: DDP over all ranks (1e-6), on uneven nodes (2+1: the
  replicas weighted by their rank count; 2+2 through Lightning below).
- FSDP2 inside the node (a rank's DiLoCo shard its FSDP shard) equals DDP inside it (1e-5, 20 steps).
- The round logic on more layouts, schedules and codecs (one-rank nodes, 2+1+2, fragments and
  overlap, error feedback, discards) runs on the in-process fake: ``tests/unit/test_diloco_fake.py``.
- A resume from the sharded outer state (``torch.load(weights_only=True)``) continues bit for
  bit; each rank keeps 1/L of the outer state.
- Through Lightning's Trainer (the strategy's glue): H = 1 equals Lightning's DDP on 2 hosts of 2.
- The sparse codec on nodes (2+2, 2+1): each shard's round is the mean of its owners' pieces
  (each owner's top-k of its weighted Δ), the same on every rank of every node.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.dist.test_diloco import PLAIN_AVERAGING, _vs_ddp
from tests.helpers.distributed import run_distributed

LR, DIM = 0.05, 6


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + rank * 131 + step)
    x = torch.randn(4, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _inner_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int, rank: int, step: int) -> None:
    x, y = _batch(seed, rank, step)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(module(x), y).backward()
    optimizer.step()


def _engine(rank: int, world: int, sizes: list[int] | None, kwargs: dict, model: torch.nn.Module,
            inner: str = "ddp", init=None):
    """The node engine on nodes of ``sizes`` ranks (None: today's per-rank engine)."""
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.job import JobContext

    job = JobContext(rank=rank, world_size=world)
    kwargs = {"exchange": "mesh", **kwargs}
    if sizes is None:
        return DiLoCoEngine(model, DiLoCoConfig(**kwargs), job, ReplicaLayout.of_sizes([1] * world))
    config = DiLoCoConfig(replica="node", **kwargs)
    return DiLoCoEngine(model, config, job, ReplicaLayout.of_sizes(sizes, inner), init=init)


def _train(engine, module, model, optimizer, seed: int, rank: int, steps: range, sync_every: int) -> None:
    """``steps`` inner steps of ``module`` (the model, or DDP over it), a round every ``sync_every``."""
    from syncplane.comm import CommMeter

    tensors = [p.data for p in model.parameters()]
    for step in steps:
        _inner_step(module, optimizer, seed, rank, step)
        if (step + 1) % sync_every == 0:
            engine.launch(tensors, 0, step + 1, False, CommMeter())
            engine.merge(tensors, engine.pop(0), 0.0)


def node_vs_ddp(rank: int, world: int, sizes: list[int], seed: int, steps: int, gather_chunk: int,
                inner: str = "ddp"):
    from torch.nn.parallel import DistributedDataParallel

    from syncplane.algorithms.diloco import engine as diloco_engine

    diloco_engine.GATHER_CHUNK = gather_chunk

    model = _model(seed)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        _inner_step(ddp, optimizer, seed, rank, step)
    reference = [p.detach().clone() for p in model.parameters()]

    model = _model(seed)
    engine = _engine(rank, world, sizes, {"sync_every": 1, **PLAIN_AVERAGING}, model, inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    _train(engine, engine.module, model, optimizer, seed, rank, range(steps), 1)
    engine.close()
    whole = [p.full_tensor().clone() if inner == "fsdp" else p.detach().clone() for p in model.parameters()]
    if inner == "fsdp":   # validation's consensus: node r's replica moved by r, then the exact mean over nodes
        tensors = [p.data for p in model.parameters()]
        for t in tensors:
            t.to_local().detach().add_(float(engine.layout.replica_of(rank)))
        engine.average_model_(tensors)
        with torch.no_grad():
            whole.append([p.full_tensor() - w for p, w in zip(model.parameters(), whole)])
    return reference, whole, list(engine.owned)


@pytest.mark.parametrize("sizes", [[2, 1]], ids=str)
def test_node_replicas_with_h1_plain_outer_sgd_equal_ddp_over_all_ranks(sizes):
    seed = int(torch.randint(0, 2**20, ()))
    # the replica's θ_g gathered in pieces of 7 values (the model has 41; shards of 21, 20)
    results = run_distributed(node_vs_ddp, sum(sizes), sizes, seed, 4, 7, timeout=180)
    for reference, params, _ in results:
        for ddp, node in zip(reference, params):
            torch.testing.assert_close(node, ddp, rtol=1e-6, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(results[0][1], _model(seed).parameters()))
    # a small node's ranks own several shards: rank 2 owns both
    assert [owned for _, _, owned in results] == [[0], [1], [0, 1]]


@pytest.mark.parametrize("sizes", [[2, 1, 2], [3, 2]], ids=str)
def test_fsdp_on_uneven_nodes_with_h1_plain_outer_sgd_equals_ddp_over_all_ranks(sizes):
    """FSDP2 inside nodes of different sizes: each parameter exchanged in the units its nodes'
    row chunks cut it into (3 + 2: rows [0, 2) [2, 3) [3, 4) [4, 5) of a 5-row weight, each among
    its holders), the replicas weighted by their rank count: DDP over all ranks (1e-6). Then
    validation's consensus (``average_model_``): node r's replica moved by r becomes the mean."""
    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(node_vs_ddp, sum(sizes), sizes, seed, 4, 7, "fsdp", timeout=180)
    for reference, (*params, moved), _ in results:
        for ddp, node in zip(reference, params):
            torch.testing.assert_close(node, ddp, rtol=1e-6, atol=1e-6)
        shift = sum(range(len(sizes))) / len(sizes)
        assert all(torch.allclose(m, torch.full_like(m, shift), atol=1e-5) for m in moved)
    assert any(not torch.equal(a, b) for a, b in zip(results[0][1], _model(seed).parameters()))
    # the exchange sets each rank is in: 2+1+2's lone rank in both; 3+2 as the units above say
    assert [len(owned) for _, _, owned in results] == {"[2, 1, 2]": [1, 1, 2, 1, 1],
                                                      "[3, 2]": [1, 2, 1, 2, 2]}[str(sizes)]


SPARSE = {"compression": "sparse", "density": 0.25, "bits": 4, "chunk": 8, "exchange": "gather"}


def resume_sharded(rank: int, world: int, sizes: list[int], seed: int):
    """6 rounds straight, and 3 rounds + the state through bytes (weights_only) + 3 more."""
    kwargs = {"sync_every": 2, "compression": "int8", "block_size": 4}

    def fresh():
        model = _model(seed)
        engine = _engine(rank, world, sizes, kwargs, model)
        return model, engine, engine.module, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    model, engine, module, optimizer = fresh()
    _train(engine, module, model, optimizer, seed, rank, range(12), 2)
    straight = [p.detach().clone() for p in model.parameters()], engine.params.clone()
    engine.close()

    model, engine, module, optimizer = fresh()
    _train(engine, module, model, optimizer, seed, rank, range(6), 2)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sync": engine.state_dict(),
                "rank": engine.rank_state_dict()}, buffer)
    saved_bytes = engine.outer_state_bytes()
    engine.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model, engine, module, optimizer = fresh()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    engine.load_state_dict(state["sync"])
    engine.load_rank_state_dict(state["rank"])
    _train(engine, module, model, optimizer, seed, rank, range(6, 12), 2)
    resumed = [p.detach().clone() for p in model.parameters()], engine.params.clone()
    engine.close()
    return straight, resumed, saved_bytes, sum(p.numel() for p in model.parameters())


def test_resume_from_the_sharded_outer_state_is_bit_identical_and_each_rank_keeps_its_share():
    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(resume_sharded, 3, [2, 1], seed, timeout=180)
    for (params, outer), (resumed_params, resumed_outer), _, _ in results:
        assert torch.equal(outer, resumed_outer)
        assert all(torch.equal(a, b) for a, b in zip(params, resumed_params))
    n = results[0][3]
    # θ_g, Nesterov momentum and Δ, 12 bytes per value: rank 2 (a node of one) all of it, ranks 0-1 half each
    assert [r[2] for r in results] == [12 * ((n + 1) // 2), 12 * (n // 2), 12 * n]


def sparse_node_round(rank: int, world: int, sizes: list[int], seed: int):
    """One round (H = 2, plain averaging) with the sparse codec; this rank's pieces as the
    codec makes them from its weighted Δ (first round: the accumulator is Δ)."""
    from syncplane.comm import ChunkedTopK, CommMeter

    model = _model(seed)
    engine = _engine(rank, world, sizes, {"sync_every": 2, **PLAIN_AVERAGING, **SPARSE}, model)
    before = {k: engine.outers[k].params.clone() for k in engine.owned}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        _inner_step(engine.module, optimizer, seed, rank, step)
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    codec = ChunkedTopK(SPARSE["density"], SPARSE["bits"], SPARSE["chunk"])
    pieces = {k: codec.compress(engine.outers[k].outers[0].pseudo_gradient(local[slice(*engine.pieces[k][0])]) * engine.weight)
              for k in engine.owned}
    tensors = [p.data for p in model.parameters()]
    engine.launch(tensors, 0, 2, False, CommMeter())
    assert engine.merge(tensors, engine.pop(0), 0.0)
    after = {k: engine.outers[k].params.clone() for k in engine.owned}
    engine.close()
    return before, pieces, after, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("sizes", [[2, 2], [2, 1]], ids=str)
def test_sparse_shards_are_the_mean_of_their_owners_pieces_on_every_rank(sizes):
    from syncplane.comm import ChunkedTopK

    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(sparse_node_round, sum(sizes), sizes, seed, timeout=180)
    codec = ChunkedTopK(SPARSE["density"], SPARSE["bits"], SPARSE["chunk"])
    owners: dict[int, list[int]] = {}
    for rank, (_, pieces, _, _) in enumerate(results):
        for k in pieces:
            owners.setdefault(k, []).append(rank)
    assert sorted(owners) == [0, 1] and all(len(ranks) == 2 for ranks in owners.values())   # one owner per node
    for k, ranks in owners.items():
        n = results[ranks[0]][0][k].numel()
        mean = codec.decode_add([results[r][1][k] for r in ranks], torch.zeros(n)) / len(ranks)
        assert mean.count_nonzero() > 0
        for r in ranks:
            torch.testing.assert_close(results[r][2][k], results[r][0][k] - mean, rtol=0, atol=1e-6)
            assert torch.equal(results[r][2][k], results[ranks[0]][2][k])      # bit-identical across nodes
    models = [model for _, _, _, model in results]
    assert all(torch.equal(m, models[0]) for m in models)                        # every rank: one θ_g


def test_through_lightning_h1_on_two_hosts_of_two_equals_ddp(tmp_path):
    from syncplane.job import JobContext

    kwargs = {"replica": "node", "exchange": "mesh", "job": JobContext(world_size=4, local_world_size=2)}
    results = run_distributed(_vs_ddp, 4, str(tmp_path), 3, None, kwargs, timeout=240)
    for params, rounds, sent, details in results:
        assert rounds == 3 and sent > 0
        assert details["replicas"] == 2 and details["ranks_per_replica"] == [2, 2] and details["inner"] == "ddp"
        for ddp, diloco in zip(params["ddp"], params["diloco"]):
            torch.testing.assert_close(diloco, ddp, rtol=1e-6, atol=1e-6)


def fsdp_vs_ddp(rank: int, world: int, seed: int, steps: int):
    out = []
    reference = dict(_model(seed).named_parameters())
    for inner in ("ddp", "fsdp", "fsdp-meta"):
        init = None
        if inner == "fsdp-meta":       # built without storage; each rank makes only its shards
            with torch.device("meta"):
                model = _model(seed)

            def init(name: str, tensor: torch.Tensor) -> None:   # the second node draws other values
                tensor.copy_(reference[name] + (rank >= 2))
        else:
            model = _model(seed)
        engine = _engine(rank, world, [2, 2], {"sync_every": 5}, model, inner.split("-")[0], init)
        if init is not None:          # the shards hold the first node's values, and nothing is whole
            assert all(p.to_local().numel() < p.numel() for p in model.parameters() if p.shape[0] > 1)
            out.append(all(torch.equal(p.full_tensor(), reference[n]) for n, p in model.named_parameters()))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        _train(engine, engine.module, model, optimizer, seed, rank, range(steps), 5)
        out.append([p.full_tensor() if inner != "ddp" else p.detach().clone() for p in model.parameters()])
        out.append(engine.outer_state_bytes())
        engine.close()
    return out


def test_fsdp_inside_the_node_equals_ddp_inside_it():
    """FSDP2 over the node's ranks, a rank's DiLoCo shard its FSDP shard (Nesterov outer, 20 steps);
    the same from a model built on the meta device, whose ranks made only their own shards (the
    second node from other values: every node takes the first node's)."""
    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(fsdp_vs_ddp, 4, seed, 20, timeout=180)
    for ddp, _, fsdp, _, materialized, meta, _ in results:
        assert materialized
        assert any(not torch.equal(a, b) for a, b in zip(ddp, _model(seed).parameters()))
        for a, b, c in zip(ddp, fsdp, meta):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            assert torch.equal(c, b)
    # a node's ranks hold the outer state (θ_g, momentum, Δ: 12 bytes per value) once between them,
    # cut where DDP's shards or FSDP's row chunks fall
    n = sum(p.numel() for p in _model(seed).parameters())
    for node in ((0, 1), (2, 3)):
        assert sum(results[r][1] for r in node) == sum(results[r][3] for r in node) == 12 * n
        assert sum(results[r][6] for r in node) == 12 * n


@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_through_lightning_a_mid_round_resume_from_sharded_outer_state_is_bit_identical(tmp_path, inner):
    """The Trainer's checkpoint: each rank's outer shards ride in its own replica file (with
    FSDP2 its model and momentum shards too, plain tensors); everything loads with weights_only."""
    from syncplane.job import JobContext
    from syncplane.strategies.replicas import load_replicas
    from tests.dist.test_diloco import resume_vs_uninterrupted
    from tests.helpers.models import TinyRegressor

    kwargs = {"sync_every": 2, "replica": "node", "inner": inner, "exchange": "mesh", "compression": "int8",
              "block_size": 4, "job": JobContext(world_size=4, local_world_size=2)}
    results = run_distributed(resume_vs_uninterrupted, 4, str(tmp_path), kwargs, "nodes.ckpt", timeout=240)
    files = load_replicas(tmp_path / "nodes.ckpt")
    assert [r["rank_state"]["shards"] for r in files] == [[0], [1], [0], [1]]
    whole = {k: v.shape for k, v in TinyRegressor().state_dict().items()}
    # rank 0's checkpoint: the whole consensus model; a rank's file: its shard (FSDP: half the rows)
    assert {k: v.shape for k, v in torch.load(tmp_path / "nodes.ckpt", weights_only=True)["state_dict"].items()} == whole
    rows = {k: v.shape[0] for k, v in files[0]["model"].items()}
    assert rows == {k: (s[0] + 1) // 2 if inner == "fsdp" else s[0] for k, s in whole.items()}
    for (params, outer), (resumed_params, resumed_outer), rounds in results:
        assert rounds == 12 // 2
        assert torch.equal(outer, resumed_outer)
        assert all(torch.equal(a, b) for a, b in zip(params, resumed_params))


def _meta_regressor():
    """``TinyRegressor`` whose net is built on the meta device in ``configure_model``."""
    from tests.helpers.models import TinyRegressor

    class MetaRegressor(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.net = None

        def configure_model(self) -> None:
            if self.net is None:
                with torch.device("meta"):
                    self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    return MetaRegressor()


def trainer_fsdp_vs_ddp(rank: int, world: int, tmp_dir: str, seed: int, steps: int):
    """``steps`` steps through the Trainer (Nesterov outer, H = 5, a validation every epoch: the
    consensus), DDP then FSDP2 inside the node, then FSDP2 from a model built on the meta device
    in ``configure_model`` (each rank makes its shards, torch's initialization from the same
    seed): the whole parameters, the last val_loss, the layout."""
    from syncplane.job import JobContext
    from tests.dist.test_diloco import _diloco
    from tests.helpers.models import RegressionData, TinyRegressor, trainer_for

    out = {}
    for inner in ("ddp", "fsdp", "fsdp-meta"):
        torch.manual_seed(seed)
        model = _meta_regressor() if inner == "fsdp-meta" else TinyRegressor()
        torch.manual_seed(seed)
        strategy = _diloco(sync_every=5, replica="node", inner=inner.split("-")[0], exchange="mesh",
                           job=JobContext(world_size=world, local_world_size=2))
        trainer = trainer_for(strategy, tmp_dir, max_steps=steps, limit_val_batches=2)
        trainer.fit(model, RegressionData(seed=seed))
        params = [p.full_tensor() if inner != "ddp" else p.detach().clone() for p in model.parameters()]
        out[inner] = (params, float(trainer.callback_metrics["val_loss"]), strategy.rounds, dict(strategy.details))
    return out


def test_through_lightning_fsdp_inside_the_node_equals_ddp_inside_it(tmp_path):
    """``inner=fsdp`` through the Trainer on 2 hosts of 2: 20 steps equal ``inner=ddp`` (1e-5),
    the consensus shown to validation included."""
    from tests.helpers.models import TinyRegressor

    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(trainer_fsdp_vs_ddp, 4, str(tmp_path), seed, 20, timeout=300)
    torch.manual_seed(seed)
    start = [p.detach() for p in TinyRegressor().parameters()]
    for result in results:
        (ddp, ddp_loss, ddp_rounds, _), (fsdp, fsdp_loss, fsdp_rounds, details) = result["ddp"], result["fsdp"]
        assert ddp_rounds == fsdp_rounds == 4 and details["inner"] == "fsdp" and details["ranks_per_replica"] == [2, 2]
        assert any(not torch.equal(a, b) for a, b in zip(ddp, start))
        for a, b in zip(ddp, fsdp):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert abs(fsdp_loss - ddp_loss) < 1e-5
        meta, meta_loss, meta_rounds, _ = result["fsdp-meta"]
        assert meta_rounds == 4 and meta_loss == fsdp_loss
        assert all(torch.equal(a, b) for a, b in zip(fsdp, meta))


def discard_one_shard(rank: int, world: int, seed: int):
    """Shard 1's group discards its round (as the runner does when a member times out)."""
    from syncplane.comm import CommMeter

    model = _model(seed)
    engine = _engine(rank, world, [2, 2], {"sync_every": 1, **PLAIN_AVERAGING}, model)
    for k, runner in engine.runners.items():
        if k == 1:
            runner.allreduce_mean_ = lambda flat, meter=None, **kw: False
    theta_g = {k: engine.outers[k].params.clone() for k in engine.owned}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    _inner_step(engine.module, optimizer, seed, rank, 0)
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    tensors = [p.data for p in model.parameters()]
    engine.launch(tensors, 0, 1, False, CommMeter())
    committed = engine.merge(tensors, engine.pop(0), 0.0)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    moved = {k: not torch.equal(engine.outers[k].params, theta_g[k]) for k in engine.owned}
    engine.close()
    return committed, local, after, moved, {k: engine.pieces[k][0] for k in engine.pieces}


def test_a_discarded_shard_keeps_the_replicas_local_values_and_the_others_commit():
    seed = int(torch.randint(0, 2**20, ()))
    results = run_distributed(discard_one_shard, 4, seed, timeout=120)
    assert [r[0] for r in results] == [True, False, True, False]     # ranks 1 and 3 own shard 1
    assert [r[3] for r in results] == [{0: True}, {1: False}, {0: True}, {1: False}]
    (a0, b0), (a1, b1) = results[0][4][0], results[0][4][1]
    for node in ((0, 1), (2, 3)):
        first, second = (results[r] for r in node)
        assert torch.equal(first[2], second[2])                      # the node's ranks stay one model
        assert torch.equal(first[2][a1:b1], first[1][a1:b1])         # shard 1: θ_local kept
        assert not torch.equal(first[2][a0:b0], first[1][a0:b0])     # shard 0: the outer step's θ_g
    assert torch.equal(results[0][2][a0:b0], results[2][2][a0:b0])   # shard 0 agreed across nodes


def _streamed(rank: int, world: int, sizes: list[int] | None, seed: int, steps: int, kwargs: dict):
    """``steps`` inner steps under Streaming DiLoCo's schedule, driven as the strategy drives the
    engine: a node of DDP ranks on nodes of ``sizes``, or (None) a replica per rank whose batch is
    the batches of node ``rank``'s two ranks together (DDP's mean gradient over them)."""
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.comm import CommMeter

    model = _model(seed)
    engine = _engine(rank, world, sizes, kwargs, model)
    module, tau, alpha = engine.module, kwargs.get("overlap_steps", 0), DiLoCoConfig(**kwargs).alpha
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tensors = [p.data for p in model.parameters()]
    for step in range(steps):
        if sizes is None:
            parts = [_batch(seed, 2 * rank + j, step) for j in range(2)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(module(x), y).backward()
            optimizer.step()
        else:
            _inner_step(module, optimizer, seed, rank, step)
        done = step + 1
        for fragment in engine.starting(done):
            engine.launch(tensors, fragment, done + tau, tau > 0, CommMeter())
        for round_ in engine.pop_due(done):
            assert engine.merge(tensors, round_, alpha)
    engine.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [{"sync_every": 4, "fragments": 2, "overlap_steps": 1}], ids=["P2-tau1"])
def test_a_node_of_ddp_ranks_runs_the_streaming_schedule_of_one_replica_with_its_batches(kwargs):
    """Fragments and overlap on node replicas: 2 nodes of 2 DDP ranks equal 2 per-rank replicas
    that train on each node's batches together -- the same fragments, offsets, overlap and mix,
    the outer state sharded over the node's ranks (1e-5: DDP's mean gradient vs one batch)."""
    seed = int(torch.randint(0, 2**20, ()))
    nodes = run_distributed(_streamed, 4, [2, 2], seed, 12, kwargs, timeout=180)
    ranks = run_distributed(_streamed, 2, None, seed, 12, kwargs, timeout=180)
    for rank, params in enumerate(nodes):
        for got, want in zip(params, ranks[rank // 2]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not all(torch.allclose(a, b) for a, b in zip(nodes[0], nodes[2]))   # overlap: replicas differ between merges
