"""No Lightning name with a leading underscore is used outside ``syncplane.lightning_adapter``:
no private import from Lightning, no access to an attribute that only Lightning defines, no
override of a private Lightning method (the adapter's tests then cover every private access)."""

from __future__ import annotations

import ast
import importlib
import inspect
from functools import cache
from pathlib import Path

import lightning

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "src" / "syncplane", ROOT / "strategies", ROOT / "recipes"]
ADAPTER = ROOT / "src" / "syncplane" / "lightning_adapter.py"


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def files(folders: list[Path]) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py") if p != ADAPTER)


def defined_names(paths: list[Path]) -> set[str]:
    """Private names these files define: functions and classes, ``self._x =`` targets, class
    and module attributes, function arguments."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)   # its own attribute (not one set on another library's object)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if private(n)}


@cache
def lightning_private_names() -> frozenset[str]:
    return frozenset(defined_names(sorted(Path(lightning.__file__).parent.rglob("*.py"))))


#: Layers that know no Lightning (the import contracts hold them to it): torch's own private
#: names there (``ProcessGroupGloo._Options``) are not this test's business.
NO_LIGHTNING = [ROOT / "src" / "syncplane" / name for name in ("comm", "exchanges", "algorithms", "cluster")]


def violations(paths: list[Path], own: set[str]) -> list[str]:
    """Private Lightning imports, and outside the layers that know no Lightning, accesses to
    private names that only Lightning defines."""
    lightning_names = lightning_private_names() - own
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        if any(path.is_relative_to(folder) for folder in NO_LIGHTNING):
            continue
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
                found += [f"{where}: from {node.module} import {a.name}" for a in node.names if private(a.name)]
            elif isinstance(node, ast.Import):
                found += [f"{where}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "lightning" and any(map(private, a.name.split(".")))]
            elif isinstance(node, ast.Attribute) and node.attr in lightning_names:
                found.append(f"{where}: .{node.attr}")
    return found


def lightning_overrides(paths: list[Path]) -> list[str]:
    """Private members of Lightning classes that a syncplane class defines again."""
    found = []
    for path in paths:
        source = path.read_text()
        if "lightning" not in source:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] == "src":
            parts = parts[1:]
        else:
            parts = ("syncplane", *parts)
        name = ".".join(p for p in parts if p != "__init__")
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in ("lightning", "pytorch_lightning")]
            found += [f"{name}.{cls.__name__}.{member} overrides {base.__qualname__}.{member}"
                      for member, value in vars(cls).items()
                      if private(member) and isinstance(value, (property, classmethod, staticmethod))
                      or private(member) and inspect.isfunction(value)
                      for base in bases[:1] if any(member in vars(b) for b in bases)]
    return found


def test_no_private_lightning_name_outside_the_adapter():
    paths = files(SOURCES)
    found = violations(paths, defined_names(paths)) + lightning_overrides(paths)
    assert not found, ("private Lightning API outside syncplane.lightning_adapter (move it there, with a test in "
                       "tests/unit/test_lightning_adapter.py):\n" + "\n".join(found))


def test_the_check_finds_each_kind_of_private_use(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from lightning.pytorch.overrides.distributed import _sync_module_states\n"
                       "def step(trainer):\n    return trainer.fit_loop._combined_loader\n")
    found = violations([planted], set())
    assert len(found) == 2 and "import _sync_module_states" in found[0] and "._combined_loader" in found[1]


def test_the_check_finds_a_private_override():
    from lightning.pytorch.strategies import DDPStrategy

    class Overriding(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            pass

    bases = [b for b in Overriding.__mro__[1:] if b.__module__.startswith("lightning")]
    assert any("_register_ddp_hooks" in vars(b) for b in bases)   # what lightning_overrides reads
