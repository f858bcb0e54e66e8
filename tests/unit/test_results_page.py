"""Every published figure comes from the committed data: ``docs/benchmarks.md``, the guides'
generated blocks and ``docs/reference/`` are what ``scripts/results.py`` writes from it, a guide
states no measured figure by hand, no page is a diary, and pages stay short.

Each rule is also fed a planted violation, so a rule that passes everything fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import docs_check
from tests.helpers.scripts import load_script

results = load_script("results")
reference_docs = results.reference_docs

ROOT = Path(__file__).resolve().parents[2]
GENERATED_PAGES = {"docs/benchmarks.md"} | {f"docs/reference/{n}.md" for n in ("cli", "config", "env", "summary")}
#: Pages that are the data themselves (per-profile scoreboard tables, per-run comparison tables).
DATA_DIRS = ("docs/matrix/", "docs/compare/")
MAX_LINES, MAX_RESULTS_LINES = 250, 400
#: README and every page under docs/ but the scoreboard's per-profile output, in all
MAX_TOTAL_LINES = 4000


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


GUIDES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
          if _where(p) not in GENERATED_PAGES and not _where(p).startswith(DATA_DIRS)]


def test_generated_pages_are_current():
    stale = [_where(p) for p in results.stale()]
    assert not stale, f"stale generated pages (run `python scripts/results.py`): {stale}"


@pytest.mark.parametrize("guide", GUIDES, ids=_where)
def test_a_guide_states_no_figure_by_hand(guide):
    figures = docs_check.hand_figures(guide.read_text())
    assert not figures, (f"{_where(guide)} states {figures} by hand: show it through a generated block "
                         "(<!-- results:KEY -->, scripts/results.py) or link to docs/benchmarks.md")


def test_a_planted_wrong_figure_in_choosing_fails():
    text = (ROOT / "docs" / "choosing.md").read_text()
    assert docs_check.hand_figures(text) == []
    planted = text.replace("\n## ", "\nCanary measures 4.13× on `multi_nic`.\n\n## ", 1)
    assert docs_check.hand_figures(planted) == ["4.13×"]


def test_a_wrong_figure_inside_a_generated_block_fails():
    text = (ROOT / "docs" / "choosing.md").read_text()
    block = results.BLOCK.search(text)
    assert block, "choosing.md shows its recommendations through a generated block"
    assert results.fill_blocks(text) == text
    figure = docs_check.FIGURE.search(block.group("body")).group(0)
    wrong = text[:block.start("body")] + block.group("body").replace(figure, "9.99×", 1) + text[block.end("body"):]
    assert results.fill_blocks(wrong) != wrong


def test_figures_in_a_shape_or_a_code_block_are_not_measurements():
    assert docs_check.hand_figures("a 2 × 1024 MLP\n\n```text\n1.5× faster\n```\n") == []
    assert docs_check.hand_figures("136 of 154 predictions are within 15 %, 1.5 × faster") == ["136 of 154 predictions", "1.5 ×"]


@pytest.mark.parametrize("page", GUIDES + [ROOT / p for p in sorted(GENERATED_PAGES)], ids=_where)
def test_no_page_is_a_diary(page):
    dated = docs_check.dated_headings(page.read_text())
    assert not dated, f"{_where(page)} has dated headings {dated}: history is git's (docs/design-notes.md says where)"


def test_a_dated_heading_is_found():
    assert docs_check.dated_headings("# A\n\n### Receives first (2026-12-01)\n\n## B\n") == ["Receives first (2026-12-01)"]


@pytest.mark.parametrize("page", GUIDES + [ROOT / "docs" / "benchmarks.md"], ids=_where)
def test_pages_are_short(page):
    where = _where(page)
    limit = MAX_RESULTS_LINES if where == "docs/benchmarks.md" else MAX_LINES
    lines = len(page.read_text().splitlines())
    assert lines <= limit, f"{where} has {lines} lines (at most {limit})"


def counted_pages() -> list[Path]:
    """README and every page under ``docs/`` but the scoreboard's generated output (``docs/matrix/``):
    what the issue's ``find docs README.md -name "*.md" -not -path "docs/matrix/*"`` counts."""
    return [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").rglob("*.md"))
                                   if not _where(p).startswith("docs/matrix/")]


