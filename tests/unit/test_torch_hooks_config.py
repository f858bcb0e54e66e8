"""torch hook peers' settings and traffic model: bad settings named before any process
starts; the bench payload's shapes cover it exactly; the cost pattern sends half of DDP's
bytes for fp16 and PowerSGD's r·(rows + cols) per matrix, in the chain of all-reduces the
real hook runs on two gloo ranks."""

from __future__ import annotations

import subprocess

import pytest

from syncplane.algorithms import CostOptions, spec_for
from syncplane.algorithms.torch_hooks import HookConfig, payload_shapes
from syncplane.cluster.profile import load_profile
from syncplane.config import ConfigError
from syncplane.strategies import strategy_class


@pytest.mark.parametrize("field,value", [("matrix_approximation_rank", 0), ("start_powerSGD_iter", 1),
                                         ("min_compression_rate", 0.5)])
def test_bad_powersgd_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        HookConfig(name="torch_powersgd", **{field: value})
    with pytest.raises(ConfigError, match=field):
        strategy_class("torch_powersgd")(**{field: value})


def test_payload_shapes_cover_the_payload() -> None:
    for numel in (1, 2559, 2560 * 3 + 7, 25_557_032):
        shapes = payload_shapes(numel)
        assert sum(a * (b[0] if b else 1) for a, *b in shapes) == numel


def test_cost_pattern_bytes() -> None:
    profile = load_profile("multi_nic")
    payload = 4.0 * 2560 * 2560          # one 25 MiB bucket: one 2560 x 2560 matrix
    sent = {name: sum(b for step in spec_for(name).cost(name, profile, payload, CostOptions())
                      for phase in step for _, _, b in phase) for name in ("ddp", "torch_fp16", "torch_powersgd")}
    assert sent["torch_fp16"] == pytest.approx(sent["ddp"] / 2)
    assert sent["torch_powersgd"] == pytest.approx(sent["ddp"] * (2560 + 2560) / (2560 * 2560))


def test_powersgd_is_priced_as_three_chained_all_reduces_uncompressed_then_p_then_q() -> None:
    profile = load_profile("homogeneous8")
    n, payload = profile.world_size, 4.0 * (2560 * 100 + 300)     # one 2560 x 100 matrix and 300 values
    (step,) = spec_for("torch_powersgd").cost("torch_powersgd", profile, payload, CostOptions())
    ring = 2 * (n - 1)
    assert len(step) == 3 * ring
    per_allreduce = [sum(b for phase in step[k * ring:(k + 1) * ring] for _, _, b in phase) for k in range(3)]
    scale = 2 * (n - 1) / n * n * 4        # a ring all-reduce of e elements moves scale * e bytes in all
    assert per_allreduce == pytest.approx([scale * 300, scale * 2560, scale * 100])


