"""Hierarchical neighbour averaging on machines of different sizes (and non-consecutive ranks),
on real gloo processes, against a float64 dense reference built from the definition:

    ``mean_m = (1/L_m) Σ_{r on m} x_r``,  ``y_r = Σ_m' A[m', m(r)] · mean_m'``

with ``A`` a seeded random machine matrix written down here (not the code's schedule or
matrix). Inputs come from a seeded generator per rank (the seed is printed by ``test_seed``).
"""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

from tests.dist.test_averaging import reference_matrix
from tests.helpers.distributed import run_distributed

SHAPES = [(3, 5), (7,), (1,), (2, 2, 2), (13,)]     # numels not multiples of the shard count


def _inputs(seed: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 977 + rank)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).float() for shape in SHAPES]


def _machine_matrix(seed: int, machines: int) -> np.ndarray:
    """``A[j, i]``: the weight machine i gives machine j's mean; random, some entries zero
    (sparse graph), every machine keeping a self weight; not stochastic on purpose (the mixing
    must apply the weights as given)."""
    rng = np.random.default_rng(seed)
    a = rng.random((machines, machines)) + 0.1
    a[rng.random((machines, machines)) < 0.3] = 0.0
    np.fill_diagonal(a, rng.random(machines) + 0.1)
    return a


def _graph(a: np.ndarray) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(a)))
    graph.add_weighted_edges_from((j, i, float(a[j, i])) for j in range(len(a)) for i in range(len(a)) if a[j, i])
    return graph


def _reference(seed: int, machines: list[list[int]], a: np.ndarray, rank: int) -> list[torch.Tensor]:
    means = [[torch.stack([_inputs(seed, r)[k].double() for r in ranks]).mean(0) for k in range(len(SHAPES))]
             for ranks in machines]
    m = next(i for i, ranks in enumerate(machines) if rank in ranks)
    return [sum(a[j, m] * means[j][k] for j in range(len(machines))) for k in range(len(SHAPES))]


def _static(seed: int, machines: list[list[int]], rank: int) -> list[torch.Tensor]:
    import syncplane.comm as sc
    from syncplane.comm.hierarchical import hierarchical_neighbor_allreduce_tensors

    sc.set_machine_topology(_graph(_machine_matrix(seed, len(machines))), machines=machines)
    return hierarchical_neighbor_allreduce_tensors(_inputs(seed, rank), enable_topo_check=True)


def _dynamic(seed: int, machines: list[list[int]], rank: int) -> list[torch.Tensor]:
    """One-peer-style dynamic weights: machine m keeps 0.4 and takes 0.6 of machine m−1, which
    sends with scale 1.5 (so m−1's mean arrives ×1.5, then weighted 0.6)."""
    import syncplane.comm as sc

    sc.set_machine_topology(None, machines=machines)
    n = len(machines)
    m = next(i for i, ranks in enumerate(machines) if rank in ranks)
    return [sc.hierarchical_neighbor_allreduce(x, self_weight=0.4, src_machine_weights={(m - 1) % n: 0.6},
                                               dst_machine_weights={(m + 1) % n: 1.5}, enable_topo_check=True)
            for x in _inputs(seed, rank)]


def _engine(seed: int, machines: list[list[int]], rank: int) -> list[list[torch.Tensor]]:
    """The strategies' engine (one-peer schedule over machines, tiny buckets so several are in
    flight) for three steps, the tensors after each step."""
    from syncplane.algorithms.decentralized.engine import NeighborAverager
    from syncplane.algorithms.decentralized.schedule import build_schedule
    from syncplane.comm import topology

    tensors = _inputs(seed, rank)
    averager = NeighborAverager(tensors, build_schedule("one_peer", topology.ExponentialTwoGraph(len(machines))),
                                hierarchical=True, machines=machines, bucket_bytes=32)
    assert len(averager.buckets) >= 3
    averager.check_schedule()
    out = []
    for step in range(3):
        averager.launch(step)
        averager.wait()
        out.append([t.clone() for t in tensors])
    return out


def _run(rank: int, world: int, machines: list[list[int]], seed: int) -> dict:
    """Everything one layout checks, in one spawned job (spawning dominates the cost). The
    launch environment names each rank's host (GROUP_RANK, LOCAL_WORLD_SIZE), so
    ``machines=auto`` must find the same machines."""
    import os

    from syncplane.algorithms.decentralized.machines import machines_for
    from syncplane.job import JobContext

    host = next(i for i, ranks in enumerate(machines) if rank in ranks)
    os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(host), str(len(machines[host]))
    return {"auto": machines_for(JobContext.from_environment(), "auto"), "static": _static(seed, machines, rank),
            "dynamic": _dynamic(seed, machines, rank), "engine": _engine(seed, machines, rank)}


#: machine sizes [1,3,2], [2,1], [3,3,1]; the last two layouts hold non-consecutive ranks
LAYOUTS = [
    [[0], [1, 2, 3], [4, 5]],
    [[0, 2], [1]],
    [[0, 3, 6], [1, 2, 4], [5]],
]


