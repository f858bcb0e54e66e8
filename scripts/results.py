"""Every published figure from the committed JSON, by one command: ``python scripts/results.py``
(``make results``). Nothing runs; it reads what ``syncplane bench --matrix``, ``syncplane
compare`` and the other measurements committed under ``docs/`` and writes:

- ``docs/benchmarks.md``, the results page: a grid of every strategy on every shipped profile
  against DDP, the training headline, then one section per data source, each table with the
  date, commit and command of what it shows;
- the generated blocks of the guides: the lines between ``<!-- results:KEY -->`` and
  ``<!-- /results:KEY -->`` in ``README.md`` and ``docs/**/*.md`` are replaced by ``BLOCKS``'
  rendering of ``KEY`` (``speedups:canary,ds_sync``, ``training:diloco``, ``choosing``, …), so
  a guide never restates a figure by hand (``tests/unit/test_results_page.py`` fails on one);
- the references generated from the code: ``docs/reference/{cli,config,env,summary}.md``
  (``scripts/reference_docs.py``).

``--check`` writes nothing and exits 1 naming every file that is not what this would write (the
docs test runs it, so a changed JSON, flag or YAML key without a regenerated page fails).

Adding a section for a new JSON file is one function. For ``docs/results/lm_wan.json`` holding
``{"title", "created", "commit", "rows": [{"name", "command", "seeds": [{"seed", "val_loss",
...}]}]}`` it is ``lm_wan`` below::

    @section("results/lm_wan.json")
    def lm_wan(files: list[Source]) -> list[Table]:
        return [Table(title=..., header=[...], rows=[[...], ...], provenance=[...])]

``section(GLOB)`` registers it; it receives every file the glob matches under ``docs/`` (none:
no section) and returns the tables, which the page renders in registration order, each with its
provenance line. A file of the generic shape (``title``, ``created``, ``commit``, ``command``,
``columns``, ``rows``: a list of lists) under ``docs/results/`` needs no function at all
(``generic_tables``). A block for the guides is a function of ``BLOCKS``, keyed by its name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference_docs  # noqa: E402  (beside this script)
from lm_wan import chart_paths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = DOCS / "benchmarks.md"
COMMAND = "python scripts/results.py"
MIB = 2**20
BLOCK = re.compile(r"(<!-- results:(?P<key>[\w:,.\-\[\]=]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=key) -->)", re.S)


@dataclass(frozen=True)
class Source:
    """One committed JSON file and what it holds."""

    path: Path
    data: dict[str, Any]

    @property
    def rel(self) -> str:
        return self.path.relative_to(DOCS).as_posix()


@dataclass(frozen=True)
class Provenance:
    """When, at which commit and by which command a table's numbers were measured."""

    date: str
    commit: str
    command: str

    def text(self) -> str:
        return f"{self.date[:10]}, commit `{self.commit}`: `{self.command}`"


@dataclass
class Table:
    """A section of the results page: a titled table with its provenance and a short note."""

    title: str
    header: list[str]
    rows: list[list[str]]
    provenance: list[Provenance]
    intro: str = ""
    note: str = ""


@dataclass
class Registered:
    pattern: str
    render: Callable[[list[Source]], list[Table]]


SECTIONS: list[Registered] = []


def section(pattern: str) -> Callable[[Callable[[list[Source]], list[Table]]], Callable[[list[Source]], list[Table]]]:
    """Register ``render`` for the JSON files matching ``pattern`` under ``docs/``."""
    def wrap(render: Callable[[list[Source]], list[Table]]) -> Callable[[list[Source]], list[Table]]:
        SECTIONS.append(Registered(pattern, render))
        return render
    return wrap


