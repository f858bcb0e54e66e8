"""BlueFog's documented behaviour of the comm calls, on real gloo processes (issue 16).

Each expectation is written from BlueFog's documentation, not from syncplane's output:
windows start with the caller's own tensor; ``set_topology`` is refused while windows
exist; a plan mismatch is a ``ValueError``; gathers concatenate tensors whose first
dimensions differ; ``get_win_version`` counts unread writes; the Infer* calls invert
the neighbour lists.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed

WORLDS = [2, 4, 5]


def fresh_seed() -> int:
    seed = int(torch.randint(0, 2**30, ()))
    print(f"seed={seed}")
    return seed


# ------------------------------------------------------------------ windows


def _windows(rank, world, seed):
    import networkx as nx
    import torch.distributed as dist

    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.RingGraph(world))
    x = torch.randn(4, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)
    out = {}
    try:
        sc.win_create(x.clone(), "a")        # the window keeps its tensor by reference
        out["names"] = sc.get_current_created_window_names()
        out["update"] = sc.win_update("a", clone=True)                   # own copies -> x
        isolated = nx.DiGraph()
        isolated.add_weighted_edges_from((i, i, 1.0) for i in range(world))   # differs from the ring for all n
        out["refused"] = sc.set_topology(isolated)
        out["same_accepted"] = sc.set_topology(T.RingGraph(world))            # equivalent: nothing to change
        out["in_after_refusal"] = sc.in_neighbor_ranks()
        dist.barrier()
        out["version0"] = sc.get_win_version("a")
        dist.barrier()                     # every rank has read version 0 before anyone writes
        right = (rank + 1) % world
        sc.win_put(x * 0 + rank, "a", dst_weights={right: 1.0})           # I write into right's buffer
        dist.barrier()
        out["version1"] = sc.get_win_version("a")
        sc.win_update("a")
        out["version2"] = sc.get_win_version("a")
        dist.barrier()
        sc.win_create(torch.zeros(2), "b", zero_init=True)
        out["names2"] = sc.get_current_created_window_names()
        try:
            sc.win_put(x, "a", dst_weights={(rank + 2) % world: 1.0} if world > 3 else {rank: 1.0})
            out["stray"] = None
        except ValueError as exc:
            out["stray"] = str(exc)
        dist.barrier()
        sc.win_free()
        out["accepted"] = sc.set_topology(isolated)
        out["in_after_free"] = sc.in_neighbor_ranks()
    finally:
        sc.window.shutdown()
    return x, out


@pytest.mark.parametrize("world", WORLDS)
def test_windows_follow_bluefog(world):
    results = run_distributed(_windows, world, fresh_seed(), timeout=240)
    for rank, (x, out) in enumerate(results):
        ring = sorted({(rank - 1) % world, (rank + 1) % world})
        assert out["names"] == ["a"] and out["names2"] == ["a", "b"]
        torch.testing.assert_close(out["update"], x, rtol=0, atol=1e-15)    # win_create(x); win_update() == x
        assert out["refused"] is False and out["in_after_refusal"] == ring and out["same_accepted"] is True
        assert out["version0"] == {j: 0 for j in ring}
        left = (rank - 1) % world
        assert out["version1"] == {j: int(j == left) for j in ring}        # one unread write from the left
        assert out["version2"] == {j: 0 for j in ring}                     # read by win_update
        assert out["stray"] is not None and "not out-neighbours" in out["stray"]
        assert out["accepted"] is True
        assert out["in_after_free"] == []


# ------------------------------------------------------------------ errors


def _errors(rank, world):
    import torch.distributed as dist

    import syncplane.comm as sc

    out = {}
    try:      # rank 0 sends to 1, but nobody expects rank 0
        sc.neighbor_allreduce(torch.ones(3), self_weight=0.5, src_weights={}, dst_weights=[1] if rank == 0 else [])
    except ValueError as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    try:      # plans agree, but rank 1's tensor is longer: named before any payload moves
        sc.neighbor_allreduce(torch.ones(3 + (rank == 1)), self_weight=0.5, src_weights={(rank - 1) % world: 0.5},
                              dst_weights=[(rank + 1) % world])
    except ValueError as exc:
        out["shape"] = str(exc)
    start = time.monotonic()
    try:
        sc.broadcast(torch.ones(3, dtype=torch.uint64), root_rank=0)      # gloo has no exact carrier
    except TypeError as exc:
        out["uint64"] = (str(exc), time.monotonic() - start)
    try:
        sc.neighbor_allreduce(torch.ones(3, dtype=torch.int32))
    except TypeError as exc:
        out["int_allreduce"] = str(exc)
    dist.barrier()                     # the process group still works
    out["after"] = sc.allreduce(torch.full((2,), float(rank)), average=False)
    return out


def test_errors_are_bluefog_value_errors_and_bad_dtypes_fail_fast():
    world = 4
    for rank, out in enumerate(run_distributed(_errors, world)):
        kind, message = out["mismatch"]
        assert kind == "TopologyError" and "rank 0 sends to rank 1, which does not expect it" in message
        assert "rank 1 sends float32 [4] to rank 2, which holds float32 [3]" in out["shape"]
        message, seconds = out["uint64"]
        assert "uint64" in message and "gloo" in message and seconds < 5
        assert "int32" in out["int_allreduce"]
        torch.testing.assert_close(out["after"], torch.full((2,), float(sum(range(world)))))


# ------------------------------------------------------------------ gathers


def _rows(seed, rank):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(rank % 3, 2, 3, generator=g)          # first dimension 0, 1 or 2


def _gathers(rank, world, seed):
    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.ExponentialTwoGraph(world))
    x = _rows(seed, rank)
    out = {"static": sc.neighbor_allgather(x)}
    right, left = (rank + 1) % world, (rank - 1) % world
    out["dynamic"] = sc.neighbor_allgather(x, src_ranks=[left], dst_ranks=[right])
    out["nonblocking"] = sc.neighbor_allgather_nonblocking(x, src_ranks=[left], dst_ranks=[right]).wait()
    out["all"] = sc.allgather(x)
    out["all_nb"] = sc.allgather_nonblocking(torch.tensor(float(rank))).wait()   # 0-d: one row each
    try:
        sc.neighbor_allgather(torch.zeros(2, 3 + (rank == 1)))                    # rank 1's rows are longer
        out["bad"] = None
    except ValueError as exc:
        out["bad"] = str(exc)
    try:
        sc.allgather(torch.zeros(2, dtype=torch.float64 if rank == 0 else torch.float32))
        out["bad_dtype"] = None
    except ValueError as exc:
        out["bad_dtype"] = str(exc)
    out["after"] = sc.allreduce(torch.ones(1), average=False)                    # still alive and in step
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_gathers_with_different_first_dimensions(world):
    seed = fresh_seed()
    results = run_distributed(_gathers, world, seed)
    X = [_rows(seed, r) for r in range(world)]
    for rank, out in enumerate(results):
        sources = sorted({(rank - 2 ** k) % world for k in range(world.bit_length()) if 2 ** k < world})
        torch.testing.assert_close(out["static"], torch.cat([X[j] for j in sources]))
        torch.testing.assert_close(out["dynamic"], X[(rank - 1) % world])
        torch.testing.assert_close(out["nonblocking"], X[(rank - 1) % world])
        torch.testing.assert_close(out["all"], torch.cat(X))
        torch.testing.assert_close(out["all_nb"], torch.arange(world, dtype=torch.float32))
        assert out["bad"] is not None and "[2, 4]" in out["bad"] and "rank 1" in out["bad"]
        assert out["bad_dtype"] is not None and "float64" in out["bad_dtype"]
        assert out["after"].item() == world


def _mismatched_allgather_without_check(rank, world):
    import syncplane.comm as sc

    # every plan agrees, shapes differ in every way the header can describe
    shape = [(3,), (2, 5), (0, 5), (1, 1, 1, 1)][rank % 4]
    try:
        sc.neighbor_allgather(torch.ones(shape), src_ranks=[(rank - 1) % world], dst_ranks=[(rank + 1) % world],
                              enable_topo_check=False)
        return None
    except ValueError as exc:
        return str(exc)


def test_neighbor_allgather_never_aborts_on_any_shape():
    results = run_distributed(_mismatched_allgather_without_check, 4)
    assert all(r is not None and "cannot be concatenated" in r for r in results)
    assert len(set(results)) == 1                       # the same message on every rank


# ------------------------------------------------------------------ Infer*


def _infer(rank, world):
    from syncplane.comm import neighbor

    dst = [(rank + 1) % world] + ([(rank + 2) % world] if rank == 0 and world > 2 else [])
    sources, matrix = neighbor.infer_sources_from_destinations(dst, construct_adjacency_matrix=True)
    destinations = neighbor.infer_destinations_from_sources(sources)
    try:
        neighbor.infer_sources_from_destinations([rank])
        bad = None
    except ValueError as exc:
        bad = str(exc)
    return dst, sources, matrix, destinations, bad


@pytest.mark.parametrize("world", WORLDS)
def test_infer_sources_and_destinations(world):
    results = run_distributed(_infer, world)
    sends = {r: res[0] for r, res in enumerate(results)}
    for rank, (dst, sources, matrix, destinations, bad) in enumerate(results):
        assert sources == sorted(j for j in range(world) if rank in sends[j])
        assert sorted(destinations) == sorted(dst)
        expected = np.eye(world)
        for j, ks in sends.items():
            expected[j, ks] = 1
        expected /= expected.sum(axis=0, keepdims=True)                 # receive weights sum to 1
        np.testing.assert_allclose(matrix, expected)
        assert bad is not None and "contains this rank itself" in bad


def test_mismatch_error_is_a_value_error_type():
    from syncplane.comm.errors import TopologyError

    assert issubclass(TopologyError, ValueError)
    with pytest.raises(ValueError, match="rank 3"):
        raise TopologyError("rank 3 sends to rank 1, which does not expect it")


# ------------------------------------------------------------------ the drop-in's collectives (issue 31)


def _local_allreduce(rank, world, local, seed):
    import os

    os.environ.update(LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local))   # as torchrun sets them
    import syncplane.comm.bluefog_compat as bf

    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ints = torch.randint(-1000, 1000, (6,), generator=g, dtype=torch.int32)
    before = x.clone()
    out = {"machine": (bf.local_size(), bf.machine_rank())}
    out["mean"] = bf.allreduce(x, is_hierarchical_local=True)
    out["sum"] = bf.allreduce(x, average=False, is_hierarchical_local=True, name="s")
    out["mean_nb"] = bf.synchronize(bf.allreduce_nonblocking(x, True, True))     # BlueFog's positional order
    out["int_sum"] = bf.allreduce(ints, False, True)
    out["global"] = bf.allreduce(x, False, False, "g")
    out["untouched"] = torch.equal(x, before)
    y = x.clone()
    out["in_place"] = (bf.allreduce_(y, is_hierarchical_local=True) is y, y)
    z = x.clone()
    bf.wait(bf.allreduce_nonblocking_(z, False, True, "z"))
    out["in_place_sum"] = z
    try:
        bf.allreduce(ints, average=True, is_hierarchical_local=True)
        out["int_mean"] = None
    except TypeError as exc:
        out["int_mean"] = str(exc)
    out["after"] = bf.allreduce(torch.ones(1), average=False)                    # still in step
    return x, ints, out


@pytest.mark.parametrize("world,local", [(4, 2), (3, 1)])
def test_allreduce_is_hierarchical_local_reduces_inside_the_machine(world, local, test_seed):
    """BlueFog: ``is_hierarchical_local=True`` averages (or sums) over the ranks of the
    caller's machine (``rank // local_size``) only; ``allreduce_`` does it in place."""
    results = run_distributed(_local_allreduce, world, local, test_seed)
    X, INTS = [r[0] for r in results], [r[1] for r in results]
    for rank, (x, ints, out) in enumerate(results):
        machine = range(rank // local * local, (rank // local + 1) * local)
        assert out["machine"] == (local, rank // local)
        total = X[machine[0]].clone()
        for j in machine[1:]:
            total += X[j]
        assert torch.equal(out["sum"], total) and torch.equal(out["in_place_sum"], total)   # one add: exact
        for mean in (out["mean"], out["mean_nb"], out["in_place"][1]):
            assert torch.equal(mean, total / local)
        assert out["in_place"][0] is True and out["untouched"] is True
        assert torch.equal(out["int_sum"], sum(INTS[j] for j in machine))
        torch.testing.assert_close(out["global"], sum(X), rtol=1e-14, atol=1e-14)
        assert "average=True" in out["int_mean"]
        assert out["after"].item() == world


def _narrow_dtypes(rank, world, seed):
    import syncplane.comm as sc
    import syncplane.comm.bluefog_compat as bf

    g = torch.Generator().manual_seed(seed + rank)
    out = {}
    for dtype, low, high in [(torch.int16, -2**15, 2**15), (torch.uint16, 0, 2**16), (torch.uint32, 0, 2**32)]:
        x = torch.randint(low, high, (rank + 1, 3), generator=g, dtype=torch.int64)
        x[0, :2] = torch.tensor([low, high - 1])                     # both ends of the range
        x = x.to(dtype)
        out[dtype] = (x, bf.broadcast(x[:1], 1, "b"), bf.allgather(x, "g"), bf.broadcast_(x[:1].clone(), 0))
    for dtype in (torch.int8, torch.uint8, torch.bool, torch.float16, torch.bfloat16):   # gloo carries these
        x = torch.randint(0, 2, (2,), generator=g).to(dtype)
        out[dtype] = (x, bf.broadcast(x, 0), bf.allgather(x))
    out["int16_sum"] = sc.allreduce(torch.full((2,), 1000 * (rank + 1), dtype=torch.int16), average=False)
    try:
        bf.broadcast(torch.ones(2, dtype=torch.uint64), 0)
        out["uint64"] = None
    except TypeError as exc:
        out["uint64"] = str(exc)
    out["after"] = bf.allreduce(torch.ones(1), average=False)
    return out


def test_int16_and_other_narrow_integers_broadcast_and_gather_exactly(test_seed):
    """BlueFog broadcasts and gathers int16; gloo refuses it (and uint16/uint32): they
    travel widened and come back in their own dtype, every value exact."""
    world = 3
    results = run_distributed(_narrow_dtypes, world, test_seed)
    for out in results:
        for dtype in (torch.int16, torch.uint16, torch.uint32):
            mine, from_one, gathered, from_zero = out[dtype]
            for got in (from_one, gathered, from_zero):
                assert got.dtype == dtype
            assert torch.equal(from_one, results[1][dtype][0][:1])
            assert torch.equal(from_zero, results[0][dtype][0][:1])
            assert torch.equal(gathered, torch.cat([r[dtype][0] for r in results]))
        for dtype in (torch.int8, torch.uint8, torch.bool, torch.float16, torch.bfloat16):
            _, got, gathered = out[dtype]
            assert got.dtype == dtype and torch.equal(got, results[0][dtype][0])
            assert torch.equal(gathered, torch.cat([r[dtype][0] for r in results]))
        assert out["int16_sum"].dtype == torch.int16 and out["int16_sum"].tolist() == [6000, 6000]
        assert "uint64" in out["uint64"] and "gloo" in out["uint64"]
        assert out["after"].item() == world
