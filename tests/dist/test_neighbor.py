"""Neighbour collectives on real gloo processes against dense float64 references.

Static: ``Y = Aᵀ X`` with ``A = nx.to_numpy_array(G)``. Dynamic:
``y_i = a·x_i + Σ_j r_ij s_ij x_j``. Hierarchical: machine means mixed by the machine
graph. Fresh random tensors every run (the seed is drawn per test and printed on failure).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed

TOL = {"float32": dict(rtol=1e-6, atol=1e-6), "float16": dict(rtol=1e-2, atol=1e-2),
       "bfloat16": dict(rtol=1e-2, atol=2e-2)}


def rank_tensor(seed: int, rank: int, shape, dtype_name: str = "float32") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype_name))


# ------------------------------------------------------------------ static topologies

GRAPHS = ["ExponentialTwoGraph", "SymmetricExponentialGraph", "RingGraph", "MeshGrid2DGraph", "StarGraph",
          "FullyConnectedGraph", "random_weights"]


def build_graph(name: str, n: int, seed: int):
    import networkx as nx

    from syncplane.comm import topology as T

    if name != "random_weights":
        return getattr(T, name)(n)
    # random column-stochastic weights on an exponential graph (not doubly stochastic)
    graph = T.ExponentialTwoGraph(n)
    rng = np.random.default_rng(seed)
    for i in range(n):
        preds = list(graph.predecessors(i))
        w = rng.random(len(preds)) + 0.1
        for j, wj in zip(preds, w / w.sum()):
            graph[j][i]["weight"] = float(wj)
    return nx.DiGraph(graph)


def _static(rank, world, cases, seed):
    """One spawned job runs many (graph, dtype, shape) cases: spawning dominates the cost."""
    import syncplane.comm as sc

    out = []
    for graph_name, dtype_name, shape in cases:
        sc.set_topology(build_graph(graph_name, world, seed))
        out.append(sc.neighbor_allreduce(rank_tensor(seed, rank, shape, dtype_name)))
    return out


def check_static(world, cases, results, seed):
    for c, (graph_name, dtype_name, shape) in enumerate(cases):
        A = _matrix(build_graph(graph_name, world, seed))
        X = torch.stack([rank_tensor(seed, r, shape, dtype_name).double().reshape(-1) for r in range(world)])
        expected = torch.from_numpy(A.T) @ X
        for rank in range(world):
            got = results[rank][c]
            assert got.dtype == getattr(torch, dtype_name) and got.shape == torch.Size(shape), (graph_name, shape)
            torch.testing.assert_close(got.double().reshape(-1), expected[rank], **TOL[dtype_name],
                                       msg=lambda m: f"{graph_name} {dtype_name} {shape} rank {rank}: {m}")


@pytest.mark.parametrize("world", [2, 4, 5])
def test_static_neighbor_allreduce_equals_AT_X_for_every_builder(world, test_seed):
    seed = test_seed
    cases = [(g, "float32", (3, 5)) for g in GRAPHS]
    check_static(world, cases, run_distributed(_static, world, cases, seed), seed)


def _matrix(graph):
    import networkx as nx

    return nx.to_numpy_array(graph, nodelist=range(graph.number_of_nodes()))


def test_static_all_dtypes_and_shapes(test_seed):
    seed, world = test_seed, 3
    cases = [("random_weights", d, s) for d in ("float32", "float16", "bfloat16") for s in [(), (7,), (2, 3, 4)]]
    check_static(world, cases, run_distributed(_static, world, cases, seed), seed)


# ------------------------------------------------------------------ dynamic weights

def dynamic_plan(world: int, seed: int, step: int):
    """A random valid plan: every rank sends to 1-2 random ranks with random weights."""
    rng = np.random.default_rng(seed + step)
    sends = {}
    for j in range(world):
        k = int(rng.integers(1, min(2, world - 1) + 1))
        peers = rng.choice([r for r in range(world) if r != j], size=k, replace=False)
        sends[j] = {int(p): float(rng.random() + 0.1) for p in peers}          # s_jk
    recv_weights = {i: {j: float(rng.random() + 0.1) for j in range(world) if i in sends[j]} for i in range(world)}
    self_weights = {i: float(rng.random()) for i in range(world)}
    return sends, recv_weights, self_weights


STYLES = [(style, nonblocking) for style in ("push", "pull", "push_pull") for nonblocking in (False, True)]


def _dynamic(rank, world, seed):
    import syncplane.comm as sc

    out = []
    for step, (style, nonblocking) in enumerate(STYLES):
        sends, recv_weights, self_weights = dynamic_plan(world, seed, step)
        x = rank_tensor(seed + step, rank, (4, 6))
        kwargs = dict(self_weight=self_weights[rank])
        if style in ("push", "push_pull"):
            kwargs["dst_weights"] = sends[rank]
        if style in ("pull", "push_pull"):
            kwargs["src_weights"] = recv_weights[rank]
        if style == "pull":
            kwargs["dst_weights"] = list(sends[rank])     # pull: destinations, unscaled
        if nonblocking:
            out.append(sc.neighbor_allreduce_nonblocking(x, **kwargs).wait())
        else:
            out.append(sc.neighbor_allreduce(x, **kwargs))
    return out


@pytest.mark.parametrize("world", [3, 5])
def test_dynamic_neighbor_allreduce_formula(world, test_seed):
    seed = test_seed
    results = run_distributed(_dynamic, world, seed)
    for step, (style, nonblocking) in enumerate(STYLES):
        sends, recv_weights, self_weights = dynamic_plan(world, seed, step)
        X = {r: rank_tensor(seed + step, r, (4, 6)).double() for r in range(world)}
        for i in range(world):
            expected = self_weights[i] * X[i]
            for j in range(world):
                if i in sends[j]:
                    r = recv_weights[i][j] if style != "push" else 1.0
                    s = sends[j][i] if style != "pull" else 1.0
                    expected = expected + r * s * X[j]
            torch.testing.assert_close(results[i][step].double(), expected, **TOL["float32"],
                                       msg=lambda m: f"{style} nonblocking={nonblocking} rank {i}: {m}")


def _dynamic_on_subgroup(rank, world, seed):
    import torch.distributed as dist

    import syncplane.comm as sc

    group = dist.new_group([1, 2, 3])   # collective on every rank
    result = None
    if rank != 0:
        me = dist.get_rank(group)
        x = rank_tensor(seed, rank, (5,))
        result = sc.neighbor_allreduce(x, self_weight=0.5, src_weights={(me - 1) % 3: 0.5},
                                       dst_weights=[(me + 1) % 3], group=group)
    dist.barrier()   # rank 0 hosts the rendezvous store: it must outlive the others' work
    return result


def test_dynamic_on_a_given_process_group(test_seed):
    seed = test_seed
    results = run_distributed(_dynamic_on_subgroup, 4, seed)
    X = {g: rank_tensor(seed, g + 1, (5,)).double() for g in range(3)}   # group rank g = global g + 1
    for g in range(3):
        expected = 0.5 * X[g] + 0.5 * X[(g - 1) % 3]
        torch.testing.assert_close(results[g + 1].double(), expected, **TOL["float32"])


def _one_peer_steps(rank, world, seed, steps):
    import syncplane.comm as sc
    from syncplane.comm import topology as T

    x = rank_tensor(seed, rank, (10,))
    for send, recv in __import__("itertools").islice(T.one_peer_exponential(world, rank), steps):
        x = sc.neighbor_allreduce(x, self_weight=0.5, src_weights={recv[0]: 0.5}, dst_weights=send)
    return x


def test_one_peer_dynamic_schedule_reaches_exact_mean(test_seed):
    world, seed = 8, test_seed
    results = run_distributed(_one_peer_steps, world, seed, 3, timeout=180)
    mean = torch.stack([rank_tensor(seed, r, (10,)).double() for r in range(world)]).mean(0)
    for r in range(world):
        torch.testing.assert_close(results[r].double(), mean, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ fusion

def _fused_vs_single(rank, world, seed):
    import syncplane.comm as sc

    sc.set_topology(build_graph("random_weights", world, seed))
    shapes = [(3, 3), (1,), (100,), (2, 2, 2), (17,)]
    tensors = [rank_tensor(seed + i, rank, s) for i, s in enumerate(shapes)]
    single = [sc.neighbor_allreduce(t) for t in tensors]
    fused = [t.clone() for t in tensors]
    handles = sc.neighbor_allreduce_tensors(fused, bucket_bytes=64)   # several buckets
    for h in handles:
        h.wait()
    return single, fused, len(handles)


def test_fused_buckets_equal_per_tensor_calls(test_seed):
    results = run_distributed(_fused_vs_single, 3, test_seed)
    for single, fused, buckets in results:
        assert buckets > 1
        for a, b in zip(single, fused):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ allgather / wrappers

def _allgather(rank, world, seed):
    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.RingGraph(world))
    x = rank_tensor(seed, rank, (2, 3))
    static = sc.neighbor_allgather(x)
    dynamic = sc.neighbor_allgather(x, src_ranks=[(rank + 1) % world], dst_ranks=[(rank - 1) % world])
    total = sc.allreduce(x, average=False)
    mean = sc.allreduce_nonblocking(x).wait()
    root = sc.broadcast(x, root_rank=1)
    return static, dynamic, total, mean, root


def test_neighbor_allgather_and_global_wrappers(test_seed):
    world, seed = 4, test_seed
    results = run_distributed(_allgather, world, seed)
    X = [rank_tensor(seed, r, (2, 3)) for r in range(world)]
    for r, (static, dynamic, total, mean, root) in enumerate(results):
        in_neighbours = sorted({(r - 1) % world, (r + 1) % world})      # in rank order
        torch.testing.assert_close(static, torch.cat([X[j] for j in in_neighbours]))
        torch.testing.assert_close(dynamic, X[(r + 1) % world])
        torch.testing.assert_close(total, sum(X), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mean, sum(X) / world, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(root, X[1])


# ------------------------------------------------------------------ hierarchical

def _hierarchical(rank, world, local_size, seed, dynamic):
    import syncplane.comm as sc

    machines = world // local_size
    sc.set_machine_topology(build_graph("random_weights", machines, seed), local_size=local_size)
    x = rank_tensor(seed, rank, (3, 4))
    if not dynamic:
        return sc.hierarchical_neighbor_allreduce(x)
    m = rank // local_size
    return sc.hierarchical_neighbor_allreduce(x, self_weight=0.25, src_machine_weights={(m - 1) % machines: 0.75},
                                              dst_machine_weights={(m + 1) % machines: 1.0})


@pytest.mark.parametrize("world,local_size", [(4, 2), (6, 2), (6, 3)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_hierarchical_mixes_machine_means(world, local_size, dynamic, test_seed):
    seed = test_seed
    results = run_distributed(_hierarchical, world, local_size, seed, dynamic, timeout=180)
    machines = world // local_size
    means = torch.stack([torch.stack([rank_tensor(seed, m * local_size + l, (3, 4)).double()
                                      for l in range(local_size)]).mean(0) for m in range(machines)])
    if dynamic:
        Am = np.zeros((machines, machines))
        for m in range(machines):
            Am[m, m] += 0.25
            Am[(m - 1) % machines, m] += 0.75
    else:
        Am = _matrix(build_graph("random_weights", machines, seed))
    for r in range(world):
        m = r // local_size
        expected = sum(Am[mp, m] * means[mp] for mp in range(machines))
        torch.testing.assert_close(results[r].double(), expected, **TOL["float32"])


# ------------------------------------------------------------------ topology check

def _mismatched(rank, world, check, timeout_s):
    import syncplane.comm as sc

    # rank 0 sends to 1, but rank 1 expects rank 2; rank 2 sends to nobody
    plans = {0: ([1], []), 1: ([], [2]), 2: ([], []), 3: ([], [])}
    dst, src = plans[rank]
    start = time.monotonic()
    try:
        sc.neighbor_allreduce(torch.ones(8), self_weight=1.0, src_weights={j: 1.0 for j in src},
                              dst_weights=dst, enable_topo_check=check, timeout_s=timeout_s)
    except sc.TopologyError as exc:
        return "TopologyError", str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def test_mismatched_plan_raises_on_every_rank_naming_the_ranks():
    results = run_distributed(_mismatched, 4, True, 30.0)
    for kind, message, seconds in results:
        assert kind == "TopologyError" and seconds < 30
        assert "rank 0 sends to rank 1, which does not expect it" in message
        assert "rank 1 expects rank 2, which does not send to it" in message


def test_mismatch_without_check_ends_in_an_error_not_a_hang():
    start = time.monotonic()
    outcomes = run_distributed(_mismatched_staying, 4, 3.0, timeout=60)
    assert time.monotonic() - start < 60
    errors = [message for kind, message, _ in outcomes if kind == "TopologyError"]
    # rank 1 waits for rank 2, which never sends: it fails on every run. Whichever rank's 3-s
    # timeout fires first names that timeout; gloo may then end the other's pending message on
    # the 0-1 pair ("connection closed by peer"), so that rank's error may be the closure, or
    # rank 0's send may even have completed (gloo buffers it) -- each is an error, not a hang.
    assert outcomes[1][0] == "TopologyError" and 1 <= len(errors) <= 2, outcomes
    assert any("did not complete within 3 s" in message for message in errors), errors
    for message in errors:
        assert "neighbor" in message and re.search(r"(sending to|receiving from) rank [12]", message), message
    assert [kind for kind, _, _ in outcomes[2:]] == ["ok", "ok"]


def _mismatched_staying(rank, world, timeout_s):
    import datetime

    from torch.distributed import distributed_c10d

    try:
        return _mismatched(rank, world, False, timeout_s)
    finally:
        # every rank -- also one that has failed already -- stays alive until every rank has
        # ended its attempt (a key each in the job's store, which outlives a failed group): a
        # peer that had exited would fail the others' messages for a reason of its own.
        store = distributed_c10d._get_default_store()
        store.set(f"attempted/{rank}", "1")
        store.wait([f"attempted/{r}" for r in range(world)], datetime.timedelta(seconds=45))


def _check_overhead(rank, world):
    import syncplane.comm as sc

    x = torch.ones(16)
    plan = dict(self_weight=0.5, src_weights={(rank - 1) % world: 0.5}, dst_weights=[(rank + 1) % world])
    for _ in range(3):
        sc.neighbor_allreduce(x, **plan)
    return True


def test_valid_dynamic_plans_pass_the_check():
    assert all(run_distributed(_check_overhead, 3))


# ------------------------------------------------------------------ one connection per direction

def _one_way(rank, world, seed):
    """Rank 0 swaps through ``exchange_tensors``; every other rank posts raw messages on the
    groups the direction names (to rank 0: downward; from it: upward), so the swap completes
    only if ``exchange_tensors`` routed rank 0's messages the same way."""
    import datetime

    import torch.distributed as dist

    from syncplane.comm import context
    from syncplane.comm.p2p import exchange_tensors

    context.set_one_way_links()
    up, down = context.state().one_way
    mine = rank_tensor(seed, rank, (1000,))
    if rank == 0:
        received = [torch.empty_like(mine) for _ in range(1, world)]
        handle = exchange_tensors([(peer, mine) for peer in range(1, world)], list(zip(range(1, world), received)),
                                  None, lambda: torch.stack(received), timeout_s=20, what="one-way swap")
        return handle.wait()
    theirs = torch.empty_like(mine)
    works = [dist.isend(mine, 0, group=down), dist.irecv(theirs, 0, group=up)]
    for work in works:
        work.wait(datetime.timedelta(seconds=20))
    return theirs


def test_a_swap_travels_on_one_connection_per_direction(test_seed):
    world = 3
    results = run_distributed(_one_way, world, test_seed, timeout=60)
    for peer in range(1, world):
        assert torch.equal(results[0][peer - 1], rank_tensor(test_seed, peer, (1000,)))
        assert torch.equal(results[peer], rank_tensor(test_seed, 0, (1000,)))