def sources(pattern: str) -> list[Source]:
    """The JSON files under ``docs/`` matching ``pattern``, parsed."""
    return [Source(path, json.loads(path.read_text())) for path in sorted(DOCS.glob(pattern))]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (the first column left-aligned, the rest right-aligned)."""
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def times(value: float | None, digits: int = 2) -> str:
    """A ratio as ``1.73×`` (``-`` when absent)."""
    return "-" if value is None else f"{value:.{digits}f}×"


def mean_std(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


# --- the scoreboard: docs/matrix/*.json ------------------------------------------------------

def matrix_reports(folder: str = "matrix") -> list[dict[str, Any]]:
    """The scoreboard's per-profile reports in ``docs/<folder>`` (files with ``meta`` and ``results``)."""
    return [s.data for s in sources(f"{folder}/*.json") if "results" in s.data and "meta" in s.data]


def matrix_runs(report: dict[str, Any]) -> list[Provenance]:
    """Every run a profile's report merges (its ``meta.runs``, else its ``meta``)."""
    meta = report["meta"]
    return [Provenance(run["created"], run["commit"], run["command"]) for run in meta.get("runs") or [meta]]


def ok_rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in report["results"] if r.get("status") == "ok" and r.get("speedup_vs_ddp")}


def best_of_class(report: dict[str, Any]) -> dict[str, str]:
    """The fastest measured row of each class (``exact``: DDP's result; ``approximate``: the rest)."""
    from syncplane.algorithms import is_exact

    rows = ok_rows(report)
    best = {}
    for cls, want in (("exact", True), ("approximate", False)):
        names = [n for n in rows if is_exact(n) == want]
        if names:
            best[cls] = max(names, key=lambda n: rows[n]["speedup_vs_ddp"])
    return best


def strategy_order(reports: list[dict[str, Any]]) -> list[str]:
    order: list[str] = []
    for report in reports:
        order += [r["strategy"] for r in report["results"] if r["strategy"] not in order]
    return order


def grid(folder: str = "matrix", strategies: list[str] | None = None, link: bool = True) -> str:
    """Every profile (rows) by every strategy (columns), each cell its sync's speed-up over DDP;
    bold: the fastest exact one, italic: the fastest approximate one."""
    reports = matrix_reports(folder)
    names = strategies or [n for n in strategy_order(reports) if n != "ddp"]
    rows = []
    for report in reports:
        measured, best = ok_rows(report), best_of_class(report)
        cells = []
        for name in names:
            cell = times(measured[name]["speedup_vs_ddp"]) if name in measured else "-"
            cells.append(f"**{cell}**" if best.get("exact") == name else f"*{cell}*" if best.get("approximate") == name
                         else cell)
        profile = report["cluster"]
        label = f"[`{profile}`]({folder}/{profile}.md)" if link else f"`{profile}`"
        rows.append([label] + cells)
    return markdown(["profile"] + [f"`{n}`" for n in names], rows)


def grid_provenance(folder: str = "matrix") -> str:
    """One line: the span of dates and commits the grid's profiles were measured at."""
    runs = [run for report in matrix_reports(folder) for run in matrix_runs(report)]
    dates = sorted(run.date[:10] for run in runs)
    commits = sorted({run.commit for run in runs})
    return (f"Measured {grid_dates()} at {len(commits)} commits ({', '.join(f'`{c}`' for c in commits)}); "
            "each profile's page gives its runs' dates, commits and commands.")


@section("matrix/*.json")
def scoreboard(files: list[Source]) -> list[Table]:
    """The planner against the scoreboard's measurements (the per-profile tables are their own pages)."""
    from syncplane.bench.matrix import planner_table

    reports = matrix_reports()
    if not reports:
        return []
    body = planner_table(reports)
    lines = body.rstrip("\n").split("\n")
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if line.startswith("|")]
    return [Table("The planner against the scoreboard", header, rows,
                  [Provenance(grid_dates(), ", ".join(grid_commits()), "make scoreboard")],
                  intro="What `syncplane plan` picks among each profile's measured rows (the fastest predicted of "
                        "each class) against the fastest measured.", note=lines[-1])]


def grid_dates() -> str:
    dates = sorted(run.date[:10] for report in matrix_reports() for run in matrix_runs(report))
    return dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"


def grid_commits() -> list[str]:
    return sorted({run.commit for report in matrix_reports() for run in matrix_runs(report)})


