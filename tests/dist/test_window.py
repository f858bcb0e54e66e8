"""Window operations and push-sum on real processes (RPC over TensorPipe, gloo for barriers)."""

from __future__ import annotations

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
