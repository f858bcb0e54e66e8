"""``sharded.materialize`` and the node engine's refusal of a meta model it cannot make (one
process: the sharded case runs on real gloo ranks in ``tests/dist/test_diloco_nodes.py``)."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.sharded import materialize, on_meta


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def test_materialize_gives_every_parameter_and_buffer_the_value_init_makes_whole():
    seed = int(torch.randint(0, 2**20, ()))
    reference = _model()
    torch.manual_seed(seed)
    for t in reference.parameters():
        t.data.normal_()
    values = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    with torch.device("meta"):
        model = _model()
    assert on_meta(model) and not on_meta(reference)
    materialize(model, lambda name, t: t.copy_(values[name]))
    assert not on_meta(model)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, values[name]), name


@pytest.mark.parametrize("inner, init", [("ddp", lambda name, t: None), ("fsdp", None)])
def test_a_meta_model_needs_fsdp_and_an_init(inner, init):
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.algorithms.diloco.node import NodeEngine
    from syncplane.job import JobContext

    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match="meta device needs inner='fsdp' and an init"):
        NodeEngine(model, DiLoCoConfig(replica="node", exchange="mesh"), JobContext(rank=0, world_size=4),
                   ReplicaLayout.of_sizes([2, 2], inner), init=init)
