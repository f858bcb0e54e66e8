"""The adapter offers every public name of ``bluefog.torch`` (its ``__init__`` imports,
BlueFog v0.3), each either working or saying it is deliberately unsupported."""

from __future__ import annotations

import pytest

import syncplane.comm.bluefog_compat as bf

BLUEFOG_TORCH = """
CommunicationType DistributedAdaptThenCombineOptimizer DistributedAdaptWithCombineOptimizer
DistributedGradientAllreduceOptimizer DistributedWinPutOptimizer DistributedAllreduceOptimizer
DistributedNeighborAllreduceOptimizer DistributedHierarchicalNeighborAllreduceOptimizer
init shutdown size local_size rank local_rank machine_size machine_rank load_topology set_topology
load_machine_topology set_machine_topology in_neighbor_ranks out_neighbor_ranks
in_neighbor_machine_ranks out_neighbor_machine_ranks mpi_threads_supported
unified_mpi_window_model_supported nccl_built is_homogeneous suspend resume
allreduce allreduce_nonblocking allreduce_ allreduce_nonblocking_ allgather allgather_nonblocking
broadcast broadcast_nonblocking broadcast_ broadcast_nonblocking_ neighbor_allgather
neighbor_allgather_nonblocking neighbor_allreduce neighbor_allreduce_nonblocking
hierarchical_neighbor_allreduce hierarchical_neighbor_allreduce_nonblocking poll synchronize wait barrier
win_create win_free win_update win_update_then_collect neighbor_win_put_nonblocking neighbor_win_put
neighbor_win_get_nonblocking neighbor_win_get neighbor_win_accumulate_nonblocking neighbor_win_accumulate
win_put_nonblocking win_put win_get_nonblocking win_get win_accumulate_nonblocking win_accumulate
win_wait win_poll win_mutex get_win_version get_current_created_window_names win_associated_p
turn_on_win_ops_with_associated_p turn_off_win_ops_with_associated_p set_skip_negotiate_stage
get_skip_negotiate_stage timeline_start_activity timeline_end_activity timeline_context
broadcast_optimizer_state broadcast_parameters allreduce_parameters
GetRecvWeights GetSendWeights IsRegularGraph IsTopologyEquivalent ExponentialTwoGraph ExponentialGraph
FullyConnectedGraph MeshGrid2DGraph RingGraph StarGraph SymmetricExponentialGraph
GetDynamicOnePeerSendRecvRanks GetExp2DynamicSendRecvMachineRanks GetInnerOuterRingDynamicSendRecvRanks
GetInnerOuterExpo2DynamicSendRecvRanks InferSourceFromDestinationRanks InferDestinationFromSourceRanks
""".split()

UNSUPPORTED = {"CommunicationType", "suspend", "resume"} | {n for n in BLUEFOG_TORCH if n.startswith("Distributed")}


@pytest.mark.parametrize("name", BLUEFOG_TORCH)
def test_every_bluefog_torch_name_is_there(name):
    assert callable(getattr(bf, name))


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_calls_say_so(name):
    with pytest.raises(NotImplementedError, match="deliberately not supported"):
        getattr(bf, name)()


def test_mpi_and_timeline_queries_answer_like_bluefog_without_them():
    assert bf.mpi_threads_supported() is False and bf.unified_mpi_window_model_supported() is False
    assert bf.timeline_start_activity("x", "y") is False and bf.timeline_end_activity("x") is False
    with bf.timeline_context("x", "y"):
        pass


def test_topology_names_are_syncplanes_builders():
    assert bf.IsTopologyEquivalent(bf.RingGraph(6, 1), bf.topology_util.RingGraph(6, 1))
    assert bf.GetRecvWeights(bf.RingGraph(4, 1), 0) == (0.5, {1: 0.5})     # rank 0 hears rank 1
