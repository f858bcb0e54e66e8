"""syncplane.recipes: model + data for a job, independent of the strategy that runs it.

A recipe is a name, a settings dataclass (its ``recipe.*`` config schema) and a
function building ``(LightningModule, LightningDataModule)`` from those settings.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl


@dataclass(frozen=True)
class Recipe:
    name: str
    settings: type
    build: Callable[[Any], tuple[pl.LightningModule, pl.LightningDataModule]]
    description: str


# name -> module that defines RECIPE; imported lazily so that heavy optional
# dependencies (torchvision, transformers) load only for the recipe that needs them.
_MODULES = {
    "digits": "syncplane.recipes.digits",
    "fashion_mnist": "syncplane.recipes.fashion_mnist",
    "resnet50_imagenet": "syncplane.recipes.resnet50_imagenet",
    "bert_large": "syncplane.recipes.bert_large",
    "tiny_lm": "syncplane.recipes.tiny_lm",
}


def names() -> list[str]:
    return list(_MODULES)


def get(name: str) -> Recipe:
    try:
        module = importlib.import_module(_MODULES[name])
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; allowed values: {', '.join(names())}") from None
    recipe = module.RECIPE
    assert isinstance(recipe, Recipe) and recipe.name == name
    return recipe
