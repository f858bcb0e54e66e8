"""``sharded.materialize`` and the node engine's refusal of a meta model it cannot make (one
process: the sharded case runs on real gloo ranks in ``tests/dist/test_diloco_nodes.py``)."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.sharded import materialize, on_meta, reset_init


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def _deeper() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Sequential(torch.nn.Linear(4, 3)),
                               torch.nn.LayerNorm(3), torch.nn.Embedding(7, 3))


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


def test_reset_init_makes_the_model_torch_would_have_built_from_the_same_seed():
    seed = int(torch.randint(0, 2**20, ()))
    torch.manual_seed(seed)
    eager = _deeper()
    with torch.device("meta"):
        model = _deeper()
    torch.manual_seed(seed)
    materialize(model, reset_init(model))
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_reset_init_refuses_a_module_without_reset_parameters_by_name():
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\) has tensors and no reset_parameters"):
        materialize(model, reset_init(model))


@pytest.mark.parametrize("inner, init", [("ddp", lambda name, t: None), ("fsdp", None)])
def test_a_meta_model_needs_fsdp_and_an_init(inner, init):
    from syncplane.algorithms.diloco.config import DiLoCoConfig
    from syncplane.algorithms.diloco.layout import ReplicaLayout
    from syncplane.algorithms.diloco.engine import DiLoCoEngine
    from syncplane.job import JobContext

    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match="meta device needs inner='fsdp' and an init"):
        DiLoCoEngine(model, DiLoCoConfig(replica="node", exchange="mesh"), JobContext(rank=0, world_size=4),
                   ReplicaLayout.of_sizes([2, 2], inner), init=init)


@pytest.mark.parametrize("kwargs", [{}, {"replica": "node", "inner": "ddp"}])
def test_a_strategy_that_cannot_make_a_meta_model_refuses_it_by_name(kwargs):
    from syncplane.strategies.diloco import DiLoCo

    strategy = DiLoCo(**kwargs)
    with torch.device("meta"):
        strategy.model = _model()
    with pytest.raises(ValueError, match="meta device.*replica=node and strategy.kwargs.inner=fsdp"):
        strategy.model_to_device()
    assert not strategy.makes_meta_models()
    assert DiLoCo(replica="node", inner="fsdp").makes_meta_models()