@pytest.mark.parametrize("machines", LAYOUTS, ids=["1-3-2", "2-1-interleaved", "3-3-1-interleaved"])
def test_machine_mixing_on_uneven_machines_equals_dense_reference(machines, test_seed):
    """Static weights (a random sparse machine matrix), dynamic weights with a send scale, and
    the engine's one-peer schedule for three steps (BlueFog's graph, by formula)."""
    seed = test_seed % 100_000
    world, n = sum(len(m) for m in machines), len(machines)
    results = run_distributed(_run, world, machines, seed, timeout=150)
    dynamic = np.zeros((n, n))
    for m in range(n):
        dynamic[m, m] += 0.4
        dynamic[(m - 1) % n, m] += 0.6 * 1.5
    for rank, result in enumerate(results):
        assert result["auto"] == ("host", machines)
        for key, a in (("static", _machine_matrix(seed, n)), ("dynamic", dynamic)):
            for got, want in zip(result[key], _reference(seed, machines, a, rank)):
                torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")
    machine_of = {r: m for m, ranks in enumerate(machines) for r in ranks}
    x = [[t.double() for t in _inputs(seed, r)] for r in range(world)]
    for step in range(3):
        a = reference_matrix("one_peer", n, step)
        means = [[torch.stack([x[r][k] for r in ranks]).mean(0) for k in range(len(SHAPES))] for ranks in machines]
        x = [[sum(a[j, machine_of[r]] * means[j][k] for j in range(n)) for k in range(len(SHAPES))]
             for r in range(world)]
        for r in range(world):
            for got, want in zip(results[r]["engine"][step], x[r]):
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_machines_must_partition_the_ranks():
    from syncplane.algorithms.decentralized.machines import host_machines
    from syncplane.comm.context import check_machines

    assert check_machines([[2, 0], [1]], 3) == [[0, 2], [1]]
    with pytest.raises(ValueError, match=r"machines: rank 1 is in machines\[0\] and machines\[1\]"):
        check_machines([[0, 1], [1, 2]], 3)
    with pytest.raises(ValueError, match=r"machines: ranks \[2\] are in no machine"):
        check_machines([[0], [1]], 3)
    with pytest.raises(ValueError, match=r"machines\[1\] names rank 5, outside a world of size 3"):
        check_machines([[0, 1, 2], [5]], 3)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE \[1, 2\]\) but GROUP_RANK"):
        host_machines([(None, 1), (None, 2), (None, 2)])
    assert host_machines([(None, 2)] * 4) == [[0, 1], [2, 3]]
    assert host_machines([("b", 2), ("a", 1), ("b", 2)]) == [[0, 2], [1]]


def _train_on_hosts(rank: int, world: int, tmp_dir: str, nodes: list[int], steps: int):
    """Both strategies through Lightning on hosts of different sizes (GROUP_RANK per host), one
    after the other in the same processes (spawning dominates the cost)."""
    import os

    from tests.dist.test_decentralized import _train

    os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(nodes[rank]), str(nodes.count(nodes[rank]))
    return {name: _train(rank, world, tmp_dir, name, {"machines": "auto", "schedule": "one_peer"}, steps, 0.0, True)
            for name in ("h_atc", "h_awc")}


def test_strategy_update_rules_on_uneven_interleaved_hosts(tmp_path):
    """Hosts [[0, 2], [1]]: ATC ``X(t+1) = M_tᵀ(X − γG)``, AWC ``M_tᵀX − γG``, with
    ``M_t[j, i] = A_t[m(j), m(i)] / L_m(j)`` (each machine's mean, then the one-peer machine
    graph by formula) and each gradient recomputed at ``xᵢ(t)``."""
    from tests.dist.test_decentralized import LR, _gradient_at

    nodes, machines, steps = [0, 1, 0], [[0, 2], [1]], 3
    runs = run_distributed(_train_on_hosts, 3, str(tmp_path), nodes, steps, timeout=300)
    machine_of = {r: m for m, ranks in enumerate(machines) for r in ranks}
    for name in ("h_atc", "h_awc"):
        results = [run[name] for run in runs]
        x = torch.stack([r[1][0] for r in results])
        for t in range(steps):
            grads = torch.stack([r[2][t] for r in results])
            for i, r in enumerate(results):
                torch.testing.assert_close(grads[i], _gradient_at(r[1][t], r[3][t]), rtol=1e-4, atol=1e-6)
            a = reference_matrix("one_peer", len(machines), t)
            m = torch.tensor([[a[machine_of[j], machine_of[i]] / len(machines[machine_of[j]]) for i in range(3)]
                              for j in range(3)], dtype=torch.float64)
            x = m.T @ (x - LR * grads) if name == "h_atc" else m.T @ x - LR * grads
            got = torch.stack([r[1][t + 1] for r in results]) if t + 1 < steps else \
                torch.stack([r[0] for r in results])
            torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{name}, step {t}: {msg}")
