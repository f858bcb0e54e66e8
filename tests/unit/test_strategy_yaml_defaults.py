"""A strategy's YAML states no default its config class states otherwise.

``configs/strategy/<name>.yaml`` lists a strategy's usual keys with their values; the family's
frozen config class (``syncplane.algorithms.<family>.config``) is where defaults live. Where both
name a key, they must agree, or the docs generated from one contradict the keyword arguments
taken from the other. A planted disagreement is found, so the check can fail."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
#: strategy name -> the family whose ``config`` module holds its config classes
FAMILIES = {"atc": "decentralized", "awc": "decentralized", "h_atc": "decentralized", "h_awc": "decentralized",
            "canary": "canary", "diloco": "diloco", "ds_sync": "ds_sync"}


def config_defaults(family: str) -> dict[str, Any]:
    """Every field default of the family's config dataclasses (the first class naming a key wins)."""
    module = importlib.import_module(f"syncplane.algorithms.{family}.config")
    defaults: dict[str, Any] = {}
    for value in vars(module).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == module.__name__:
            for field in dataclasses.fields(value):
                if field.default is not dataclasses.MISSING:
                    defaults.setdefault(field.name, field.default)
                elif field.default_factory is not dataclasses.MISSING:
                    defaults.setdefault(field.name, field.default_factory())
    return defaults


def disagreements(settings: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """``key: yaml X, config Y`` for each key both name with different values."""
    return [f"{key}: yaml {value!r}, config {defaults[key]!r}" for key, value in settings.items()
            if key in defaults and value != defaults[key]]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_strategy_yaml_agrees_with_its_config_class(name):
    settings = yaml.safe_load((ROOT / "configs" / "strategy" / f"{name}.yaml").read_text())["kwargs"] or {}
    defaults = config_defaults(FAMILIES[name])
    assert set(settings) & set(defaults), f"{name}: no YAML key is a field of its config classes (a renamed module?)"
    bad = disagreements(settings, defaults)
    assert not bad, f"configs/strategy/{name}.yaml contradicts its config class: {'; '.join(bad)}"


def test_a_planted_disagreement_is_named():
    assert disagreements({"sync_every": 11, "streams": 1}, {"sync_every": 10, "streams": 1}) == [
        "sync_every: yaml 11, config 10"]
