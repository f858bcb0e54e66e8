"""Window operations and push-sum on real processes (RPC over TensorPipe, gloo for barriers)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _window_ops(rank, world, seed):
    import torch
    import torch.distributed as dist

    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.RingGraph(world))        # in-neighbours r-1, r+1
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(6, generator=g)
    results = {}
    try:
        own = x.clone()
        sc.win_create(own, "w")                 # buffers start as this rank's own tensor (BlueFog)
        results["initial"] = sc.win_update("w", clone=True)
        dist.barrier()
        sc.win_put(own * 2, "w", dst_weights={(rank + 1) % world: 0.5})   # overwrite right's buffer
        dist.barrier()
        results["after_put"] = {j: b.clone() for j, b in sc.window._windows["w"].buffers.items()}
        sc.win_accumulate(torch.ones(6), "w", dst_weights=[(rank - 1) % world], require_mutex=True)
        dist.barrier()
        results["after_acc"] = {j: b.clone() for j, b in sc.window._windows["w"].buffers.items()}
        sc.win_get("w", src_weights={(rank + 1) % world: 3.0})
        # one-sided ops do not wait for the owner: without this barrier a fast neighbour
        # could already have collected into the tensor this rank is reading
        dist.barrier()
        results["after_get"] = sc.window._windows["w"].buffers[(rank + 1) % world].clone()
        results["collect"] = sc.win_update_then_collect("w").clone()
        dist.barrier()
        sc.win_free("w")
    finally:
        sc.window.shutdown()
    return x, results


def test_window_put_accumulate_get_update_against_reference(test_seed):
    world, seed = 4, test_seed
    results = run_distributed(_window_ops, world, seed, timeout=180)
    X = [r[0] for r in results]
    for r, (x, res) in enumerate(results):
        left, right = (r - 1) % world, (r + 1) % world
        torch.testing.assert_close(res["initial"], x)                                    # own copies: mean = x
        torch.testing.assert_close(res["after_put"][left], X[left] * 2 * 0.5)            # left put into me
        torch.testing.assert_close(res["after_put"][right], x)                           # untouched: own copy
        torch.testing.assert_close(res["after_acc"][right], x + 1)                       # right accumulated 1s
        torch.testing.assert_close(res["after_get"], X[right] * 3.0)                     # pulled, weighted
        torch.testing.assert_close(res["collect"], x + res["after_acc"][left] + X[right] * 3.0)


def _push_sum(rank, world, seed, slow_rank, iterations):
    import time

    import torch
    from torch.distributed import distributed_c10d

    import syncplane.comm as sc
    from syncplane.comm import topology as T

    sc.set_topology(T.ExponentialTwoGraph(world))
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(5, generator=g, dtype=torch.float64)
    store = distributed_c10d._get_default_store()
    others = [r for r in range(world) if r != slow_rank]
    iterations_seen = []

    def pace(i):
        # The straggler runs half as many iterations as the others and starts iteration i only
        # once every other rank has started iteration 2i: the ranks mix concurrently at
        # different speeds, paced by events rather than by sleeps, so the run does not depend
        # on the machine's load.
        if rank != slow_rank:
            store.add(f"push_sum/{rank}", 1)
        else:
            while min(store.add(f"push_sum/{r}", 0) for r in others) < 2 * i:
                time.sleep(0.001)
            iterations_seen.append(min(store.add(f"push_sum/{r}", 0) for r in others))

    mine = iterations // 2 if rank == slow_rank else iterations
    try:
        average = sc.push_sum_average(x, iterations=mine, on_iteration=pace)
    finally:
        sc.window.shutdown()
    return x, average, iterations_seen


def test_push_sum_reaches_the_average_with_a_straggler(test_seed):
    world, seed, slow, iterations = 4, test_seed, 2, 80
    results = run_distributed(_push_sum, world, seed, slow, iterations, timeout=180)
    true_average = torch.stack([r[0] for r in results]).mean(0)
    for x, average, _ in results:
        torch.testing.assert_close(average, true_average, rtol=0, atol=1e-5)
    seen = results[slow][2]
    assert len(seen) == iterations // 2 and all(s >= 2 * i for i, s in enumerate(seen)), seen


# ------------------------------------------------------------------ associated p (BlueFog's source as reference)


def _associated_p(rank, world, seed):
    import torch
    import torch.distributed as dist

    import syncplane.comm.bluefog_compat as bf

    bf.set_topology(bf.RingGraph(world))          # in- and out-neighbours: r-1, r+1; uniform weights 1/3
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)
    left, right = (rank - 1) % world, (rank + 1) % world
    out = {"collect": {}}
    bf.turn_on_win_ops_with_associated_p()
    try:
        # BlueFog's test_asscoicated_with_p: one sender per round, a window without zero_init
        for sender in range(world):
            name = f"p{sender}"
            tensor = x.clone()
            bf.win_create(tensor, name)
            if rank == sender:
                bf.win_accumulate(tensor, name=name, self_weight=0.5,
                                  dst_weights={(sender - 1) % world: 0.5, (sender + 1) % world: 0.5})
            bf.barrier()
            collected = bf.win_update_then_collect(name=name).clone()
            out["collect"][sender] = (bf.win_associated_p(name=name), collected)
            bf.win_free(name)
        # put, get, update with explicit weights and clone, default update with reset
        tensor = x.clone()
        bf.win_create(tensor, "b")
        bf.win_put(tensor, "b", self_weight=0.25, dst_weights={right: 0.75})   # right's p buffer: 1 x 0.75
        out["after_put"] = bf.win_associated_p("b")
        bf.barrier()
        bf.win_get("b", src_weights={left: 2.0})        # overwrites the left buffer; moves no p
        out["after_get"] = bf.win_associated_p("b")
        bf.barrier()                                     # nobody updates a tensor a neighbour still reads
        out["clone"] = bf.win_update("b", self_weight=0.5, neighbor_weights={left: 0.25, right: 0.5}, clone=True)
        out["tensor_after_clone"] = tensor.clone()
        out["after_clone"] = bf.win_associated_p("b")
        out["update"] = bf.win_update("b", reset=True).clone()
        out["after_update"] = bf.win_associated_p("b")
        bf.win_update_then_collect("b")                  # the buffers were reset: nothing to add
        out["after_reset_collect"] = (bf.win_associated_p("b"), tensor.clone())
        bf.turn_off_win_ops_with_associated_p()
        dist.barrier()
        bf.win_accumulate(tensor, "b", self_weight=0.5)  # p off: p stays, the tensor halves
        out["off"] = bf.win_associated_p("b")
        dist.barrier()
        bf.win_free()
    finally:
        bf.turn_off_win_ops_with_associated_p()
        bf.shutdown()
    return x, out


def test_associated_p_follows_bluefog(test_seed):
    """BlueFog (bluefog/torch/mpi_win_ops.cc, common/mpi_controller.cc): p starts at 1 and
    its buffers at 0; put/accumulate send p x weight, then p *= self_weight; update mixes
    p with the tensor's weights (clone too) and reset zeroes the p buffers; get moves no p."""
    world = 4
    results = run_distributed(_associated_p, world, test_seed, timeout=240)
    X = [r[0] for r in results]
    for rank, (x, out) in enumerate(results):
        left, right = (rank - 1) % world, (rank + 1) % world
        for sender, (p, collected) in out["collect"].items():
            if rank == sender:          # 0.5 x + two own-copy buffers
                assert p == 0.5
                torch.testing.assert_close(collected, 0.5 * x + x + x, rtol=1e-15, atol=0)
            elif sender in (left, right):
                assert p == 1.5
                torch.testing.assert_close(collected, 3 * x + 0.5 * X[sender], rtol=1e-15, atol=1e-15)
            else:
                assert p == 1.0
                torch.testing.assert_close(collected, 3 * x, rtol=1e-15, atol=0)
        assert out["after_put"] == 0.25 and out["after_get"] == 0.25
        # my buffers: left <- 2 x (left's tensor, 0.25 x_left); right: my own copy (right puts elsewhere)
        # my p buffers: left <- 0.75 (left's put; the get left it alone); right: 0
        torch.testing.assert_close(out["clone"], 0.5 * 0.25 * x + 0.25 * (0.5 * X[left]) + 0.5 * x,
                                   rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(out["tensor_after_clone"], 0.25 * x, rtol=0, atol=0)
        assert out["after_clone"] == 0.5 * 0.25 + 0.25 * 0.75
        torch.testing.assert_close(out["update"], (0.25 * x + 0.5 * X[left] + x) / 3, rtol=1e-14, atol=1e-14)
        assert out["after_update"] == pytest.approx((0.3125 + 0.75) / 3, rel=1e-15)
        p, tensor = out["after_reset_collect"]
        assert p == out["after_update"]
        torch.testing.assert_close(tensor, out["update"], rtol=0, atol=0)
        assert out["off"] == p
