"""Every third-party module the package imports is declared in ``pyproject.toml``: the core's
in ``dependencies``, the rest in an extra (``vision``, ``nlp``, ``ft``, ``wandb``, ``dev``) -- so a
``pip install`` of the wheel brings what its imports need."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "src" / "syncplane", ROOT / "strategies", ROOT / "recipes"]
#: modules that name no distribution of their own on PyPI, with the one that provides them
PROVIDED_BY = {"yaml": "pyyaml", "sklearn": "scikit-learn", "hydra": "hydra-core", "grimp": "import-linter",
               "importlinter": "import-linter"}
#: imported by a tool only, and installed by its own script rather than pip's extras
BUILT_APART = {"horovod": "scripts/setup_horovod.sh (the Horovod comparison peer of experiments/peer_loop.py)"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, str]:
    """Distribution -> where it is declared (``core`` or the extra's name)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {normalize(re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0]): "core" for d in project["dependencies"]}
    for extra, deps in project.get("optional-dependencies", {}).items():
        for d in deps:
            found.setdefault(normalize(re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0]), extra)
    return found


def imported_modules(paths: list[Path]) -> dict[str, str]:
    """Top-level module -> one file that imports it (absolute imports, stdlib and syncplane left out)."""
    found: dict[str, str] = {}
    for path in sorted(p for folder in paths for p in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("syncplane", "__future__"):
                    found.setdefault(top, str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    return found


def distribution_of(module: str) -> str:
    if module in PROVIDED_BY:
        return PROVIDED_BY[module]
    dists = importlib.metadata.packages_distributions().get(module)
    return normalize(dists[0]) if dists else normalize(module)


def undeclared(modules: dict[str, str], known: dict[str, str]) -> list[str]:
    return [f"{module} (imported by {where}; distribution {distribution_of(module)})"
            for module, where in sorted(modules.items())
            if normalize(distribution_of(module)) not in known and module not in BUILT_APART]


def test_every_imported_third_party_module_is_declared():
    missing = undeclared(imported_modules(SOURCES), declared())
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)


def test_the_core_needs_no_wandb():
    assert declared().get("wandb") == "wandb"   # the extra, not the core


def test_the_check_finds_an_undeclared_import(tmp_path):
    (tmp_path / "m.py").write_text("import numpy\nfrom typing_extensions import override\nimport somethingelse.x\n")
    missing = undeclared(imported_modules([tmp_path]), {"numpy": "core"})
    assert [m.split(" ")[0] for m in missing] == ["somethingelse", "typing_extensions"]