def _hooked_all_reduces(rank: int, world: int, numel: int, steps: int) -> list[list[int]]:
    """The elements of every all-reduce torch's PowerSGD hook (as the bench runs it) starts
    in each of ``steps`` steps, in order."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from syncplane.algorithms.torch_hooks import TorchHookStep
    from syncplane.comm import CommMeter

    calls: list[int] = []
    real = powerSGD_hook.dist.all_reduce

    def counted(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    powerSGD_hook.dist.all_reduce = counted
    step, payload, seen = TorchHookStep("torch_powersgd", {}), torch.ones(numel), []
    for k in range(step.warmup + steps):
        calls.clear()
        step(payload.clone(), k, CommMeter())
        seen.append(list(calls))
    dist.barrier()
    return seen[step.warmup:]


def test_powersgd_is_priced_as_the_chain_the_real_hook_runs_bucket_by_bucket() -> None:
    """Per bucket of torch's reducer, warm, the hook all-reduces the uncompressed tensors, P
    and Q: the priced chain has one ring per all-reduce that sends anything (gloo returns at
    once from an empty one), of its elements, in the same order."""
    from syncplane.algorithms.torch_hooks import reducer_buckets
    from tests.helpers.distributed import run_distributed

    numel = 2 * 2560 * 2560 + 2560 * 700 + 300        # 2.3 of DDP's buckets: two of them
    assert len(reducer_buckets(payload_shapes(numel))) == 2
    calls = run_distributed(_hooked_all_reduces, 2, numel, 2)[0]
    assert calls[0] == calls[1] and len(calls[0]) == 6
    profile = load_profile("homogeneous8")
    n, ring = profile.world_size, 2 * (profile.world_size - 1)
    (step,) = spec_for("torch_powersgd").cost("torch_powersgd", profile, 4.0 * numel, CostOptions())
    priced = [sum(b for phase in step[k:k + ring] for _, _, b in phase) / (2 * (n - 1) * 4) for k in range(0, len(step), ring)]
    assert priced == pytest.approx([e for e in calls[0] if e])


def test_the_hooks_cpu_is_every_element_through_a_step_timed_on_this_machine_in_a_group_of_the_jobs_size() -> None:
    from syncplane.algorithms.torch_hooks import hook_cpu
    from syncplane.algorithms.torch_hooks.timing import TIMED_MAX_ELEMENTS, TIMED_MAX_RANKS, hook_op, \
        seconds_per_element

    work = hook_cpu("torch_powersgd", load_profile("local"), 4.0 * 5000, CostOptions())
    op = hook_op("torch_powersgd", 1, 5000, ranks=4)            # local: 4 ranks
    assert work.elements == {op: 5000} and set(work.timers) == {op}
    # a payload past the timed size is timed at it, a job past the timed group in it, and the op says so
    big = hook_cpu("torch_powersgd", load_profile("uneven_hosts"), 4.0 * 3 * TIMED_MAX_ELEMENTS, CostOptions())
    assert big.elements == {hook_op("torch_powersgd", 1, TIMED_MAX_ELEMENTS, TIMED_MAX_RANKS): 3 * TIMED_MAX_ELEMENTS}
    # fp16 moves half the payload: timed alone, its copies are the wire's
    fp16 = hook_cpu("torch_fp16", load_profile("uneven_hosts"), 4.0 * 5000, CostOptions())
    assert fp16.elements == {hook_op("torch_fp16", 1, 5000, ranks=1): 5000}
    assert len({hook_op("torch_fp16", 1, 10), hook_op("torch_fp16", 1, 20), hook_op("torch_powersgd", 1, 20),
                hook_op("torch_powersgd", 1, 20, ranks=2)}) == 4
    # the real step, in two child processes of one gloo group: a time, not a stub
    seconds = seconds_per_element("torch_powersgd", 1, 2560 * 16 + 10, ranks=2)
    assert 0 < seconds < 1e-3


def test_a_timing_group_that_fails_says_why_and_leaves_no_child(monkeypatch) -> None:
    """Every child fails at once here (no such hook); a child that fails alone stops the others
    the same way, instead of leaving them waiting for it in gloo."""
    from syncplane.algorithms.torch_hooks import timing

    spawned: list = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(popen(*a, **k)) or spawned[-1])
    with pytest.raises(RuntimeError, match=r"(?s)timing hook:torch_nope@64x2 failed \(child 0, exit 1\): .*torch_nope"):
        timing.seconds_per_element("torch_nope", 1, 64, ranks=2)
    assert len(spawned) == 2 and all(c.returncode is not None for c in spawned)


def test_a_hook_is_timed_on_the_payload_it_prices_capped(monkeypatch) -> None:
    from syncplane.algorithms.torch_hooks import hook_cpu, timing
    from syncplane.exchanges.cpu import calibrate

    sizes: list[int] = []
    monkeypatch.setattr(timing, "seconds_per_element",
                        lambda name, rank, numel, ranks: sizes.append(numel) or 1e-9)
    for elements in (5000, 2 * timing.TIMED_MAX_ELEMENTS):
        calibrate(hook_cpu("torch_powersgd", load_profile("local"), 4.0 * elements, CostOptions()), cache=None,
                  numel=4096)
    assert sizes == [5000, timing.TIMED_MAX_ELEMENTS]


def test_the_bench_times_warm_hook_steps_only() -> None:
    """DDP rebuilds its buckets after step one; PowerSGD compresses from ``start_powerSGD_iter``
    and its first compressed step allocates its state: neither is timed."""
    from syncplane.algorithms.torch_hooks import TorchHookStep

    assert TorchHookStep("torch_fp16", {}).warmup == 2
    powersgd = TorchHookStep("torch_powersgd", {})
    assert powersgd.warmup == powersgd.config.start_powerSGD_iter + 1


def test_fp16_rides_the_reducers_buckets_over_the_nics_as_ddp_does() -> None:
    """Four full buckets go two and two over two NICs, as ``ddp``'s do; the ResNet-50 payload
    fills three of the reducer's (``reducer_buckets``), not ``ddp``'s four: one NIC carries two."""
    from syncplane.algorithms import strategy_time
    from syncplane.algorithms.torch_hooks import SPEC, reducer_buckets
    from syncplane.cluster.cost import CostModel, ring_allreduce

    profile = load_profile("multi_nic")                  # two NICs per host
    model, n = CostModel(profile), profile.world_size
    four = 4 * 4.0 * 2560 * 2560                         # four 2560 x 2560 matrices: four full buckets
    assert len(reducer_buckets(payload_shapes(int(four // 4)))) == 4
    fp16 = strategy_time(model, "torch_fp16", four, CostOptions())[0]
    assert fp16 == pytest.approx(strategy_time(model, "ddp", four / 2, CostOptions())[0])
    assert fp16 < model.time(ring_allreduce(n, four / 2))      # one stream: one NIC
    resnet50 = 4.0 * 25_557_032
    assert SPEC.parts({}, resnet50) == len(reducer_buckets(payload_shapes(25_557_032))) == 3
    assert strategy_time(model, "torch_fp16", resnet50, CostOptions())[0] == pytest.approx(
        model.time(ring_allreduce(n, resnet50 / 2, 3)))


def test_a_rows_powersgd_rank_reaches_the_bench_step_the_wire_and_the_cpu_price() -> None:
    """``torch_powersgd[matrix_approximation_rank=4]`` is run and priced at rank 4, not at torch's 1."""
    from syncplane.algorithms.plan import PlanInputs, cost_options
    from syncplane.algorithms.torch_hooks import TorchHookStep, hook_cpu
    from syncplane.algorithms.torch_hooks.timing import hook_op

    settings = {"matrix_approximation_rank": 4, "min_compression_rate": 1.5, "steps": 5}   # with the bench's spec
    step = TorchHookStep("torch_powersgd", settings)
    assert (step.config.matrix_approximation_rank, step.config.min_compression_rate) == (4, 1.5)
    assert TorchHookStep("torch_fp16", settings).config == HookConfig(name="torch_fp16")
    options = cost_options("torch_powersgd", settings, PlanInputs(4.0 * 2560 * 2560))
    assert options.rank == 4 and cost_options("torch_powersgd", {}, PlanInputs(1.0)).rank == 1

    profile, payload = load_profile("homogeneous8"), 4.0 * 2560 * 100     # one 2560 x 100 matrix
    sent = {rank: sum(b for step in spec_for("torch_powersgd").cost("torch_powersgd", profile, payload,
                                                                     CostOptions(rank=rank))
                      for phase in step for _, _, b in phase) for rank in (1, 4)}
    assert sent[4] == pytest.approx(4 * sent[1])
    work = hook_cpu("torch_powersgd", profile, payload, options)
    assert set(work.elements) == {hook_op("torch_powersgd", 4, 2560 * 100, ranks=8)}