@section("matrix/8mb/*.json")
def scoreboard_8mb(files: list[Source]) -> list[Table]:
    """The 8 MB scoreboard as a grid (the same profiles, an 8 MB payload)."""
    reports = matrix_reports("matrix/8mb")
    if not reports:
        return []
    text = grid("matrix/8mb", link=False)
    lines = text.rstrip("\n").split("\n")
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    runs = [run for report in reports for run in matrix_runs(report)]
    latest = max(runs, key=lambda r: r.date)
    return [Table("Scoreboard at an 8 MB payload", header, rows, [latest],
                  intro=f"The same grid at an 8 MB payload ({len(runs)} runs, {min(r.date for r in runs)[:10]} to "
                        f"{latest.date[:10]}; every run's command: `meta` in [matrix/8mb/](matrix/8mb/)).")]


# --- training comparisons: docs/compare/*/comparison.json ------------------------------------

def comparison(name: str) -> dict[str, Any]:
    return json.loads((DOCS / "compare" / name / "comparison.json").read_text())


def vs_ddp(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per strategy of a comparison: its mean time to target, its speed-up over the comparison's
    own DDP, bytes and final accuracy against DDP's."""
    rows = {r["strategy"]: r for r in data["by_strategy"]}
    ddp = rows.get("ddp", {})
    out = {}
    for name, row in rows.items():
        runs = [r for r in data["runs"] if r["strategy"] == name and r.get("status") == "ok"]
        t, t_ddp = row.get("time_to_target_mean_s"), ddp.get("time_to_target_mean_s")
        out[name] = {"time": "-" if t is None else f"{t:.1f} ± {row.get('time_to_target_std_s') or 0:.1f}",
                     "speedup": t_ddp / t if t and t_ddp else None,
                     "reached": f"{row.get('reached', 0)}/{row.get('runs', 0)}",
                     "mb": statistics.mean(r["bytes_sent_per_rank"] for r in runs) / MIB if runs else None,
                     "acc": row.get("val_acc_mean"),
                     "acc_delta": (row["val_acc_mean"] - ddp["val_acc_mean"]) if row.get("val_acc_mean") is not None
                     and ddp.get("val_acc_mean") is not None else None}
    return out


def headline() -> dict[str, dict[str, dict[str, Any]]]:
    """The comparisons marked ``meta.headline``: per cluster, each strategy's ``vs_ddp`` figures,
    rows that ``meta.replaced_by`` names taken from the newer comparison (against its own DDP)."""
    out = {}
    for s in sources("compare/*/comparison.json"):
        meta = s.data.get("meta", {})
        if not meta.get("headline"):
            continue
        rows = vs_ddp(s.data)
        for name, newer in meta.get("replaced_by", {}).items():
            rows[name] = vs_ddp(comparison(newer))[name] | {"from": newer}
        out[meta["cluster"]] = rows
    return out


def training_table(strategies: list[str] | None = None) -> str:
    """The headline: each strategy's time to target against DDP on each headline cluster."""
    data = headline()
    clusters = sorted(data)
    names = strategies or sorted({n for rows in data.values() for n in rows if n != "ddp"},
                                 key=lambda n: -max((data[c].get(n, {}).get("speedup") or 0) for c in clusters))
    rows = []
    for name in names:
        cells = []
        for c in clusters:
            row = data[c].get(name)
            cells.append("-" if row is None else f"{times(row['speedup'])} ({row['acc_delta']:+.4f})")
        rows.append([f"`{name}`"] + cells)
    return markdown(["run"] + [f"`{c}`: sooner than DDP (Δ val acc)" for c in clusters], rows)


def comparison_provenance(data: dict[str, Any]) -> list[Provenance]:
    meta = data.get("meta")
    if not meta:
        raise ValueError("a committed comparison.json needs a 'meta' with created, commit and command")
    return [Provenance(meta["created"], meta["commit"], meta["command"])]


def comparison_table(s: Source) -> Table:
    """One committed training comparison, every strategy against that comparison's DDP."""
    meta, rows = s.data.get("meta", {}), vs_ddp(s.data)
    target = s.data.get("target_acc")
    table_rows = [[f"`{name}`", r["reached"], r["time"], times(r["speedup"]),
                   "-" if r["mb"] is None else f"{r['mb']:,.0f}", "-" if r["acc"] is None else f"{r['acc']:.4f}",
                   "-" if r["acc_delta"] is None else f"{r['acc_delta']:+.4f}"]
                  for name, r in rows.items()]
    replaced = meta.get("replaced_by", {})
    note = "; ".join(f"Its `{n}` rows are superseded by [{new}](#{slug(comparison_title(new))})"
                     for n, new in replaced.items()) + ("." if replaced else "")
    md = s.rel.replace(".json", ".md")
    return Table(f"Training: {meta.get('title', s.path.parent.name)}",
                 ["run", "reached", f"time to {target} (s), mean ± std", "sooner than DDP", "MiB/rank",
                  "final val acc", "Δ acc vs DDP"], table_rows, comparison_provenance(s.data),
                 intro=meta.get("about", "") + f" Per-run table: [{md}]({md}).", note=note)


@section("compare/*/comparison.json")
def comparisons(files: list[Source]) -> list[Table]:
    """One table per committed training comparison."""
    return [comparison_table(s) for s in files]


def comparison_title(name: str) -> str:
    return f"Training: {comparison(name).get('meta', {}).get('title', name)}"


# --- docs/results/*.json ---------------------------------------------------------------------

@section("results/lm_wan*.json")
def lm_wan(files: list[Source]) -> list[Table]:
    """A language model on a WAN (``lm_wan.json``): each row's seeds as mean ± std, against the
    ``ddp`` row (its loss, bytes and time to target); a row that did not run is named in the note
    with why, and the charts ``scripts/lm_wan.py`` writes beside the JSON are linked when they are
    there. A companion file (``lm_wan_<what>.json``: another model size, or a DiLoCo setting varied;
    loss and bytes) is a sentence of that note (``companion``)."""
    main = next((s for s in files if s.path.name == "lm_wan.json"), None)
    if main is None:
        if files:
            raise ValueError(f"{[s.rel for s in files]}: companions of results/lm_wan.json, which is missing")
        return []
    rows = [r for r in main.data["rows"] if r["seeds"]]
    ddp = next((r for r in rows if r["name"] == "ddp"), None)

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return top / bottom if top and bottom else None

    out = []
    for row in rows:
        loss, base_loss = mean_of(row, "val_loss"), mean_of(ddp, "val_loss")
        out.append([f"`{row['name']}`" + (" (priced)" if "priced" in row else ""), str(len(row["seeds"])),
                    mean_std([seed["val_loss"] for seed in row["seeds"]], 3),
                    loss_gap(loss, base_loss) or "-",
                    f"{(mean_of(row, 'bytes_per_rank') or 0) / 1e6:,.3g}",
                    times(ratio(mean_of(ddp, "bytes_per_rank"), mean_of(row, "bytes_per_rank")), 0),
                    mean_std([seed["wall_s"] for seed in row["seeds"]], 0),
                    mean_std([seed["time_to_target_s"] for seed in row["seeds"]
                              if seed.get("time_to_target_s") is not None], 0),
                    times(ratio(mean_of(ddp, "time_to_target_s"), mean_of(row, "time_to_target_s")), 1),
                    f"{mean_of(row, 'compute_utilization') or 0:.2f}"])
    absent = [f"`{r['name']}` {r.get('status', 'not run')}: {r.get('message', '')}".strip()
              for r in main.data["rows"] if not r["seeds"]]
    priced = next((r["priced"]["note"] for r in rows if "priced" in r), None)
    charts = [f"![val loss against {what}]({png.relative_to(DOCS).as_posix()})"
              for what, png in zip(("bytes", "wall time"), chart_paths(main.path)) if png.exists()]
    note = " ".join([*([f"Priced: {priced}."] if priced else []), *(f"{a}." for a in absent),
                     *(companion(s, main) for s in files if s is not main)])
    return [Table(main.data.get("title", "Language model on a WAN"),
                  ["run", "seeds", "val loss", "vs DDP", "MB sent/rank", "fewer bytes", "wall s",
                   "time to target s", "sooner", "compute utilization"], out,
                  [Provenance(main.data["created"], main.data["commit"], main.data["command"])],
                  intro=main.data.get("about", "") + " Every row's `python train.py` command: `rows[].command` "
                        f"in [{main.rel}]({main.rel}).",
                  note=(note + ("\n\n" + " ".join(charts) if charts else "")).strip())]


def mean_of(row: dict[str, Any] | None, key: str) -> float | None:
    """The mean of a row's seeds' ``key`` where they have it (None: no row, or none has it)."""
    values = [seed[key] for seed in row["seeds"] if seed.get(key) is not None] if row else []
    return statistics.mean(values) if values else None


def loss_gap(loss: float | None, base: float | None) -> str:
    """``loss`` against ``base`` as ``+1.2 %`` ("" when either is absent)."""
    return "" if loss is None or base is None else f"{100 * (loss / base - 1):+.1f} %"


def companion(s: Source, main: Source) -> str:
    """A companion file of ``lm_wan.json`` as one sentence: each row's loss against DDP's (the
    file's own ``ddp`` row at another size, else ``main``'s), and for a row ``main`` has too its
    gap there (the scale trend), with the file's provenance."""
    settings = s.data.get("settings", {})
    def rows_of(source: Source) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in source.data["rows"] if r["seeds"]}

    def gap(rows: dict[str, dict[str, Any]], name: str, ddp: dict[str, Any] | None) -> str:
        loss, base = mean_of(rows.get(name), "val_loss"), mean_of(ddp, "val_loss")
        return loss_gap(loss, base)

    own, theirs = rows_of(s), rows_of(main)
    ddp = own.get("ddp") or (None if "size" in settings else theirs.get("ddp"))
    said = []
    for name, row in own.items():
        if name == "ddp":
            continue
        here, there = gap(own, name, ddp), gap(theirs, name, theirs.get("ddp"))
        said.append(f"`{name}` {mean_of(row, 'val_loss'):.3f}, {(mean_of(row, 'bytes_per_rank') or 0) / 1e6:.3g} MB/rank"
                    + (f" ({here} against DDP" if here else "")
                    + (f"; {there} at the default size" if here and there and "size" in settings else "")
                    + (")" if here else ""))
    what = (f"At `recipe.size={settings['size']}`" if "size" in settings else
            str(settings.get("varied") or "another setting").capitalize())
    seeds = max((len(r["seeds"]) for r in own.values()), default=0)
    return (f"{what} ([{s.rel}]({s.rel}); loss and bytes sent, {seeds} seed{'s' if seeds != 1 else ''}"
            + (f", DDP {mean_of(ddp, 'val_loss'):.3f}" if ddp is not None and ddp is own.get("ddp") else "")
            + f"; measured {Provenance(s.data['created'], s.data['commit'], s.data['command']).text()}): "
            + "; ".join(said) + ".")


