"""FlexReduce's executor on real gloo processes against the dense float64 mean.

Each rank's data comes from a generator seeded by (SEED, rank); every rank rebuilds all
ranks' data to form the reference ``mean_r x_r`` in float64, independently of the plan.
Checked per shape: fp32 equals the reference to fp32 rounding, bf16 to bf16 rounding,
every rank ends bit-identical, and pipelined (chunked) and unpipelined runs agree bit for
bit (the sums do not depend on where the ranges fall), with the root as a swap (where the
tree has a root of two children) and as the paper's reduce-scatter and all-gather.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

SEED = 1234
NUMELS = (1, 3, 1001, 40_000)


def _data(seed: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


def _run(rank: int, world: int, shape: list) -> list:
    from syncplane.exchanges.tree.executor import FlexReduce
    from syncplane.exchanges.tree.tree import from_nested

    tree = from_nested(shape, world)
    piped = FlexReduce(tree, chunk_bytes=4096)          # several chunks for the larger sizes
    plain = FlexReduce(tree, chunk_bytes=0)
    paper_root = FlexReduce(tree, chunk_bytes=4096, swap_root=False)
    out = []
    for numel in NUMELS:
        reference = torch.stack([_data(SEED, r, numel) for r in range(world)]).mean(0)
        for dtype in (torch.float32, torch.bfloat16):
            results = []
            for algo in (piped, plain, paper_root):
                x = _data(SEED, rank, numel).to(dtype)
                algo.allreduce_mean_(x)
                results.append(x)
            out.append((numel, dtype, results[0], results[1], reference, results[2], piped.swap_root))
    return out


SHAPES = {
    "2+2": [[0, 1], [2, 3]],
    "2x2x2": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
    "2+3": [[0, 1], [2, 3, 4]],
    "3+2+4": [[0, 1, 2], [3, 4], [5, 6, 7, 8]],
    "1+4": [[0], [1, 2, 3, 4]],
    "one_rank_per_host": [[0], [1], [2]],
    "racks_uneven": [[[0, 1], [2]], [[3, 4, 5]]],
}
#: whose root runs as a swap (two children, each piece owned by one of its two holders);
#: "1+4" has two children, but its lone rank owns no piece of its own at the root
SWAP_ROOT = {"2+2", "2x2x2", "2+3"}


@pytest.mark.parametrize("name", list(SHAPES))
def test_flexreduce_equals_dense_mean(name: str) -> None:
    shape = SHAPES[name]
    world = len(str(shape).replace("[", "").replace("]", "").split(","))
    print(f"seed {SEED}, shape {name} {shape}, world {world}")
    per_rank = run_distributed(_run, world, shape, timeout=240)
    for case in range(len(per_rank[0])):
        numel, dtype, piped, plain, reference, paper_root, swapped = per_rank[0][case]
        assert swapped == (name in SWAP_ROOT), f"{name}: swap_root {swapped}"
        assert torch.equal(piped, paper_root), f"the root's swap and the paper's root differ ({numel}, {dtype})"
        for r in range(1, world):
            assert torch.equal(per_rank[r][case][2], piped), f"rank {r} differs from rank 0 ({numel}, {dtype})"
            assert torch.equal(per_rank[r][case][3], plain), f"rank {r} differs from rank 0 ({numel}, {dtype})"
        assert torch.equal(piped, plain), f"pipelined and unpipelined differ ({numel}, {dtype})"
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(piped.double(), reference, **tol, msg=f"{name} numel {numel} {dtype}")


def _wrong_world(rank: int, world: int) -> str:
    from syncplane.exchanges.tree.executor import FlexReduce
    from syncplane.exchanges.tree.tree import from_host_sizes
    from syncplane.config import ConfigError

    try:
        FlexReduce(from_host_sizes([2, 1]))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_tree_not_covering_world_fails_on_every_rank() -> None:
    messages = run_distributed(_wrong_world, 2)
    assert all("tree covers 3 ranks" in m and "job has 2 processes" in m for m in messages), messages
