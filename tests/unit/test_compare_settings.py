"""``syncplane compare``'s bad input: named, before any run starts."""

from __future__ import annotations

import pytest

from syncplane.config import ConfigError
from syncplane.experiments.comparison import CompareSettings, compose, dir_name, parse_list, parse_variant
from syncplane.experiments.peers import _diloco_settings, network_spec, unavailable_reason


@pytest.mark.parametrize("changes,message", [
    ({"strategies": ["ddp", "nope"]}, "--strategies: unknown strategy or peer 'nope'"),
    ({"strategies": ["ddp", "ddp"]}, "names a strategy twice"),
    ({"target_acc": 1.5}, "--target-acc: must be in (0, 1], got 1.5"),
    ({"target_loss": 0.0}, "--target-loss: must be positive, got 0.0"),
    ({"target_acc": 0.8, "target_loss": 3.0}, "--target-acc, --target-loss: give one target, not both"),
    ({"seeds": []}, "--seeds: give at least one seed"),
    ({"devices": 0}, "--devices: must be at least 1, got 0"),
    ({"strategies": ["diloco[compression=int8]", "diloco[compression=int8]"]}, "names a strategy twice"),
    ({"strategies": ["nope[a=1]"]}, "--strategies: unknown strategy or peer 'nope'"),
    ({"strategies": ["horovod[a=1]"]}, "a peer takes no [key=value] options"),
    ({"strategies": ["diloco[compression]"]}, "'compression' is not key=value"),
    ({"strategies": ["diloco[compression=int8"]}, "expected NAME[key=value,...]"),
])
def test_bad_settings_are_named(changes, message):
    settings = CompareSettings(recipe="digits", strategies=["ddp", "torchft_diloco", "horovod"])
    for key, value in changes.items():
        setattr(settings, key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        settings.validate()


def test_missing_horovod_says_how_to_install(tmp_path):
    reason = unavailable_reason("horovod", tmp_path / "none")
    assert reason is not None and reason.startswith("not available: run scripts/setup_horovod.sh")


def test_torchft_peer_takes_our_diloco_settings_or_refuses():
    assert _diloco_settings({"sync_every": 7, "outer_kwargs": None}) == {
        "sync_every": 7, "outer_optimizer": "torch.optim.SGD", "outer_kwargs": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "foreach": True},
        "sync_timeout_s": 600.0}
    with pytest.raises(ConfigError, match="strategy.kwargs.fragments: 2"):
        _diloco_settings({"fragments": 2})


def test_network_spec_round_trips_and_refuses_unknown_layers():
    import torch
    from torch import nn

    from syncplane.experiments.peer_loop import build_network

    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Dropout(0.25), nn.Linear(4 * 14 * 14, 10, bias=False))
    rebuilt = build_network(network_spec(net))
    rebuilt.load_state_dict(net.state_dict())
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    net.eval(), rebuilt.eval()
    assert torch.equal(net(x), rebuilt(x))
    with pytest.raises(ConfigError, match="cannot rebuild layer LSTM"):
        network_spec(nn.Sequential(nn.LSTM(4, 4)))
    with pytest.raises(ConfigError, match="nn.Sequential"):
        network_spec(nn.Linear(2, 2))


def test_variants_split_by_brackets_and_compose_as_strategy_kwargs():
    items = parse_list("ddp, diloco[compression=sparse,density=0.01] ,diloco[compression=int8]", "--strategies")
    assert items == ["ddp", "diloco[compression=sparse,density=0.01]", "diloco[compression=int8]"]
    assert parse_variant(items[1]) == ("diloco", [("compression", "sparse"), ("density", "0.01")])
    assert parse_variant("ddp") == ("ddp", [])
    assert dir_name(items[1]) == "diloco-compression-sparse-density-0.01"
    for text in ("ddp,diloco[a=1", "ddp]", "diloco[[a=1]]"):
        with pytest.raises(ConfigError, match="--strategies: unbalanced brackets"):
            parse_list(text, "--strategies")
    settings = CompareSettings(recipe="digits", strategies=items, wandb=False)
    settings.validate()
    job = compose(settings, items[1], 7, "g")
    assert job["strategy"]["name"] == "diloco" and job["label"] == items[1] and job["seed"] == 7
    assert job["strategy"]["kwargs"]["compression"] == "sparse" and job["strategy"]["kwargs"]["density"] == 0.01
    plain = compose(settings, "ddp", 7, "g")
    assert plain["label"] is None and plain["strategy"]["name"] == "ddp"
