"""What the docs test reads out of a Markdown page, and the checks that need no launch.

Pure functions over a page's text, so ``tests/unit/test_docs_checker.py`` can feed each one
a planted bad snippet and ``tests/unit/test_docs_commands.py`` the real pages:

- ``commands``: every command a reader is told to type -- lines of fenced shell blocks and
  inline code spans in prose and tables (a span is a command when it starts with a program
  the test knows *and* has an argument: a bare `syncplane bench` names the command);
- ``config_keys``: dotted keys (``strategy.kwargs.X``, ``trainer.X``, ``recipe.X``) and the
  first column of a page's configuration tables (header ``key``), checked against the
  configs' YAML and the strategies' accepted settings by ``unknown_keys``;
- ``strategy_table_names``: the strategies a page's strategy table lists (header ``name``
  or ``strategy`` and a first column of backticked names), for ``registry_mismatch``;
- ``broken_links``: relative links whose file, or ``#anchor`` heading, does not exist;
- ``hand_figures``: measured figures a guide states by hand (a speed-up ``1.73×``, a count
  ``131 of 154 rows``) outside the blocks ``scripts/results.py`` generates from the data;
- ``dated_headings``: headings that carry a date (a lab notebook's entries).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
ANY_BLOCK = re.compile(r"```.*?```", re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
CHECKED_PREFIXES = ("python train.py", "syncplane ", "python -m ", "python scripts/", "make ", "torchrun ", "srun ")
#: A span that abbreviates a command (``…``) or holds a placeholder is prose, not a command.
ABBREVIATED = re.compile(r"…|\.\.\.|<[^>]+>|\b(?:KEY|VALUE|NAME|N|P|S)\b")
DOTTED_KEY = re.compile(r"(?<![\w.$/-])(strategy\.kwargs|trainer|recipe)\.([a-z_][a-z0-9_]*)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _without_blocks(text: str) -> str:
    return ANY_BLOCK.sub("", text)


def _is_command(line: str) -> bool:
    return line.startswith(CHECKED_PREFIXES) and not ABBREVIATED.search(line)


def commands(text: str, inline: bool = True) -> list[str]:
    """Every command of a page: shell-block lines (continuations joined, comments dropped)
    and inline spans with at least one argument, ``a|b|c`` tokens expanded."""
    lines = []
    for block in SHELL_BLOCK.findall(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith(CHECKED_PREFIXES) and not re.search(r"<[^>]+>", line):
                lines.append(line)
    for span in INLINE.findall(_without_blocks(text)) if inline else []:
        span = span.strip()
        if _is_command(span) and len(shlex.split(span, comments=True)) > (3 if span.startswith("python ") else 2):
            lines.append(span)
    found: list[str] = []
    for line in lines:
        for variant in _expand(shlex.split(line, comments=True)):
            command = shlex.join(variant)
            if command not in found:
                found.append(command)
    return found


def _expand(tokens: list[str]) -> list[list[str]]:
    """``up|down|status`` -> three commands (a token without ``=`` whose parts are words)."""
    for i, token in enumerate(tokens):
        if "|" in token and "=" not in token and all(part.isidentifier() for part in token.split("|")):
            return [variant for part in token.split("|") for variant in _expand(tokens[:i] + [part] + tokens[i + 1:])]
    return [tokens]


def config_keys(text: str, strategy_page: bool = False) -> list[tuple[str, str]]:
    """(namespace, key) for every dotted config key and, on a strategy page, every
    configuration-table row (a table whose header's first cell is ``key``: its rows name
    ``strategy.kwargs`` keys unless the cell is dotted itself)."""
    found = [(ns, key) for ns, key in DOTTED_KEY.findall(text)]
    for table in _tables(_without_blocks(text)) if strategy_page else []:
        if table[0][0].strip().lower() != "key":
            continue
        for row in table[1:]:
            for name in re.findall(r"`([^`]+)`", row[0]):
                if not re.fullmatch(r"[a-z_][a-z0-9_.]*", name):
                    continue                   # a pattern (`h_*`), not a key
                dotted = DOTTED_KEY.fullmatch(name)
                found.append((dotted.group(1), dotted.group(2)) if dotted else ("strategy.kwargs", name))
    return found


def unknown_keys(keys: Iterable[tuple[str, str]], known: dict[str, set[str]]) -> list[str]:
    """The keys of ``keys`` that no YAML file or strategy setting has (``known``: namespace -> names)."""
    return sorted({f"{ns}.{key}" for ns, key in keys if key not in known.get(ns, set())})


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables as rows of cells (the separator row dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            cells = [c.strip() for c in stripped.strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells if c):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def strategy_table_names(text: str, headers: tuple[str, ...] = ("strategy",)) -> list[list[str]]:
    """For each strategy table (header's first cell one of ``headers``, rows naming
    backticked strategies, several per cell allowed), the names it lists."""
    found = []
    for table in _tables(_without_blocks(text)):
        if table[0][0].strip().lower() not in headers:
            continue
        names = [n for row in table[1:] for n in re.findall(r"`([a-z][a-z0-9_]*)`", row[0])]
        if names:
            found.append(names)
    return found


def registry_mismatch(listed: Iterable[str], registered: Iterable[str]) -> str | None:
    """What a table that claims to list the strategies gets wrong, or None."""
    listed, registered = set(listed), set(registered)
    problems = []
    if listed - registered:
        problems.append(f"not registered: {', '.join(sorted(listed - registered))}")
    if registered - listed:
        problems.append(f"missing: {', '.join(sorted(registered - listed))}")
    return "; ".join(problems) or None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(_without_blocks(text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(page: Path, text: str, read: Callable[[Path], str | None]) -> list[str]:
    """Relative links of ``page`` whose target file does not exist (``read`` returns None)
    or whose ``#anchor`` names no heading of the target."""
    broken = []
    for target in LINK.findall(_without_blocks(text)):
        if re.match(r"[a-z]+:", target):
            continue                           # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        body = read(dest)
        if body is None:
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(body):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


#: A generated block (``scripts/results.py``): its figures come from the committed data.
GENERATED_BLOCK = re.compile(r"<!-- results:(?P<key>\S+) -->\n.*?<!-- /results:(?P=key) -->", re.S)
#: A measured ratio (``1.73×``, ``6 ×``: not the ``2 × 1024`` of a shape) or a count of measured cells.
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?×(?!\s?\d)"
                    r"|\b\d+ of \d+ (?:cells|rows|measured rows|predictions|profiles)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def hand_figures(text: str) -> list[str]:
    """The measured figures of a page outside its generated blocks and code blocks: a guide
    shows a figure through a block (``<!-- results:KEY -->``) or links to the results page."""
    plain = ANY_BLOCK.sub("", GENERATED_BLOCK.sub("", text))
    return [m.group(0) for m in FIGURE.finditer(plain)]


def dated_headings(text: str) -> list[str]:
    """Headings with a date in them: a diary's entries, which belong to git's history."""
    return [h for h in HEADING.findall(_without_blocks(text)) if DATE.search(h)]
