"""The bench's FlexReduce step and its ``hier_allreduce`` peer on real gloo processes, with
the hosts of a cluster profile (the job's context, as the launcher would give it): both must
return the dense float64 mean of the ranks' payloads (seeded data, rebuilt on each rank)."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed

SEED = 99


def _payload(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(SEED * 100 + rank), dtype=torch.float64)


def _steps(rank: int, world: int, profile: str) -> dict:
    from syncplane.algorithms.flexreduce.bench import FlexReduceStep, HierAllReduceStep
    from syncplane.comm import CommMeter
    from syncplane.job import JobContext

    job = JobContext(rank=rank, world_size=world, cluster=profile)   # as the launcher places the ranks

    numel = 3001
    out = {"reference": torch.stack([_payload(r, numel) for r in range(world)]).mean(0)}
    for name, step in (("flexreduce", FlexReduceStep({}, job, chunk_bytes=2048)), ("hier", HierAllReduceStep(job))):
        meter = CommMeter()
        payload = _payload(rank, numel).float()
        step(payload, 0, meter)
        out[name], out[f"{name}_calls"] = payload, meter.calls
    out["hosts"] = HierAllReduceStep(job).hosts
    return out


def test_bench_steps_equal_dense_mean_on_asymmetric_2_3() -> None:
    print(f"seed {SEED}")
    results = run_distributed(_steps, 5, "asymmetric_2_3", timeout=240)
    assert results[0]["hosts"] == [[0, 1], [2, 3, 4]]
    for r, res in enumerate(results):
        for name in ("flexreduce", "hier"):
            torch.testing.assert_close(res[name].double(), res["reference"], rtol=1e-5, atol=1e-6,
                                       msg=f"{name} on rank {r}")
            assert res[f"{name}_calls"] >= 1
        assert torch.equal(res["flexreduce"], results[0]["flexreduce"])