@section("results/*.json")
def generic_tables(files: list[Source]) -> list[Table]:
    """Any ``docs/results/*.json`` of the generic shape (``columns`` and ``rows`` as lists)."""
    return [Table(s.data["title"], s.data["columns"], [[str(c) for c in row] for row in s.data["rows"]],
                  [Provenance(s.data["created"], s.data["commit"], s.data["command"])],
                  intro=s.data.get("about", ""), note=" ".join(s.data.get("notes", [])))
            for s in files if isinstance(s.data.get("rows"), list) and "columns" in s.data]


# --- the page --------------------------------------------------------------------------------

def render_table(table: Table) -> str:
    measured = "Measured " + "; ".join(p.text() for p in table.provenance) + "."
    parts = [f"## {table.title}", "", f"{table.intro.strip()} {measured}".strip(), "", markdown(table.header, table.rows)]
    if table.note:
        parts += [table.note, ""]
    return "\n".join(parts)


def unrendered() -> list[str]:
    """``docs/results/*.json`` files that no section renders: neither of the generic shape nor
    matched by a section of their own (a new file needs one, or it would silently be left out)."""
    claimed = {s.path for r in SECTIONS if r.render is not generic_tables for s in sources(r.pattern)}
    return [s.rel for s in sources("results/*.json")
            if s.path not in claimed and not (isinstance(s.data.get("rows"), list) and "columns" in s.data)]


