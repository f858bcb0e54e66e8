"""Communication graphs over ranks (networkx ``DiGraph``), their weights and checks.

Convention (BlueFog's; ``docs/comm.md``): an edge ``j → i`` with attribute ``weight`` is the
weight rank *i* applies to the tensor it receives from *j*; the self-loop ``i → i`` is
``w_ii``. With ``A = nx.to_numpy_array(G)``, a static ``neighbor_allreduce`` computes
``y_i = Σ_j A[j, i] x_j`` -- i.e. ``Y = Aᵀ X``. Averaging needs every *column* of ``A``
to sum to 1; preserving the global mean needs every *row* to, too (doubly stochastic).

Dynamic schedules are deterministic iterators of ``(send_ranks, recv_ranks)`` for one
rank; every rank computes its own plan from the same formula, so plans agree without
communicating.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import networkx as nx
import numpy as np

# ----------------------------------------------------------------------------- builders


def _from_matrix(matrix: np.ndarray) -> nx.DiGraph:
    graph = nx.from_numpy_array(matrix, create_using=nx.DiGraph)
    return graph


def _circulant(size: int, offsets: set[int]) -> nx.DiGraph:
    """Rank i sends to i + d (mod size) for every d in offsets; uniform weights.

    BlueFog builds the same graphs by rolling one row vector (``topo[i] = roll(x, i)``),
    i.e. the edge ``i → i + d`` -- rank i *sends* to ``i + d`` and receives from ``i − d``.
    """
    _check_size(size)
    offsets = {d % size for d in offsets} - {0}
    weight = 1.0 / (len(offsets) + 1)
    matrix = np.zeros((size, size))
    for i in range(size):
        matrix[i, i] = weight
        for d in offsets:
            matrix[i, (i + d) % size] = weight
    return _from_matrix(matrix)


def _check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"a topology needs a positive integer size, got {size!r}")


def _check_base(base: int, builder: str) -> None:
    if not isinstance(base, int) or base < 2:
        raise ValueError(f"{builder} base must be an integer of at least 2, got {base!r}")


def is_power_of(x: int, base: int) -> bool:
    """``x == base^k`` for some k ≥ 0 (exact integer test; 1 = base^0 counts)."""
    if x < 1:
        return False
    while x % base == 0:
        x //= base
    return x == 1


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:  # noqa: N802 (BlueFog's names)
    """Rank i sends to ``i + base^k`` for every ``base^k < size``; uniform weights, doubly stochastic.

    BlueFog's ``ExponentialGraph``: offsets d in ``1..size-1`` that are powers of ``base``.
    """
    _check_base(base, "ExponentialGraph")
    return _circulant(size, {d for d in range(1, size) if is_power_of(d, base)})


def ExponentialTwoGraph(size: int) -> nx.DiGraph:  # noqa: N802
    """The exponential graph with base 2: degree ⌈log₂ n⌉, diameter ⌈log₂ n⌉ (BlueFog's default)."""
    return ExponentialGraph(size, base=2)


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:  # noqa: N802
    """BlueFog's symmetric exponential graph: rank i is linked to ``i + d`` for the offsets
    d in ``1..size-1`` whose *ring distance* ``min(d, size − d)`` is a power of ``base``.

    Only distances up to ``size // 2`` count, so e.g. n = 6, base 4 links i to i ± 1 only
    (distance 2 is not a power of 4) -- unlike ``PlusMinusExponentialGraph``, which adds
    ``i ± base^k`` for every ``base^k < size``.
    """
    _check_base(base, "SymmetricExponentialGraph")
    return _circulant(size, {d for d in range(1, size) if is_power_of(min(d, size - d), base)})


def PlusMinusExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:  # noqa: N802
    """syncplane's variant (not in BlueFog): ``i ↔ i ± base^k`` for every ``base^k < size``.

    Same edges as ``SymmetricExponentialGraph`` whenever every such ``base^k`` is at
    most ``size // 2``; denser otherwise (e.g. n = 6, base 4 adds i ± 4 = i ∓ 2).
    """
    _check_base(base, "PlusMinusExponentialGraph")
    offsets: set[int] = set()
    d = 1
    while d < size:
        offsets.update({d, -d})
        d *= base
    return _circulant(size, offsets)


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:  # noqa: N802
    """BlueFog's ring. ``connect_style`` 0: both directions (weights ⅓);
    1 (“left”): rank i sends to ``i − 1``, so it averages itself with ``i + 1``;
    2 (“right”): rank i sends to ``i + 1`` and averages itself with ``i − 1`` (weights ½).

    With 2 ranks every style is the same all-to-all ½ graph.
    """
    if connect_style not in (0, 1, 2) or isinstance(connect_style, bool):
        raise ValueError(f"RingGraph connect_style must be 0 (both), 1 (left) or 2 (right), got {connect_style!r}")
    offsets = {0: {1, -1}, 1: {-1}, 2: {1}}[connect_style]
    return _circulant(size, offsets)


def FullyConnectedGraph(size: int) -> nx.DiGraph:  # noqa: N802
    """Every rank averages with every other (weights 1/n): one step reaches the exact mean."""
    return _circulant(size, set(range(1, size)))


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:  # noqa: N802
    """A hub and spokes, Metropolis–Hastings weights (doubly stochastic).

    Equal to BlueFog's: spokes keep ``1 − 1/n`` and exchange ``1/n`` with the centre,
    which keeps ``1/n``.
    """
    _check_size(size)
    if not isinstance(center_rank, int) or not 0 <= center_rank < size:
        raise ValueError(f"StarGraph center_rank must be in [0, {size}), got {center_rank!r}")
    undirected = nx.star_graph([center_rank] + [r for r in range(size) if r != center_rank])
    return metropolis_hastings(undirected, size)


def MeshGrid2DGraph(size: int, shape: tuple[int, int] | None = None) -> nx.DiGraph:  # noqa: N802
    """A 2-D grid (rows = the largest divisor of ``size`` not above √size, unless ``shape``
    is given; rank ``r·cols + c`` sits at row r, column c), Metropolis–Hastings weights
    ``1 / (1 + max(d_i, d_j))`` -- BlueFog's ``MeshGrid2DGraph``."""
    _check_size(size)
    if shape is None:
        rows = max(r for r in range(1, int(math.isqrt(size)) + 1) if size % r == 0)
        shape = (rows, size // rows)
    if len(shape) != 2 or shape[0] * shape[1] != size:
        raise ValueError(f"MeshGrid2DGraph shape {tuple(shape)} does not hold exactly {size} ranks")
    grid = nx.grid_2d_graph(*shape)
    undirected = nx.relabel_nodes(grid, {(r, c): r * shape[1] + c for r, c in grid.nodes})
    return metropolis_hastings(undirected, size)


# ----------------------------------------------------------------------------- weights


def metropolis_hastings(undirected: nx.Graph, size: int | None = None) -> nx.DiGraph:
    """Metropolis–Hastings weights ``w_ij = 1 / (1 + max(d_i, d_j))``: symmetric, doubly stochastic."""
    n = size if size is not None else undirected.number_of_nodes()
    degree = dict(undirected.degree())
    matrix = np.zeros((n, n))
    for i, j in undirected.edges:
        if i != j:
            matrix[i, j] = matrix[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    for i in range(n):
        matrix[i, i] = 1.0 - matrix[i].sum()
    return _from_matrix(matrix)


def uniform_weights(graph: nx.DiGraph) -> nx.DiGraph:
    """Same edges, each rank weighting itself and its in-neighbours equally (columns sum to 1)."""
    out = nx.DiGraph()
    out.add_nodes_from(graph.nodes)
    for i in graph.nodes:
        sources = {j for j in graph.predecessors(i) if j != i}
        weight = 1.0 / (len(sources) + 1)
        out.add_edge(i, i, weight=weight)
        for j in sources:
            out.add_edge(j, i, weight=weight)
    return out


# ----------------------------------------------------------------------------- plans


def static_weights(graph: nx.DiGraph, node: int) -> tuple[float, dict[int, float], dict[int, float]]:
    """(self weight, {source: weight it gets}, {destination: send scale 1}) of ``node`` in ``graph``."""
    self_weight = float(graph[node][node]["weight"]) if graph.has_edge(node, node) else 0.0
    sources = {j: float(graph[j][node]["weight"]) for j in graph.predecessors(node) if j != node}
    return self_weight, sources, {k: 1.0 for k in graph.successors(node) if k != node}


def receive_weights(graph: nx.DiGraph, node: int) -> tuple[float, dict[int, float]]:
    """(self weight, {source: weight node applies to it}) -- BlueFog's ``GetRecvWeights``."""
    self_weight, sources, _ = static_weights(graph, node)
    return self_weight, sources


def send_weights(graph: nx.DiGraph, node: int) -> tuple[float, dict[int, float]]:
    """(self weight, {destination: weight of the edge node → destination}) -- BlueFog's
    ``GetSendWeights``; ``static_weights`` gives the receive side (``GetRecvWeights``)."""
    self_weight = float(graph[node][node]["weight"]) if graph.has_edge(node, node) else 0.0
    return self_weight, {k: float(graph[node][k]["weight"]) for k in graph.successors(node) if k != node}


def is_topology_equivalent(first: nx.DiGraph | None, second: nx.DiGraph | None) -> bool:
    """Same node count, edge count and weighted adjacency matrix (not isomorphism)."""
    if first is None or second is None:
        return False
    if first.number_of_nodes() != second.number_of_nodes() or first.number_of_edges() != second.number_of_edges():
        return False
    return bool(np.array_equal(mixing_matrix(first), mixing_matrix(second)))


def is_regular_graph(graph: nx.DiGraph) -> bool:
    """Every node has the same total (in + out) degree."""
    return len({d for _, d in graph.degree()}) <= 1


def as_destinations(dst_weights: Mapping[int, float] | Sequence[int]) -> dict[int, float]:
    """``{rank: send scale}`` from a mapping, or from a list of ranks (scale 1)."""
    if isinstance(dst_weights, Mapping):
        return {int(k): float(s) for k, s in dst_weights.items()}
    destinations = {int(k): 1.0 for k in dst_weights}
    if len(destinations) != len(dst_weights):
        raise ValueError(f"dst_weights lists a rank twice: {list(dst_weights)}")
    return destinations


# ----------------------------------------------------------------------------- checks


def mixing_matrix(graph: nx.DiGraph) -> np.ndarray:
    """``A`` with ``A[j, i]`` = weight rank i gives to rank j's tensor (rows = senders)."""
    return nx.to_numpy_array(graph, nodelist=sorted(graph.nodes))


def is_column_stochastic(graph: nx.DiGraph, tol: float = 1e-9) -> bool:
    """Every rank's received weights (self included) sum to 1: the result is an average."""
    matrix = mixing_matrix(graph)
    return bool(np.all(matrix >= -tol) and np.allclose(matrix.sum(axis=0), 1.0, atol=tol))


def is_row_stochastic(graph: nx.DiGraph, tol: float = 1e-9) -> bool:
    """Every rank's outgoing weights sum to 1 (what push-sum style methods need)."""
    matrix = mixing_matrix(graph)
    return bool(np.all(matrix >= -tol) and np.allclose(matrix.sum(axis=1), 1.0, atol=tol))


def is_doubly_stochastic(graph: nx.DiGraph, tol: float = 1e-9) -> bool:
    """Both: repeated averaging converges to the exact global mean."""
    return is_column_stochastic(graph, tol) and is_row_stochastic(graph, tol)


def is_strongly_connected(graph: nx.DiGraph) -> bool:
    return nx.is_strongly_connected(graph)


def spectral_gap(graph: nx.DiGraph) -> float:
    """``1 − |λ₂|`` of the mixing matrix: the per-step contraction rate towards consensus.

    Consensus error shrinks like ``|λ₂|^t``; a gap of 0 means the graph never mixes.
    """
    eigenvalues = np.sort(np.abs(np.linalg.eigvals(mixing_matrix(graph))))[::-1]
    return float(1.0 - eigenvalues[1]) if len(eigenvalues) > 1 else 1.0



# ----------------------------------------------------------------------------- dynamic schedules

Plan = tuple[list[int], list[int]]


def one_peer_exponential(size: int, rank: int) -> Iterator[Plan]:
    """Dynamic one-peer exponential schedule (BlueFog's default for training).

    At step t rank r sends to ``r + 2^(t mod K)`` and receives from ``r − 2^(t mod K)``
    (mod n), ``K = ⌈log₂ n⌉``: one message per step, and after K steps every rank has
    (indirectly) heard from all others. Pair with self weight ½ and neighbour weight ½.
    """
    _check_rank(size, rank)
    if size == 1:
        yield from itertools.repeat(([], []))
        return
    exponents = max(1, math.ceil(math.log2(size)))
    for t in itertools.count():
        d = 2 ** (t % exponents)
        yield [(rank + d) % size], [(rank - d) % size]


def inner_outer_exponential(size: int, local_size: int, rank: int) -> Iterator[Plan]:
    """One peer per step, alternating inside the machine and across machines.

    Even steps: exchange with the local rank at distance ``2^k`` on the same machine
    (fast links). Odd steps: exchange with the same local rank on the machine at distance
    ``2^k`` (one flow per rank leaves each machine, all local ranks use different peers).
    A machine is ``rank // local_size``; with one machine or one process per machine the
    schedule degenerates to the plain one-peer exponential one.
    """
    _check_rank(size, rank)
    if local_size < 1 or size % local_size:
        raise ValueError(f"world size {size} is not a multiple of local_size {local_size}")
    machines = size // local_size
    if machines == 1 or local_size == 1:
        yield from one_peer_exponential(size, rank)
        return
    machine, local = divmod(rank, local_size)
    inner_k = max(1, math.ceil(math.log2(local_size)))
    outer_k = max(1, math.ceil(math.log2(machines)))
    for t in itertools.count():
        step = t // 2
        if t % 2 == 0:
            d = 2 ** (step % inner_k)
            yield ([machine * local_size + (local + d) % local_size],
                   [machine * local_size + (local - d) % local_size])
        else:
            d = 2 ** (step % outer_k)
            yield [((machine + d) % machines) * local_size + local], [((machine - d) % machines) * local_size + local]


def _check_rank(size: int, rank: int) -> None:
    _check_size(size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a world of size {size}")


def dynamic_one_peer(graph: nx.DiGraph, rank: int) -> Iterator[Plan]:
    """One out-neighbour per step, walking each rank's out-neighbours clockwise
    (BlueFog's ``GetDynamicOnePeerSendRecvRanks``).

    At step t rank r sends to the ``t mod d_r``-th of its out-neighbours sorted by
    clockwise distance ``(k − r) mod n``, and receives from every rank whose own step-t
    choice is r (possibly several, possibly none). On ``ExponentialTwoGraph`` this is
    ``one_peer_exponential``.
    """
    n = graph.number_of_nodes()
    _check_rank(n, rank)
    clockwise = [sorted((k for k in graph.successors(r) if k != r), key=lambda k, r=r: (k - r) % n)
                 for r in range(n)]
    if n > 1:
        lonely = [r for r in range(n) if not clockwise[r]]
        if lonely:
            raise ValueError(f"dynamic_one_peer needs an out-neighbour on every rank; ranks {lonely} have none")
    for t in itertools.count():
        if n == 1:
            yield [], []
            continue
        recvs = [j for j in range(n) if j != rank and clockwise[j][t % len(clockwise[j])] == rank]
        yield [clockwise[rank][t % len(clockwise[rank])]], recvs


def _homogeneous(world_size: int, local_size: int) -> int:
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"world size {world_size} is not a multiple of local_size {local_size}")
    return world_size // local_size


def exp2_machine_ranks(world_size: int, local_size: int, rank: int, local_rank: int) -> Iterator[Plan]:
    """Machine-level one-peer exponential schedule (BlueFog's ``GetExp2DynamicSendRecvMachineRanks``).

    Yields ``([send machine], [receive machine])``: at step t the distance is
    ``2^(t mod (⌊log₂(m − 1)⌋ + 1))`` for m machines.
    """
    machines = _homogeneous(world_size, local_size)
    _check_rank(world_size, rank)
    if rank % local_size != local_rank:
        raise ValueError(f"local_rank {local_rank} does not match rank {rank} with local_size {local_size}")
    if machines < 2:
        raise ValueError(f"exp2_machine_ranks needs at least two machines, got {machines}")
    machine = rank // local_size
    period = int(math.floor(math.log2(machines - 1))) + 1
    for t in itertools.count():
        d = 2 ** (t % period)
        yield [(machine + d) % machines], [(machine - d) % machines]


def _inner_outer(world_size: int, local_size: int, rank: int, outer_exp2: bool) -> Iterator[Plan]:
    """Shared body of the two inner/outer schedules: at step t local rank ``t mod L`` of
    every machine talks to another machine (distance 1, or exponential), the others pass
    inside their machine, skipping over the local rank that is out."""
    machines = _homogeneous(world_size, local_size)
    _check_rank(world_size, rank)
    if local_size <= 2:
        raise ValueError(f"inner/outer schedules need more than 2 processes per machine, got {local_size}; "
                         "use hierarchical_neighbor_allreduce or dynamic_one_peer")
    if machines < 2:
        raise ValueError(f"inner/outer schedules need at least two machines, got {machines} "
                         f"(world size {world_size}, local_size {local_size})")
    machine, local = divmod(rank, local_size)
    out_period = int(math.floor(math.log2(machines - 1))) + 1
    in_period = int(math.floor(math.log2(local_size - 2))) + 1
    base = machine * local_size
    for t in itertools.count():
        outgoing = t % local_size
        if outgoing == local:
            d = 2 ** (t % out_period) if outer_exp2 else 1
            yield ([((machine + d) % machines) * local_size + local],
                   [((machine - d) % machines) * local_size + local])
            continue
        if outer_exp2:
            forward = 2 ** (t % in_period)
            backward = forward
            if forward >= (outgoing - local) % local_size:
                forward += 1
            if backward >= (local - outgoing) % local_size:
                backward += 1
            yield [base + (local + forward) % local_size], [base + (local - backward) % local_size]
        else:
            target = (local + 1) % local_size
            target = (target + 1) % local_size if target == outgoing else target
            source = (local - 1) % local_size
            source = (source - 1) % local_size if source == outgoing else source
            yield [base + target], [base + source]


def inner_outer_ring(world_size: int, local_size: int, rank: int) -> Iterator[Plan]:
    """BlueFog's ``GetInnerOuterRingDynamicSendRecvRanks``: ring inside, ring across machines."""
    return _inner_outer(world_size, local_size, rank, outer_exp2=False)


def inner_outer_expo2(world_size: int, local_size: int, rank: int) -> Iterator[Plan]:
    """BlueFog's ``GetInnerOuterExpo2DynamicSendRecvRanks``: exponential-2 inside and across.

    Not the same schedule as ``inner_outer_exponential`` (syncplane's, alternating
    inner and outer steps for all local ranks at once).
    """
    return _inner_outer(world_size, local_size, rank, outer_exp2=True)
