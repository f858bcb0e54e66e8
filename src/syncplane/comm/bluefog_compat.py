"""BlueFog's ``bluefog.torch`` names on syncplane.comm: change only the import line.

    import syncplane.comm.bluefog_compat as bf      # was: import bluefog.torch as bf

Names only -- every call forwards to the syncplane function that implements BlueFog's
semantics (see the compatibility table in docs/comm.md). The adaptations here are
signatures, nothing else: BlueFog's ``name=`` argument (an MPI request label) is
accepted and ignored, BlueFog's default of unweighted topologies
(``is_weighted=False``) is kept, ``allreduce``'s ``is_hierarchical_local`` picks the
machine's process group, and a one-tensor hierarchical non-blocking call maps onto
syncplane's list form. Calls syncplane deliberately does not provide (MPI
queries, the timeline, the ``Distributed*Optimizer`` wrappers -- use syncplane's
strategies) raise ``NotImplementedError`` saying so, or return BlueFog's "not
available" answer where BlueFog itself has one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import networkx as nx
import torch

from syncplane.comm import basics, check, context, hierarchical, neighbor, window
from syncplane.comm import topology as topology_util
from syncplane.comm.p2p import Handle, completed


def _ignore_name(fn: Callable[..., Any], positional: int | None = None) -> Callable[..., Any]:
    """BlueFog labels requests with ``name=``; syncplane needs no label. Where BlueFog
    takes ``name`` positionally, after its ``positional`` arguments, that one is dropped
    too (it would otherwise land in syncplane's ``group``)."""
    @functools.wraps(fn)
    def call(*args: Any, name: str | None = None, **kwargs: Any) -> Any:
        if positional is not None and len(args) > positional:
            if len(args) > positional + 1:
                raise TypeError(f"{fn.__name__}() takes at most {positional + 1} positional arguments "
                                f"({positional} and name), got {len(args)}")
            args = args[:positional]
        return fn(*args, **kwargs)
    return call


# ---------------------------------------------------------------- basics
init = basics.init
shutdown = basics.shutdown
size, local_size, rank, local_rank = basics.size, basics.local_size, basics.rank, basics.local_rank
machine_size, machine_rank = basics.machine_size, basics.machine_rank
is_homogeneous, nccl_built, barrier = basics.is_homogeneous, basics.nccl_built, basics.barrier
is_topo_weighted = basics.is_topo_weighted
load_topology = context.load_topology
in_neighbor_ranks, out_neighbor_ranks = context.in_neighbor_ranks, context.out_neighbor_ranks
load_machine_topology = basics.load_machine_topology
in_neighbor_machine_ranks = basics.in_neighbor_machine_ranks
out_neighbor_machine_ranks = basics.out_neighbor_machine_ranks
set_skip_negotiate_stage, get_skip_negotiate_stage = check.set_skip_negotiate_stage, check.get_skip_negotiate_stage


def set_topology(topology: nx.DiGraph | None = None, is_weighted: bool = False) -> bool:
    return context.set_topology(topology, is_weighted=is_weighted)


def set_machine_topology(topology: nx.DiGraph | None, is_weighted: bool = False) -> bool:
    """BlueFog's unweighted default: each machine averages uniformly with its in-neighbours."""
    graph = topology if topology is None or is_weighted else topology_util.uniform_weights(topology)
    context.set_machine_topology(graph)
    return True


def mpi_threads_supported() -> bool:
    return False            # no MPI underneath


def unified_mpi_window_model_supported() -> bool:
    return False            # windows are RPC-served buffers, not MPI windows


def _unsupported(what: str, instead: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"bluefog.torch.{what} is deliberately not supported by syncplane: {instead}")
    call.__name__ = what
    return call


suspend = _unsupported("suspend", "there is no background MPI thread to pause")
resume = _unsupported("resume", "there is no background MPI thread to pause")


# ---------------------------------------------------------------- collectives
def _allreduce(tensor: torch.Tensor, average: bool, is_hierarchical_local: bool, in_place: bool) -> Handle:
    """BlueFog's all-reduce: over every rank, or with ``is_hierarchical_local`` over this
    rank's machine only (the machines of ``set_machine_topology``; by default
    ``LOCAL_WORLD_SIZE`` consecutive ranks, BlueFog's ``rank // local_size``)."""
    start = neighbor.allreduce_nonblocking_ if in_place else neighbor.allreduce_nonblocking
    if not is_hierarchical_local:
        return start(tensor, average)
    layout = context.machine_layout()
    group = layout.groups[layout.machine_of(basics.rank())]
    if group is None:      # alone on its machine: the machine's sum and mean are this tensor
        neighbor.allreduce_dtype(tensor, average)      # the same TypeError as on a larger machine
        return completed(tensor if in_place else tensor.detach().clone())
    return start(tensor, average, group)


def _allreduce_call(what: str, in_place: bool, blocking: bool) -> Callable[..., Any]:
    """BlueFog's ``allreduce`` / ``allreduce_nonblocking`` / their in-place ``_`` forms."""
    def call(tensor: torch.Tensor, average: bool = True, is_hierarchical_local: bool = False,
             name: str | None = None) -> torch.Tensor | Handle:
        handle = _allreduce(tensor, average, is_hierarchical_local, in_place)
        return handle.wait() if blocking else handle
    call.__name__ = call.__qualname__ = what
    return call


allreduce = _allreduce_call("allreduce", in_place=False, blocking=True)
allreduce_nonblocking = _allreduce_call("allreduce_nonblocking", in_place=False, blocking=False)
allreduce_ = _allreduce_call("allreduce_", in_place=True, blocking=True)
allreduce_nonblocking_ = _allreduce_call("allreduce_nonblocking_", in_place=True, blocking=False)


allgather = _ignore_name(neighbor.allgather, positional=1)
allgather_nonblocking = _ignore_name(neighbor.allgather_nonblocking, positional=1)
broadcast = _ignore_name(neighbor.broadcast, positional=2)
broadcast_nonblocking = _ignore_name(neighbor.broadcast_nonblocking, positional=2)
broadcast_ = _ignore_name(neighbor.broadcast_, positional=2)
broadcast_nonblocking_ = _ignore_name(neighbor.broadcast_nonblocking_, positional=2)
neighbor_allgather = _ignore_name(neighbor.neighbor_allgather)
neighbor_allgather_nonblocking = _ignore_name(neighbor.neighbor_allgather_nonblocking)
neighbor_allreduce = _ignore_name(neighbor.neighbor_allreduce)
neighbor_allreduce_nonblocking = _ignore_name(neighbor.neighbor_allreduce_nonblocking)
hierarchical_neighbor_allreduce = _ignore_name(hierarchical.hierarchical_neighbor_allreduce)


@_ignore_name
def hierarchical_neighbor_allreduce_nonblocking(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    return hierarchical.hierarchical_neighbor_allreduce_nonblocking([tensor], *args, **kwargs)[0]


def poll(handle: Handle) -> bool:
    return handle.poll()


def synchronize(handle: Handle) -> torch.Tensor:
    return handle.wait()


wait = synchronize


# ---------------------------------------------------------------- windows
win_create, win_free = window.win_create, window.win_free
win_update, win_update_then_collect = window.win_update, window.win_update_then_collect
win_put, win_put_nonblocking = window.win_put, window.win_put_nonblocking
win_get, win_get_nonblocking = window.win_get, window.win_get_nonblocking
win_accumulate, win_accumulate_nonblocking = window.win_accumulate, window.win_accumulate_nonblocking
neighbor_win_put, neighbor_win_put_nonblocking = win_put, win_put_nonblocking
neighbor_win_get, neighbor_win_get_nonblocking = win_get, win_get_nonblocking
neighbor_win_accumulate, neighbor_win_accumulate_nonblocking = win_accumulate, win_accumulate_nonblocking
win_wait, win_poll, win_mutex = window.win_wait, window.win_poll, window.win_mutex
get_win_version = window.get_win_version
get_current_created_window_names = window.get_current_created_window_names
win_associated_p = window.win_associated_p
turn_on_win_ops_with_associated_p = window.turn_on_win_ops_with_associated_p
turn_off_win_ops_with_associated_p = window.turn_off_win_ops_with_associated_p


# ---------------------------------------------------------------- timeline (not supported)
def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    return False            # BlueFog's answer when its timeline is off; syncplane has none


def timeline_end_activity(tensor_name: str) -> bool:
    return False


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str) -> Iterator[None]:
    yield


# ---------------------------------------------------------------- utility
broadcast_parameters = basics.broadcast_parameters
allreduce_parameters = basics.allreduce_parameters
broadcast_optimizer_state = basics.broadcast_optimizer_state


# ---------------------------------------------------------------- topology_util
GetRecvWeights = topology_util.receive_weights
GetSendWeights = topology_util.send_weights
IsRegularGraph = topology_util.is_regular_graph
IsTopologyEquivalent = topology_util.is_topology_equivalent
ExponentialTwoGraph = topology_util.ExponentialTwoGraph
ExponentialGraph = topology_util.ExponentialGraph
FullyConnectedGraph = topology_util.FullyConnectedGraph
MeshGrid2DGraph = topology_util.MeshGrid2DGraph
RingGraph = topology_util.RingGraph
StarGraph = topology_util.StarGraph
SymmetricExponentialGraph = topology_util.SymmetricExponentialGraph
GetDynamicOnePeerSendRecvRanks = topology_util.dynamic_one_peer
GetExp2DynamicSendRecvMachineRanks = topology_util.exp2_machine_ranks
GetInnerOuterRingDynamicSendRecvRanks = topology_util.inner_outer_ring
GetInnerOuterExpo2DynamicSendRecvRanks = topology_util.inner_outer_expo2
InferSourceFromDestinationRanks = neighbor.infer_sources_from_destinations
InferDestinationFromSourceRanks = neighbor.infer_destinations_from_sources

_OPTIMIZERS = ("DistributedAdaptThenCombineOptimizer", "DistributedAdaptWithCombineOptimizer",
               "DistributedGradientAllreduceOptimizer", "DistributedWinPutOptimizer",
               "DistributedAllreduceOptimizer", "DistributedNeighborAllreduceOptimizer",
               "DistributedHierarchicalNeighborAllreduceOptimizer", "CommunicationType")


def __getattr__(name: str) -> Any:
    if name in _OPTIMIZERS:
        return _unsupported(name, "train with a syncplane strategy (ddp, atc/awc, h_atc/h_awc, ...) instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
