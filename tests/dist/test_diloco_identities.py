"""The identities of DiLoCo's round logic on real gloo ranks (``transport.GLOO``), the same
schedule (``_drive``) as the in-process fake test (``tests/unit/test_diloco_fake.py``), fresh
random inputs every run, all cases in one spawn of 3 processes (and one of 5):

- One-rank nodes (``replica=rank``), every schedule of the fake test's ``CASES`` (Nesterov,
  P = 3 τ = 0, P = 2 τ = 1), int8 on the mesh (encoded twice a round, as the fake and the
  reference play it) and the sparse codec on the gather: the dense reference (1e-5), and the
  in-process fake's result for the same seed bit for bit (``torch.equal``).
- P = 1, τ = 0 with int8 on the mesh: the round launched in the background and merged at once is the
  blocking round bit for bit.
- DDP nodes of 2 + 1 + 2 ranks (Nesterov, P = 2 τ = 1): the dense reference of rank-weighted
  replicas; with int8 on the mesh (each shard's exchange cut at its own segments, which the
  reference does not follow), the fake bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.fake_transport import run_ranks
from tests.unit.test_diloco_fake import CASES, _check, _drive, _reference

ONE_RANK = ["nesterov", "P3-tau0", "P2-tau1", "int8-P2", "sparse"]
NODES = ["nesterov", "P2-tau1"]
STEPS = 12
BLOCKING = {"sync_every": 3, "compression": "int8", **CASES["nesterov"]}


def _on_gloo(rank: int, world: int, sizes: list[int], cases: list[str], seed: int, background: bool) -> dict:
    """Every case's ``_drive`` on real gloo ranks; with ``background``, also P = 1 τ = 0 both ways."""
    from syncplane.algorithms.diloco.transport import GLOO

    out = {case: _drive(GLOO, rank, world, sizes, dict(CASES[case]), seed, STEPS) for case in cases}
    if background:
        out["blocking"] = _drive(GLOO, rank, world, sizes, dict(BLOCKING), seed, 9)
        out["background"] = _drive(GLOO, rank, world, sizes, dict(BLOCKING), seed, 9, None, True)
    return out


@pytest.fixture(scope="module")
def one_rank() -> tuple[int, list[dict]]:
    """The one spawn of 3 gloo ranks: every case, and P = 1 τ = 0 both ways."""
    seed = int(torch.randint(0, 2**20, ()))
    return seed, run_distributed(_on_gloo, 3, [1, 1, 1], ONE_RANK, seed, True, timeout=180)


@pytest.mark.parametrize("case", ONE_RANK)
def test_one_rank_nodes_on_gloo_are_the_reference_and_the_fake_bit_for_bit(one_rank, case):
    (seed, gloo), sizes = one_rank, [1, 1, 1]
    results = [ranks[case] for ranks in gloo]
    _check(results, sizes, _reference(sizes, CASES[case], seed, STEPS))
    fake = run_ranks(_drive, 3, sizes, dict(CASES[case]), seed, STEPS)
    for (a, ga, _), (b, gb, _) in zip(results, fake):
        assert torch.equal(a, b) and torch.equal(ga, gb)


def test_fragments1_overlap0_in_the_background_on_gloo_is_the_blocking_round_bit_for_bit(one_rank):
    for ranks in one_rank[1]:
        (a, ga, _), (b, gb, _) = ranks["blocking"], ranks["background"]
        assert torch.equal(a, b) and torch.equal(ga, gb)


def test_ddp_nodes_of_uneven_size_on_gloo_run_the_schedule_of_rank_weighted_replicas():
    seed, sizes = int(torch.randint(0, 2**20, ())), [2, 1, 2]
    gloo = run_distributed(_on_gloo, 5, sizes, [*NODES, "int8-P2"], seed, False, timeout=180)
    for case in NODES:
        _check([ranks[case] for ranks in gloo], sizes, _reference(sizes, CASES[case], seed, STEPS))
    fake = run_ranks(_drive, 5, sizes, dict(CASES["int8-P2"]), seed, STEPS)
    for ranks, (b, gb, _) in zip(gloo, fake):
        (a, ga, _) = ranks["int8-P2"]
        assert torch.equal(a, b) and torch.equal(ga, gb)