def test_powersgds_chain_adds_to_its_cpu_work_without_alpha_but_with_a_queue() -> None:
    """With CPU rates, PowerSGD costs its CPU work plus its chain's wire priced without α
    (measured: the ranks sharing the cores hide it) but with the queue behind a greedy flow,
    once per phase of the chain; fp16 is priced as before. Without rates the wire keeps α."""
    from syncplane.algorithms import strategy_times
    from syncplane.algorithms.torch_hooks import hook_cpu
    from syncplane.cluster.cost import EMULATED_TCP, CostModel
    from syncplane.exchanges.cpu import CpuRates

    payload = 4.0 * 25_557_032
    (chain,) = spec_for("torch_powersgd").cost("torch_powersgd", load_profile("two_racks"), payload, CostOptions())
    times = {}
    for name in ("two_racks", "two_racks_contended"):
        profile = load_profile(name)
        model = CostModel(profile, tcp=EMULATED_TCP)
        rates = CpuRates({op: 1e-8 for op in hook_cpu("torch_powersgd", profile, payload, CostOptions()).elements})
        times[name] = strategy_times(model, "torch_powersgd", payload, CostOptions(parts=3), rates)
        assert times[name].predicted_s == pytest.approx(times[name].cpu_s + model.time(chain, alpha_s=0.0))
        assert strategy_times(model, "torch_powersgd", payload).predicted_s == pytest.approx(model.time(chain))
    assert len(chain) == 7 * 14 and times["two_racks"].predicted_s - times["two_racks"].cpu_s < 0.02
    extra = times["two_racks_contended"].predicted_s - times["two_racks"].predicted_s
    assert extra == pytest.approx(len(chain) * EMULATED_TCP.queue_s, rel=0.05)


