"""``strategy=auto``'s settings are checked in the launching process, by name (issue 36)."""

from __future__ import annotations

import pytest

from syncplane.config import ConfigError
from syncplane.experiments.comparison import compose_job
from syncplane.runtime.settings import parse_job


def job(*overrides: str) -> dict:
    return compose_job(["strategy=auto", *overrides], "the job")


@pytest.mark.parametrize("overrides,message", [
    (["cluster=two_racks", "trainer.devices=8", "strategy.kwargs.accept=exakt"],
     r"strategy.kwargs.accept: allowed values: exact, approximate; got 'exakt'"),
    (["cluster=two_racks", "trainer.devices=8", "+strategy.kwargs.acept=exact"],
     r"strategy.kwargs: unknown key\(s\) acept; allowed keys: accept, cluster"),
    (["trainer.devices=2"], r"strategy.kwargs.cluster: strategy=auto plans for a network"),
    (["trainer.devices=2", "strategy.kwargs.cluster=two_racks"],
     r"the job's ranks \(strategy.kwargs.cluster\): 2 processes, but cluster profile 'two_racks' has 8 ranks"),
    (["cluster=two_racks", "trainer.devices=8", "strategy.kwargs.strategies=[ddp,nope]"],
     r"strategy.kwargs.strategies: unknown nope"),
    (["cluster=two_racks", "trainer.devices=8", "strategy.kwargs.replan_every_s=0"],
     r"strategy.kwargs.replan_every_s: must be a positive number of seconds .*got 0"),
    (["cluster=two_racks", "trainer.devices=8", "strategy.kwargs.replan_every_s=-5"],
     r"strategy.kwargs.replan_every_s: must be a positive number of seconds .*got -5"),
])
def test_bad_auto_settings_name_the_key(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job(job(*overrides), run_dir=str(tmp_path))


def test_good_auto_settings_pass(tmp_path) -> None:
    spec = parse_job(job("cluster=two_racks", "trainer.devices=8", "strategy.kwargs.accept=approximate"),
                     run_dir=str(tmp_path))
    assert spec.strategy.name == "auto" and spec.strategy.kwargs["accept"] == "approximate"


def test_replan_every_s_with_a_named_strategy_is_refused_by_name(tmp_path) -> None:
    cfg = compose_job(["strategy=diloco", "+strategy.kwargs.replan_every_s=30"], "the job")
    with pytest.raises(ConfigError, match=r"strategy.kwargs.replan_every_s: only strategy=auto re-plans while "
                                          r"training; strategy=diloco runs as named"):
        parse_job(cfg, run_dir=str(tmp_path))


def test_replan_every_s_is_accepted(tmp_path) -> None:
    spec = parse_job(job("cluster=two_racks", "trainer.devices=8", "strategy.kwargs.replan_every_s=30"),
                     run_dir=str(tmp_path))
    assert spec.strategy.kwargs["replan_every_s"] == 30