def page() -> str:
    """``docs/benchmarks.md``."""
    if unrendered():
        raise ValueError(f"no section renders {unrendered()}: give it the generic shape (title, created, commit, "
                         "command, columns, rows) or a function of its own (scripts/results.py's docstring)")
    tables = [t for registered in SECTIONS for t in registered.render(sources(registered.pattern))]
    head = [
        "# Results", "",
        f"Generated by `{COMMAND}` (`make results`) from the JSON committed under `docs/`; do not edit by hand. "
        "Every table says when, at which commit and by which command it was measured. How to choose from them: "
        "[choosing.md](choosing.md); why the code is as it is: [design-notes.md](design-notes.md).", "",
        "How they were measured: an emulated profile is Linux network namespaces with shaped links and real TCP "
        "on one 2-core machine ([cluster-profiles.md](cluster-profiles.md)), whose cores the ranks and the "
        "emulated network's packet work share, so compare strategies with each other, not with your cluster's "
        "seconds. A sync time is the median of the timed steps after an untimed warm-up, beside `ddp` in the same "
        "run; a time to target is the training clock at the first validation that reaches it.", "",
        "## Every strategy on every profile", "",
        "One step's sync against DDP's on each shipped emulated profile at the ResNet-50 payload (97.5 MB of fp32 "
        "gradients): higher is faster. **Bold**: the fastest that gives DDP's result (exact); *italic*: the "
        "fastest of the rest (approximate: the model differs from DDP's); a row without bold: DDP itself was the "
        "fastest exact one. A profile's page has its table "
        "(bound ratio, model error, bytes, CPU) and chart. " + grid_provenance() + " Command: `make scoreboard`.", "",
        grid(), "",
        "## Training: time to accuracy", "",
        "Each strategy trains the same recipe, seeds and schedule as DDP on the emulated cluster; *sooner*: DDP's "
        "mean time to the target accuracy over the strategy's (the seeds' spread and commands: the sections "
        f"below; measured {training_dates()}), with the final validation accuracy against DDP's.", "",
        training_table(), "",
        "Contents: " + ", ".join(f"[{t.title}](#{slug(t.title)})" for t in tables) + ".", "",
    ]
    return "\n".join(head) + "\n".join(render_table(t) for t in tables)


