"""Config validation: every bad value names its key and what is allowed."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Literal

import pytest

from syncplane.config import ConfigError
from syncplane.runtime.settings import parse_job

GOOD = {
    "strategy": {"name": "ddp", "kwargs": {}},
    "recipe": {"name": "digits", "batch_size": 32, "lr": 0.05},
    "trainer": {"accelerator": "cpu", "devices": 2, "max_epochs": 1},
    "logger": {"csv": True, "wandb": False},
    "seed": 1,
    "resume": None,
}


def with_change(path: str, value):
    cfg = copy.deepcopy(GOOD)
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    node[leaf] = value
    return cfg


def test_good_config_parses_into_typed_settings():
    spec = parse_job(GOOD, run_dir="/tmp/x")
    assert spec.strategy.name == "ddp"
    assert spec.recipe.lr == 0.05 and spec.recipe.batch_size == 32
    assert spec.trainer.devices == 2


@pytest.mark.parametrize("path,value,message", [
    ("strategy.name", "nope", r"strategy.name: unknown strategy 'nope'; allowed values: ddp"),
    ("recipe.name", "imagenet1k", r"recipe.name: unknown recipe 'imagenet1k'; allowed values: digits"),
    ("trainer.devices", 0, r"trainer.devices: must be at least 1, got 0"),
    ("recipe.lr", "abc", r"recipe.lr: expected a number, got 'abc'"),
    ("recipe.lr", -1.0, r"recipe.lr: must be positive"),
    ("recipe.batchsize", 3, r"recipe: unknown key\(s\) batchsize; allowed keys: batch_size"),
    ("trainer.accelerator", "tpu", r"trainer.accelerator: got 'tpu', allowed values: 'cpu', 'gpu'"),
    ("strategy.kwargs", {"bucket_cap": 3}, r"strategy.kwargs: unknown key\(s\) bucket_cap; allowed keys: .*bucket_cap_mb"),
    ("strategy.kwargs", {"model_averaging_period": "often"}, r"strategy.kwargs.model_averaging_period: expected an integer or null"),
    ("resume", "/does/not/exist.ckpt", r"resume: expected the path of an existing checkpoint file"),
    ("seed", "x", r"seed: expected an integer"),
    ("trainer.heartbeat_timeout_s", -1, r"trainer.heartbeat_timeout_s: must be >= 0 \(0 = no heartbeat\), got -1"),
    ("fault", {"kind": "explode"}, r"fault.kind: got 'explode', allowed values: 'kill', 'stop', 'raise'"),
    ("fault", {"step": 0}, r"fault.step: must be >= 1, got 0"),
])
def test_bad_values_name_the_key(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(with_change(path, value), run_dir="/tmp/x")


def test_unknown_top_level_key():
    cfg = copy.deepcopy(GOOD)
    cfg["trainr"] = {}
    with pytest.raises(ConfigError, match="unknown top-level key"):
        parse_job(cfg, run_dir="/tmp/x")


def test_a_gpu_job_without_nvcc_is_refused_before_launch(monkeypatch, tmp_path):
    """On a GPU the strategies' CUDA kernels compile on first use: with no nvcc (and nothing
    cached) the job stops in the launching process, saying what to install."""
    from syncplane import ext
    from syncplane.runtime.settings import parse_job

    monkeypatch.setattr(ext, "_find_cuda_home", lambda: None)
    monkeypatch.setattr(ext, "_load", lambda *args, **kwargs: None)       # nothing cached
    cfg = {"strategy": {"name": "atc", "kwargs": {}}, "recipe": {"name": "digits"},
           "trainer": {"accelerator": "gpu", "devices": 1}, "seed": 1}
    import torch

    if torch.version.cuda is None:
        message = "CPU-only build"
    else:
        message = "need nvcc"
    with pytest.raises(ConfigError, match=f"trainer.accelerator=gpu: strategy 'atc' runs syncplane's CUDA kernels; "
                                          f".*{message}"):
        parse_job(cfg, run_dir=str(tmp_path))
    cfg["strategy"]["name"] = "ddp"
    parse_job(cfg, run_dir=str(tmp_path))                                  # DDP needs no kernels of ours


@dataclasses.dataclass(frozen=True)
class Settings:
    every: int = 10
    mode: Literal["a", "b"] = "a"
    shared: float = 1.0


def test_a_constructor_takes_its_configs_fields_with_the_configs_defaults_and_types():
    """``takes_fields_of``: the config's fields join the constructor's signature (keyword-only,
    before ``**kwargs``), so the schema checks them, and a field the constructor names itself keeps
    the constructor's parameter."""
    from syncplane.config import check_kwargs, signature_params, takes_fields_of

    class Thing:
        @takes_fields_of(Settings)
        def __init__(self, shared: float = 2.0, **kwargs: object) -> None:
            self.settings = Settings(**{k: kwargs.pop(k) for k in ("every", "mode") if k in kwargs}, shared=shared)
            self.rest = kwargs

    params = inspect.signature(Thing.__init__).parameters
    assert list(params) == ["self", "shared", "every", "mode", "kwargs"]
    assert params["shared"].default == 2.0 and params["every"].default == 10 and params["mode"].default == "a"
    assert params["every"].kind is inspect.Parameter.KEYWORD_ONLY
    schema = signature_params(Thing.__init__)
    assert schema == {"shared": float, "every": int, "mode": Literal["a", "b"]}
    assert check_kwargs(schema, {"every": 3, "mode": "b"}, "thing") == {"every": 3, "mode": "b"}
    for bad in ({"every": "3"}, {"mode": "c"}):
        with pytest.raises(ConfigError, match=f"thing.{next(iter(bad))}"):
            check_kwargs(schema, bad, "thing")
    thing = Thing(every=3, other=1)
    assert thing.settings == Settings(every=3, mode="a", shared=2.0) and thing.rest == {"other": 1}
