"""The docs test's checks catch what they claim to: each is fed a planted bad snippet (and a
good one), so a check that silently passes everything would fail here.

The real pages go through the same functions in ``test_docs_commands.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncplane.config import ConfigError
from tests.helpers import docs_check
from tests.unit.test_docs_commands import check_syncplane, check_train, known_keys, registered

PAGE = Path("/docs/guide.md")


def test_an_inline_command_in_prose_and_in_a_table_is_collected():
    text = ("Run `syncplane bench --cluster two_racks --strategies ddp --json a.json` first.\n\n"
            "| what | command |\n| --- | --- |\n| train | `python train.py strategy=ddp trainer.devices=4` |\n")
    assert docs_check.commands(text) == ["syncplane bench --cluster two_racks --strategies ddp --json a.json",
                                         "python train.py strategy=ddp trainer.devices=4"]


def test_a_bare_command_name_or_an_abbreviated_span_is_prose():
    assert docs_check.commands("`syncplane bench` times it; `syncplane bench … --profile` too") == []


def test_inline_bench_without_json_fails():
    (command,) = docs_check.commands("Then `syncplane bench --cluster two_racks --strategies ddp,atc`.")
    with pytest.raises(ConfigError, match="--json is required"):
        check_syncplane(command.split()[1:])


def test_inline_train_command_with_a_bad_key_fails(tmp_path):
    (command,) = docs_check.commands("Try `python train.py strategy=ddp trainer.devicez=4`.")
    with pytest.raises(Exception, match="devicez"):
        check_train(command.split()[2:], tmp_path)


def test_a_planted_bad_key_is_named():
    text = ("Set `strategy.kwargs.sync_evry=5` or `trainer.max_epochs=3`.\n\n"
            "| key | default | meaning |\n| --- | --- | --- |\n| `shards` | 1 | streams |\n| `bogus_knob` | 2 | no |\n")
    keys = docs_check.config_keys(text, strategy_page=True)
    assert docs_check.unknown_keys(keys, known_keys()) == ["strategy.kwargs.bogus_knob", "strategy.kwargs.sync_evry"]


def test_real_keys_pass():
    text = "`strategy.kwargs.compress_in_host`, `trainer.heartbeat_timeout_s`, `recipe.size`, `trainer.global_step`"
    assert docs_check.unknown_keys(docs_check.config_keys(text), known_keys()) == []


def test_an_unknown_strategy_in_a_strategy_table_is_named():
    names = registered()
    rows = "".join(f"| `{n}` | x |\n" for n in names)
    good = "| name | what |\n| --- | --- |\n" + rows
    (listed,) = docs_check.strategy_table_names(good, headers=("name",))
    assert docs_check.registry_mismatch(listed, names) is None
    bad = good + "| `h_diloco` | not a strategy |\n"
    (listed,) = docs_check.strategy_table_names(bad, headers=("name",))
    assert docs_check.registry_mismatch(listed, names) == "not registered: h_diloco"


def test_a_strategy_table_missing_one_is_named():
    names = registered()
    text = "| strategy | x |\n| --- | --- |\n" + "".join(f"| `{n}` | x |\n" for n in names if n != "canary")
    (listed,) = docs_check.strategy_table_names(text)
    assert docs_check.registry_mismatch(listed, names) == "missing: canary"


def test_a_broken_link_and_a_missing_anchor_are_named():
    pages = {Path("/docs/other.md"): "# Other page\n\n## The `ring` (2 × faster)\n"}
    text = ("See [other](other.md#the-ring-2--faster), [gone](missing.md), "
            "[bad anchor](other.md#nowhere) and [site](https://example.org/x).")
    broken = docs_check.broken_links(PAGE, text, pages.get)
    assert broken == ["missing.md: no such file", "other.md#nowhere: no heading #nowhere"]