def test_the_docs_are_short_in_all():
    total = sum(len(p.read_text().splitlines()) for p in counted_pages())
    assert total <= MAX_TOTAL_LINES, f"README and docs/ have {total} lines (at most {MAX_TOTAL_LINES})"


def test_a_new_json_file_is_one_function(tmp_path, monkeypatch):
    """The docstring's example: ``lm_wan`` renders ``docs/results/lm_wan.json`` rows as mean ± std
    of their seeds, against the ``ddp`` row."""
    data = {"title": "tiny_lm on wan_two_sites", "created": "2026-12-02T10:00:00", "commit": "abc1234",
            "rows": [{"name": "ddp", "command": "syncplane compare --recipe tiny_lm --strategies ddp",
                      "seeds": [{"seed": 1, "val_loss": 3.0, "bytes_per_rank": 2e6, "wall_s": 100.0,
                                 "time_to_target_s": 80.0, "compute_utilization": 0.2},
                                {"seed": 2, "val_loss": 3.2, "bytes_per_rank": 2e6, "wall_s": 110.0,
                                 "time_to_target_s": 100.0, "compute_utilization": 0.3}]},
                     {"name": "diloco", "command": "syncplane compare --recipe tiny_lm --strategies diloco",
                      "seeds": [{"seed": 1, "val_loss": 3.1, "bytes_per_rank": 1e5, "wall_s": 30.0,
                                 "time_to_target_s": 20.0, "compute_utilization": 0.8},
                                {"seed": 2, "val_loss": 3.1, "bytes_per_rank": 1e5, "wall_s": 30.0,
                                 "time_to_target_s": 25.0, "compute_utilization": 0.9}]},
                     {"name": "peer", "command": None, "status": "refused", "message": "it cannot replay this recipe",
                      "seeds": []}], "command": "python scripts/lm_wan.py"}
    path = tmp_path / "results" / "lm_wan.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    (tmp_path / "results" / "lm_wan_bytes.png").write_bytes(b"png")
    monkeypatch.setattr(results, "DOCS", tmp_path)
    (table,) = results.lm_wan(results.sources("results/lm_wan.json"))
    assert table.rows == [["`ddp`", "2", "3.100 ± 0.141", "+0.0 %", "2", "1×", "105 ± 7", "90 ± 14", "1.0×", "0.25"],
                          ["`diloco`", "2", "3.100 ± 0.000", "+0.0 %", "0.1", "20×", "30 ± 0", "22 ± 4", "4.0×",
                           "0.85"]]
    assert table.provenance[0].text() == "2026-12-02, commit `abc1234`: `python scripts/lm_wan.py`"
    rendered = results.render_table(table)
    assert "## tiny_lm on wan_two_sites" in rendered
    assert "`peer` refused: it cannot replay this recipe." in rendered   # a row without seeds says why
    assert "![val loss against bytes](results/lm_wan_bytes.png)" in rendered and "_wall.png" not in rendered
    # companions, each a sentence of the note: another size (its loss gap beside the default size's: the
    # scale trend) and a DiLoCo setting varied at the default size (against the table's DDP)
    small = {**data, "title": "tiny_lm size=small", "settings": {"size": "small", "emulated_step_s": 0},
             "rows": [{**row, "seeds": [{**seed, "val_loss": seed["val_loss"] - 1} for seed in row["seeds"]]}
                      for row in data["rows"]]}
    small["rows"][1]["seeds"] = [{**seed, "val_loss": 2.2} for seed in small["rows"][1]["seeds"]]
    (tmp_path / "results" / "lm_wan_small.json").write_text(json.dumps(small))
    outer = {**data, "settings": {"emulated_step_s": 0, "varied": "the outer step's learning rate"},
             "rows": [{**data["rows"][1], "name": "diloco_outer_lr1", "seeds": data["rows"][1]["seeds"][:1]}]}
    (tmp_path / "results" / "lm_wan_outer.json").write_text(json.dumps(outer))
    (table,) = results.lm_wan(results.sources("results/lm_wan*.json"))
    assert "At `recipe.size=small` ([results/lm_wan_small.json](results/lm_wan_small.json); loss and bytes sent, " \
           "2 seeds, DDP 2.100; measured 2026-12-02" in table.note
    assert "`diloco` 2.200, 0.1 MB/rank (+4.8 % against DDP; +0.0 % at the default size)" in table.note
    assert "The outer step's learning rate ([results/lm_wan_outer.json](results/lm_wan_outer.json); loss and " \
           "bytes sent, 1 seed; measured" in table.note
    assert "`diloco_outer_lr1` 3.100, 0.1 MB/rank (+0.0 % against DDP)." in table.note
    (tmp_path / "results" / "lm_wan.json").unlink()
    with pytest.raises(ValueError, match="companions of results/lm_wan.json"):
        results.lm_wan(results.sources("results/lm_wan*.json"))