def slug(title: str) -> str:
    """GitHub's anchor of a heading (as ``tests/helpers/docs_check.slug``)."""
    return re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")


# --- blocks in the guides --------------------------------------------------------------------

def speedups_block(arg: str, docs: str = "") -> str:
    """``speedups:S1,S2``: each strategy's speed-up over DDP on every profile of the scoreboard,
    one line per strategy, fastest first (the grid of the results page, a strategy at a time)."""
    reports = matrix_reports()
    lines = []
    for name in (n for n in arg.split(",") if n != "ddp"):
        cells = []
        for report in reports:
            measured, best = ok_rows(report), best_of_class(report)
            if name in measured:
                figure = times(measured[name]["speedup_vs_ddp"])
                figure = f"**{figure}**" if best.get("exact") == name else \
                    f"*{figure}*" if best.get("approximate") == name else figure
                cells.append((measured[name]["speedup_vs_ddp"], f"`{report['cluster']}` {figure}"))
        lines.append(f"- `{name}`: " + ", ".join(text for _, text in sorted(cells, key=lambda c: -c[0])) + ".")
    return ("\n".join(lines) + "\n\n"
            f"Sync per step against DDP's at the ResNet-50 payload, fastest first; bold / italic: the fastest exact / "
            f"approximate strategy on that profile; measured {grid_dates()}. "
            f"Every strategy side by side: [results]({docs}benchmarks.md#every-strategy-on-every-profile).\n")


def training_block(arg: str, docs: str = "") -> str:
    """``training:S1,S2``: the training headline's rows of these strategies."""
    return (training_table(arg.split(",")) + f"\nMeasured {training_dates()}. Source: "
            f"[results]({docs}benchmarks.md#training-time-to-accuracy).\n")