def test_a_hooks_cpu_runs_beside_the_wire_bucket_by_bucket() -> None:
    """DDP hands bucket k to the hook while it works on bucket k+1: a round in as many parts
    as buckets, priced as the longer stage plus one part of the shorter."""
    from syncplane.algorithms import overlapped
    from syncplane.algorithms.torch_hooks import SPEC
    from syncplane.comm import DEFAULT_BUCKET_BYTES

    assert SPEC.parts({}, 100.0) == 1 and SPEC.parts({}, 4.5 * DEFAULT_BUCKET_BYTES) == 4
    assert overlapped(8.0, 2.0, 4) == pytest.approx(8.5) and overlapped(8.0, 2.0, 1) == 10.0


@pytest.mark.parametrize("sharing, serial", [(2.0, True), (1.0, True), (0.5, False)])
def test_on_loopback_only_the_cpu_work_runs_beside_the_copies_only_with_cores_to_spare(sharing, serial) -> None:
    """One host (``local``): the all-reduce's bytes are the kernel's copies on the ranks' own
    cores, so where every core runs a rank the hook's CPU work adds to them (measured: fp16
    on ``local`` at 0.397 s against 0.291 overlapped, 0.356 added); with spare cores, or
    where the bytes leave the host, they overlap bucket by bucket."""
    from syncplane.algorithms import overlapped, strategy_times
    from syncplane.algorithms.torch_hooks import hook_cpu
    from syncplane.cluster.cost import EMULATED_TCP, CostModel
    from syncplane.exchanges.cpu import CpuRates

    payload = 4.0 * 25_557_032
    for name, one_host in (("local", True), ("two_racks", False)):
        profile = load_profile(name)
        model = CostModel(profile, tcp=EMULATED_TCP)
        rates = CpuRates({op: 1e-8 for op in hook_cpu("torch_fp16", profile, payload, CostOptions()).elements}, sharing)
        times = strategy_times(model, "torch_fp16", payload, CostOptions(parts=3), rates)
        wire = sum(model.time(p) for p in spec_for("torch_fp16").cost("torch_fp16", profile, payload, CostOptions()))
        parts = 1 if one_host and serial else 3
        assert times.predicted_s == pytest.approx(overlapped(wire, times.cpu_s, parts))
        assert parts == 1 or times.predicted_s < wire + times.cpu_s