def test_a_results_file_no_section_renders_is_named(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "new.json").write_text(json.dumps({"title": "t", "rows": [{"a": 1}]}))
    monkeypatch.setattr(results, "DOCS", tmp_path)
    assert results.unrendered() == ["results/new.json"]
    with pytest.raises(ValueError, match="no section renders"):
        results.page()


def test_an_unknown_block_is_named():
    with pytest.raises(KeyError, match="unknown results block 'nosuch:x'"):
        results.fill_blocks("<!-- results:nosuch:x -->\nold\n<!-- /results:nosuch:x -->\n")


def test_an_environment_variable_without_a_meaning_fails(monkeypatch):
    meanings = dict(reference_docs.ENV_MEANING)
    del meanings["SYNCPLANE_FORK_SERVER"]
    monkeypatch.setattr(reference_docs, "ENV_MEANING", meanings)
    with pytest.raises(ValueError, match="SYNCPLANE_FORK_SERVER"):
        reference_docs.env_page(ROOT)


def test_the_cli_reference_has_every_flag():
    from syncplane.cli import build_parser

    page = reference_docs.cli_page()
    flags = {o for sub in build_parser()._actions if hasattr(sub, "choices") and isinstance(sub.choices, dict)
             for command in sub.choices.values() for a in command._actions for o in a.option_strings}
    missing = sorted(f for f in flags - {"-h", "--help"} if f"`{f}`" not in page)
    assert not missing and "`--profile`" in page.split("## python -m syncplane.cluster.probe")[1]


def test_yaml_keys_carry_their_comments(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("# top\nname: x\nkwargs:\n  a: 1      # the a\n  b: auto  # the b,\n            # continued\n"
                    "  # set with +strategy.kwargs.KEY=VALUE:\n  #   s: 0     delay in steps\n"
                    "defaults:\n  - c: d\n")
    assert reference_docs.yaml_keys(path) == [("name", "x", ""), ("kwargs.a", "1", "the a"),
                                              ("kwargs.b", "auto", "the b, continued")]
    assert reference_docs.commented_keys(path) == {"s": "delay in steps"}


def test_the_faults_block_spans_every_strategys_launcher_exit(tmp_path, monkeypatch):
    data = {"title": "Faults: t", "created": "2026-01-02", "command": "syncplane chaos --matrix",
            "columns": ["strategy", "kill", "stop"],
            "rows": [["`ddp`", "6.5 / 8.4 (3/3)", "14.2 / 18.7 (3/3)"],
                     ["`diloco`", "14.3 / 16.3 (3/3)", "17.4 / 21.7 (3/3)"]]}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "faults.json").write_text(json.dumps(data))
    monkeypatch.setattr(results, "DOCS", tmp_path)
    line = results.render_block("faults")
    assert "kill 8.4–16.3 s, stop 18.7–21.7 s" in line and "2026-01-02" in line


def test_a_hand_edited_fault_time_is_rewritten():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert results.fill_blocks(text, ROOT / "docs" / "troubleshooting.md") == text
    block = results.BLOCK.search(text[text.index("<!-- results:faults -->"):])
    wrong = text.replace(block.group("body"), block.group("body").replace(" s,", "9 s,", 1), 1)
    assert results.fill_blocks(wrong, ROOT / "docs" / "troubleshooting.md") != wrong