def training_dates() -> str:
    """The dates of the comparisons the training headline is made of."""
    names = {s.path.parent.name: s.data.get("meta", {}) for s in sources("compare/*/comparison.json")}
    used = [m for m in names.values() if m.get("headline")]
    used += [names[n] for m in used for n in m.get("replaced_by", {}).values()]
    dates = sorted({m["created"][:10] for m in used})
    return ", ".join(dates)


def comparison_block(arg: str, docs: str = "") -> str:
    """``comparison:NAME``: the training comparison ``docs/compare/NAME`` as its table."""
    (source,) = sources(f"compare/{arg}/comparison.json")
    table = comparison_table(source)
    return (markdown(table.header, table.rows) + "\nMeasured " + "; ".join(p.text() for p in table.provenance)
            + f". Source: [results]({docs}benchmarks.md#{slug(table.title)}).\n")


#: Approximate strategies that average every rank's gradients every step, compressed: DDP's step
#: semantics, and DDP's accuracy within float noise in the training comparisons.
EVERY_STEP = ("canary", "torch_fp16")


def choosing_block(arg: str, docs: str = "") -> str:
    """``choosing``: per profile, the fastest exact, every-step and approximate strategy
    measured, with the plan's pick where it differs; the recommendation table of ``docs/choosing.md``."""
    from syncplane.bench.matrix import planner_check

    rows = []
    for report in matrix_reports():
        measured, best = ok_rows(report), best_of_class(report)
        picks = {c["accept"]: c["pick"] for c in planner_check(report)}
        cells = []
        for cls in ("exact", "every step", "approximate"):
            name = best.get(cls) if cls != "every step" else \
                max((n for n in EVERY_STEP if n in measured), key=lambda n: measured[n]["speedup_vs_ddp"], default=None)
            cells.append("-" if name is None else f"`{name}` {times(measured[name]['speedup_vs_ddp'])}"
                         + ("" if picks.get(cls) in (None, name) else f" (plan: `{picks[cls]}`)"))
        rows.append([f"`{report['cluster']}`", PROFILE_WORDS.get(report["cluster"], "")] + cells)
    shipped = sorted(p.stem for p in (ROOT / "configs" / "cluster").glob("*.yaml"))
    missing = [n for n in shipped if n not in {r["cluster"] for r in matrix_reports()}]
    unmeasured = ("" if not missing else " Not in the scoreboard yet: " + ", ".join(f"`{n}`" for n in missing)
                  + " (ask `syncplane plan --cluster NAME`).")
    return (markdown(["profile", "what it is", "fastest exact", "fastest every step, compressed",
                      "fastest approximate"], rows)
            + f"\nSync per step against DDP's at the ResNet-50 payload, measured {grid_dates()}; the plan's pick "
              f"where it differs. Source: [results]({docs}benchmarks.md).{unmeasured}\n")


#: One line per shipped profile for the choosing table: what network it stands for.
PROFILE_WORDS = {
    "asymmetric_2_3": "two hosts of 2 and 3 ranks, one switch", "asymmetric_3_2_4": "three hosts of 3, 2 and 4 ranks",
    "bcube_3_2": "BCube: hosts relay, two NICs each", "homogeneous8": "one switch, eight equal hosts",
    "local": "one machine, no network", "mixed_gpus": "one switch, two hosts at half speed",
    "multi_nic": "two hosts of 2 ranks, two NICs each", "slow_nic": "one switch, one host's NIC slow",
    "two_racks": "two racks, slow uplinks", "two_racks_contended": "two racks, a greedy flow on the uplinks",
    "uneven_hosts": "three racks, hosts of different rank counts", "uneven_three_racks": "three racks of 3, 2 and 1 hosts",
    "uneven_uplinks": "three racks, uplinks of different speeds", "wan_two_sites": "two sites, a WAN capping each flow",
    "wan_nodes": "two sites of one 2-rank node, a slow site link",
    "uneven_nodes": "three hosts of 2, 1 and 2 ranks, one switch",
}

