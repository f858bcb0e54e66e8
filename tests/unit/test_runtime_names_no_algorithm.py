"""No file of ``syncplane.runtime`` names an algorithm: switching, elastic launch and the
pre-launch checks go through the family's ``AlgorithmSpec`` (import-linter holds the imports:
``tests/unit/test_layers.py``; this test holds the text, code and docs alike), and a planted
mention fails naming its file and line.

The names are the catalogue's (every strategy and family of ``syncplane.algorithms.SPECS``)
and the papers' behind them, except the baseline ``ddp``: it is Lightning's own DDP, which every
job can run and the runtime meters and compares against, and ``peers``, a package named by a
plain word (its strategies' names are checked)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "src" / "syncplane" / "runtime"
#: names of the algorithms that no strategy name spells out
PAPERS = ("sparseloco", "powersgd", "dilocox")
#: shorter names match only as a word of their own ("atc" is in "batch")
WORD_BELOW = 6


def algorithm_names() -> list[str]:
    """Every name an algorithm goes by (module doc), lower case, longest first."""
    from syncplane import algorithms
    from syncplane.strategies.registry import BASELINE

    names = {name for spec in algorithms.SPECS for name in spec.strategies}
    names |= {spec.family for spec in algorithms.SPECS} - {"peers"}
    names |= set(PAPERS)
    names -= {BASELINE, algorithms.ddp.SPEC.family}
    return sorted(names, key=lambda n: (-len(n), n))


def algorithm_mentions(root: Path, names: Iterable[str]) -> list[str]:
    """``path:line: names 'NAME'`` for each line of a ``.py`` file under ``root`` that names
    one of ``names`` (case-insensitive; a name shorter than ``WORD_BELOW`` only as a word)."""
    patterns = [(name, re.compile(re.escape(name) if len(name) >= WORD_BELOW
                                  else rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])", re.IGNORECASE))
                for name in names]
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            named = [name for name, pattern in patterns if pattern.search(line)]
            if named:
                found.append(f"{path.relative_to(root.parent)}:{number}: names {', '.join(map(repr, named))}")
    return found


def test_the_catalogue_gives_the_names_checked() -> None:
    names = algorithm_names()
    assert {"diloco", "canary", "ds_sync", "flexreduce", "atc", "h_awc", "torch_powersgd", "torch_hooks"} <= set(names)
    assert "ddp" not in names


def test_no_runtime_file_names_an_algorithm() -> None:
    mentions = algorithm_mentions(RUNTIME, algorithm_names())
    assert not mentions, "the runtime names an algorithm (go through its AlgorithmSpec):\n" + "\n".join(mentions)


def test_a_planted_name_fails_naming_the_file_and_line(tmp_path: Path) -> None:
    copy = tmp_path / "runtime"
    shutil.copytree(RUNTIME, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "replan.py"
    lines = target.read_text().splitlines()
    target.write_text("\n".join([*lines, "SWITCHABLE = {'DiLoCo': ()}  # the batch's match",
                                 "if name == 'atc':", ""]))
    assert algorithm_mentions(copy, algorithm_names()) == [
        f"runtime/replan.py:{len(lines) + 1}: names 'diloco'", f"runtime/replan.py:{len(lines) + 2}: names 'atc'"]
