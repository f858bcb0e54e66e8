"""A BlueFog program (static exp-2 averaging, dynamic one-peer averaging, hierarchical
averaging, asynchronous push-sum on windows), written against ``bluefog.torch``.

Only the import line differs from BlueFog: ``import bluefog.torch as bf``. The test
(tests/dist/test_bluefog_example.py) runs ``main`` on real gloo processes and checks
every result against a dense float64 reference. Nothing else may change here.
"""

import torch

import syncplane.comm.bluefog_compat as bf


def main(seed, iterations=6, hierarchical=False):
    bf.init()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed + bf.rank()), dtype=torch.float64)
    results = {"x": x.clone()}

    # 1. static exponential-2 topology: x <- W^T x, every step
    bf.set_topology(bf.ExponentialTwoGraph(bf.size()))
    y = x.clone()
    for _ in range(iterations):
        y = bf.neighbor_allreduce(y, name="static")
    results["static"] = y

    # 2. dynamic one-peer exponential-2: each step, one out-neighbour, uniform weights
    gen = bf.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    z = x.clone()
    for _ in range(iterations):
        send_ranks, recv_ranks = next(gen)
        weight = 1.0 / (len(recv_ranks) + 1)
        z = bf.neighbor_allreduce(z, self_weight=weight, src_weights={r: weight for r in recv_ranks},
                                  dst_weights=send_ranks, name="dynamic")
    results["dynamic"] = z

    # 3. hierarchical: machines average locally, then mix along the machine graph
    if hierarchical:
        bf.set_machine_topology(bf.ExponentialTwoGraph(bf.machine_size()))
        results["hierarchical"] = bf.hierarchical_neighbor_allreduce(x, name="hier")
        results["in_machines"] = bf.in_neighbor_machine_ranks()

    # 4. push-sum on windows with the associated p
    bf.turn_on_win_ops_with_associated_p()
    w = x.clone()
    bf.win_create(w, name="push_sum", zero_init=True)
    outdegree = len(bf.out_neighbor_ranks())
    share = 1.0 / (outdegree + 1)
    for _ in range(4 * iterations):
        bf.win_accumulate(w, name="push_sum", self_weight=share,
                          dst_weights={r: share for r in bf.out_neighbor_ranks()}, require_mutex=True)
        # Barriers make the rounds synchronous, so the result is a fixed matrix power that the
        # test checks exactly (asynchronous push-sum mixes at a rate that depends on timing;
        # tests/dist/test_window.py covers that path). win_accumulate has returned only once
        # every destination holds the deposit, so after the first barrier all of a round's
        # deposits are in; the second keeps a fast rank's next deposit out of this collect.
        bf.barrier()
        bf.win_update_then_collect(name="push_sum")
        bf.barrier()
    bf.barrier()
    bf.win_update_then_collect(name="push_sum")
    p = bf.win_associated_p(name="push_sum")
    results["push_sum_x"], results["push_sum_p"] = w.clone(), p
    bf.barrier()
    bf.win_free(name="push_sum")
    bf.turn_off_win_ops_with_associated_p()
    bf.shutdown()
    return results
