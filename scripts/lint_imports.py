"""Check the layer contracts (``[tool.importlinter]`` in pyproject.toml), that ``src/`` has
no import cycle, and that the fork server preloads no tool module: ``python scripts/lint_imports.py`` (``make lint``; CI runs it through
``tests/unit/test_layers.py``).

Why a wrapper around ``lint-imports``: import-linter builds its graph by walking the
``syncplane`` package's folder, but ``syncplane.strategies`` and ``syncplane.recipes`` are
installed from the top-level ``strategies/`` and ``recipes/`` folders (the product's
layout), which that walk cannot see. So the package is staged in a temporary folder in
its installed shape, and import-linter runs on that.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def stage(into: Path) -> Path:
    """Copy the package's sources into ``into/syncplane`` in their installed shape."""
    pkg = into / "syncplane"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "csrc")
    src = ROOT / "src" / "syncplane"

    def ignore_in_src(folder: str, names: list[str]) -> set[str]:
        # a development checkout may link strategies/ and recipes/ into the package: staged below
        linked = {n for n in ("strategies", "recipes") if Path(folder) == src and (src / n).is_symlink()}
        return set(ignore(folder, names)) | linked

    shutil.copytree(src, pkg, ignore=ignore_in_src)
    shutil.copytree(ROOT / "strategies", pkg / "strategies", ignore=ignore)
    shutil.copytree(ROOT / "recipes", pkg / "recipes", ignore=ignore)
    return into


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every import cycle among syncplane's modules (function-local imports included)."""
    import networkx as nx

    digraph = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            digraph.add_edge(module, imported)
    return [sorted(c) for c in nx.strongly_connected_components(digraph) if len(c) > 1]


#: What the product may not name, even as a string for the fork server to import.
TOOLS = ("syncplane.bench", "syncplane.experiments")


def tool_preloads(staged: Path) -> list[str]:
    """The tool modules the fork server's ``PRELOAD`` list names (the product imports them
    through it, where import-linter cannot see: a string, imported in the server)."""
    tree = ast.parse((staged / "syncplane" / "runtime" / "forkserver.py").read_text())
    names: list[str] | None = None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "PRELOAD" for t in targets) and node.value is not None:
            names = (names or []) + [e.value for e in ast.walk(node.value)
                                     if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if names is None:
        raise RuntimeError("runtime/forkserver.py has no PRELOAD list: update scripts/lint_imports.py")
    return [n for n in names if any(n == t or n.startswith(t + ".") for t in TOOLS)]


def check(staged: Path) -> int:
    """Run the contracts, the cycle check and the preload check on a staged copy; 0 when all pass."""
    env = {**os.environ, "PYTHONPATH": str(staged) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    contracts = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                "sys.exit(lint_imports_command())", "--config", str(ROOT / "pyproject.toml"),
                                "--no-cache"], env=env, cwd=staged)
    cycles = subprocess.run([sys.executable, "-c", (
        "import sys, grimp; sys.path.insert(0, %r); from lint_imports import import_cycles; "
        "cycles = import_cycles(grimp.build_graph('syncplane', cache_dir=None)); "
        "[print('import cycle: ' + ' <-> '.join(c)) for c in cycles]; sys.exit(1 if cycles else 0)"
    ) % str(Path(__file__).parent)], env=env, cwd=staged)
    if cycles.returncode == 0:
        print("no import cycles in syncplane")
    preloaded = tool_preloads(staged)
    for name in preloaded:
        print(f"the fork server preloads a tool module: {name} (runtime/forkserver.py PRELOAD; a tool adds its "
              "own with forkserver.preload)")
    if not preloaded:
        print("the fork server preloads no tool module")
    return 1 if contracts.returncode or cycles.returncode or preloaded else 0


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="syncplane-lint-") as tmp:
        return check(stage(Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
