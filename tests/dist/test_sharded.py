"""``syncplane.algorithms.sharded`` on 2 real gloo ranks: which submodules become FSDP2 units
(size, the root's children, tied parameters kept in one unit), and a rank's plain shards
(what its replica file holds) going back into the sharded model and its optimizer exactly."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed


class Tied(torch.nn.Module):
    """An embedding tied to the output layer (BERT's word embeddings and MLM decoder), two
    blocks between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(ids)))


def units_and_roundtrip(rank: int, world: int, seed: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    from syncplane.algorithms.sharded import load_module_state, optimizer_state_like, plain, shard_module, whole

    torch.manual_seed(seed)
    root = torch.nn.Module()
    root.model = Tied()
    shard_module(root, DeviceMesh.from_group(dist.group.WORLD, "cpu"), unit_params=40)
    units = sorted(n for n, m in root.named_modules() if isinstance(m, FSDPModule))
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(2):
        optimizer.zero_grad()
        root.model(torch.randint(0, 10, (4, 3), generator=g)).square().mean().backward()
        optimizer.step()
    saved_model, saved_opt = plain(root.state_dict()), plain(optimizer.state_dict())
    consensus = whole(root.state_dict())
    with torch.no_grad():
        for p in root.parameters():
            p.zero_()
    load_module_state(root, consensus)   # the whole tensors: each rank takes its part
    after_whole = plain(root.state_dict())
    for p in root.parameters():
        p.data.to_local().zero_()
    load_module_state(root, saved_model)   # this rank's plain shards
    fresh = torch.optim.SGD(root.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(optimizer_state_like(saved_opt, list(root.parameters())))
    fresh.step()   # DTensor momentum again: the step runs
    return units, saved_model, after_whole, plain(root.state_dict()), root.model.out.weight is root.model.embed.weight


def test_units_keep_tied_parameters_together_and_plain_shards_load_back_exactly():
    seed = int(torch.randint(0, 2**20, ()))
    for units, saved, after_whole, after_plain, tied in run_distributed(units_and_roundtrip, 2, seed, timeout=120):
        # each block (42 values) is a unit; the embedding (60, tied to ``out``) stays in the top unit
        assert units == ["model", "model.blocks.0", "model.blocks.1"] and tied
        for key, value in saved.items():
            assert torch.equal(after_whole[key], value)
        assert not all(torch.equal(after_plain[k], v) for k, v in saved.items())   # the step moved them