def profiles_block(arg: str, docs: str = "") -> str:
    """``profiles``: the shipped cluster profiles (``configs/cluster/``), each with what it is."""
    names = sorted(p.stem for p in (ROOT / "configs" / "cluster").glob("*.yaml"))
    return (f"{len(names)} shipped: " + ", ".join(f"`{n}` ({PROFILE_WORDS.get(n) or reference_docs._first_comment(ROOT / 'configs' / 'cluster' / f'{n}.yaml')})" for n in names)
            + ".\n")


def launcher_seconds(cell: str) -> float:
    """The launcher's exit, in seconds after the fault, of a chaos-matrix cell
    ``"survivors / launcher (named/survivors)"``."""
    return float(cell.split("/")[1].split("(")[0])


def faults_block(arg: str, docs: str = "") -> str:
    """``faults``: per fault kind of the committed chaos matrix (``results/faults.json``), the
    range over every strategy of the seconds from the fault until the launcher exited."""
    (source,) = sources("results/faults.json")
    data = source.data
    spans = []
    for k, kind in enumerate(data["columns"][1:], start=1):
        seconds = [launcher_seconds(row[k]) for row in data["rows"]]
        spans.append(f"{kind} {min(seconds):.1f}–{max(seconds):.1f} s")
    return (f"Seconds from the fault until the launcher exited, over every strategy, rank 2 of 4 lost, "
            f"heartbeat 15 s: {', '.join(spans)} (measured {data['created']}, `{data['command']}`; "
            f"[every cell]({docs}benchmarks.md#{slug(data['title'])})).\n")


def lightning_features_block(arg: str, docs: str = "") -> str:
    """``lightning_features``: the grid of ``scripts/lightning_features.py --matrix``
    (``results/lightning/features.json``: every strategy's Lightning features, both launchers),
    shown where plain-script users read (``docs/lightning.md``), not on the results page."""
    (source,) = sources("results/lightning/features.json")
    data = source.data
    provenance = Provenance(data["created"], data["commit"], data["command"])
    return f"{data['about']}\n\nMeasured {provenance.text()}.\n\n" + markdown(data["columns"], data["rows"])


BLOCKS: dict[str, Callable[[str, str], str]] = {
    "faults": faults_block,
    "lightning_features": lightning_features_block,
    "profiles": profiles_block,
    "speedups": speedups_block,
    "training": training_block,
    "choosing": choosing_block,
    "comparison": comparison_block,
    "grid": lambda arg, docs="": grid(link=False),
}


def render_block(key: str, docs: str = "") -> str:
    """Block ``KEY`` (``NAME`` or ``NAME:ARG``) rendered, its links prefixed with ``docs`` (the
    way from the page's folder to ``docs/``)."""
    name, _, arg = key.partition(":")
    if name not in BLOCKS:
        raise KeyError(f"unknown results block {key!r}; known: {', '.join(sorted(BLOCKS))}")
    return BLOCKS[name](arg, docs)


def fill_blocks(text: str, page: Path | None = None) -> str:
    """``text`` (of ``page``, default a page in ``docs/``) with every ``results:KEY`` block rendered again."""
    folder = (page or PAGE).parent
    docs = "" if folder == DOCS else Path(os.path.relpath(DOCS, folder)).as_posix() + "/"
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("key"), docs).rstrip("\n") + "\n" + m.group(4), text)


def guides() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p != PAGE and "matrix" not in p.parts)]


def outputs() -> dict[Path, str]:
    """Every generated file and what it should hold."""
    out = {PAGE: page()}
    for path in guides():
        text = path.read_text()
        if BLOCK.search(text):
            out[path] = fill_blocks(text, path)
    out.update(reference_docs.pages(ROOT))
    return out


def stale() -> list[Path]:
    """The generated files that differ from what ``outputs`` would write."""
    return [path for path, text in outputs().items() if not path.exists() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"stale: {path.relative_to(ROOT)} (run `{COMMAND}`)", file=sys.stderr)
        return 1 if old else 0
    written = 0
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written += 1
    print(f"results: {written} files written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
