"""``NeighborAverager`` on real gloo processes against the dense reference ``Y = Mᵀ X``.

Every rank regenerates every rank's inputs from seeds, so each can compute the
reference mixture locally in float64; buckets are kept tiny so that several of them
are in flight at once.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed

SHAPES = [(3, 5), (7,), (2, 2, 2), (11,)]


def _inputs(rank: int, seed: int, dtype: torch.dtype = torch.float32,
            shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]
    # 4-D tensors in channels_last, as the ResNet-50 recipe keeps its convolutions on a GPU
    return [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tensors]


def reference_matrix(kind: str, participants: int, step: int) -> np.ndarray:
    """``A[j, i]``, the weight participant i gives j's tensor at ``step``, from the definitions
    (not from the schedule under test): ``static`` is BlueFog's ``Y = Aᵀ X`` with
    ``A = nx.to_numpy_array(RingGraph(n))``; ``one_peer`` is the dynamic one-peer exponential
    graph, ``y_i = ½ x_i + ½ x_{i − 2^(t mod ⌈log₂ n⌉)}``."""
    from syncplane.comm import topology

    if kind == "static":
        return nx.to_numpy_array(topology.RingGraph(participants))
    n = participants
    if n == 1:
        return np.eye(1)
    hop = 2 ** (step % (n - 1).bit_length())
    a = np.zeros((n, n))
    for i in range(n):
        a[i, i] += 0.5
        a[(i - hop) % n, i] += 0.5
    return a


def rank_matrix(kind: str, step: int, world: int, local: int, hierarchical: bool) -> np.ndarray:
    """The rank-level mixing matrix: machines' means mixed with the machine weights."""
    if not hierarchical:
        return reference_matrix(kind, world, step)
    machine_matrix = reference_matrix(kind, world // local, step)
    m = np.zeros((world, world))
    for j in range(world):
        for i in range(world):
            m[j, i] = machine_matrix[j // local, i // local] / local
    return m


def _mix(rank: int, world: int, kind: str, hierarchical: bool, local: int, seed: int,
         shapes: list[tuple[int, ...]] = SHAPES):
    from syncplane.comm import topology
    from syncplane.algorithms.decentralized.engine import NeighborAverager
    from syncplane.algorithms.decentralized.schedule import build_schedule

    participants = world // local if hierarchical else world
    schedule = build_schedule(kind, topology.RingGraph(participants) if kind == "static" else
                              topology.ExponentialTwoGraph(participants))
    tensors = _inputs(rank, seed, shapes=shapes)
    averager = NeighborAverager(tensors, schedule, hierarchical=hierarchical, local_size=local, bucket_bytes=64)
    assert len(averager.buckets) >= 3
    averager.check_schedule()
    errors = []
    current = [[t.double() for t in _inputs(r, seed, shapes=shapes)] for r in range(world)]
    for step in range(3):
        averager.launch(step)
        averager.wait()
        m = torch.from_numpy(rank_matrix(kind, step, world, local, hierarchical))
        current = [[sum(m[j, i] * current[j][k] for j in range(world)) for k in range(len(shapes))]
                   for i in range(world)]
        errors.append(max((t.double() - ref).abs().max().item() for t, ref in zip(tensors, current[rank])))
    return errors


@pytest.mark.parametrize("world,kind,hierarchical,local", [
    (4, "one_peer", False, 1), (3, "static", False, 1), (5, "one_peer", False, 1),
    (4, "one_peer", True, 2), (4, "static", True, 2), (6, "one_peer", True, 2),
])
def test_mixing_equals_dense_reference(world, kind, hierarchical, local, test_seed):
    seed = test_seed % 10_000
    for errors in run_distributed(_mix, world, kind, hierarchical, local, seed, timeout=120):
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("hierarchical", [False, True])
def test_channels_last_tensors_mix_like_the_reference(hierarchical, test_seed):
    """Conv weights in channels_last (alone in a bucket: sent in place; or packed with others)."""
    seed = test_seed % 10_000
    shapes = [(4, 3, 2, 2), (5,), (2, 3, 3, 3), (3, 2, 2, 2)]
    for errors in run_distributed(_mix, 4, "one_peer", hierarchical, 2 if hierarchical else 1, seed, shapes,
                                  timeout=120):
        assert max(errors) < 1e-5, errors


def _partial_wait(rank: int, world: int):
    import torch

    from syncplane.comm import topology
    from syncplane.algorithms.decentralized.engine import NeighborAverager
    from syncplane.algorithms.decentralized.schedule import build_schedule

    first, second = torch.full((4,), float(rank)), torch.full((4,), 10.0 * rank)
    averager = NeighborAverager([first, second], build_schedule("one_peer", topology.ExponentialTwoGraph(world)),
                                bucket_bytes=16)
    averager.launch(0)
    before = second.clone()
    averager.wait(averager.buckets_of([first]))     # only the bucket holding `first`
    still_pending = averager.pending
    first_after, second_untouched = first.clone(), torch.equal(second, before)
    averager.wait()
    return first_after, second_untouched, still_pending, second.clone()


def test_waiting_for_one_bucket_leaves_the_others_in_flight():
    results = run_distributed(_partial_wait, 2)
    for first, second_untouched, still_pending, second in results:
        assert torch.allclose(first, torch.full((4,), 0.5))          # (0 + 1) / 2
        assert second_untouched and still_pending
        assert torch.allclose(second, torch.full((4,), 5.0))


def _wrong_size(rank: int, world: int):
    import torch

    from syncplane.algorithms.decentralized.engine import NeighborAverager
    from syncplane.algorithms.decentralized.schedule import OnePeerSchedule

    try:
        NeighborAverager([torch.zeros(2)], OnePeerSchedule(world + 1))
    except ValueError as exc:
        return str(exc)
    return None


def test_schedule_of_the_wrong_size_is_refused():
    for message in run_distributed(_wrong_size, 2):
        assert message == "the schedule is over 3 participants but there are 2 ranks"
