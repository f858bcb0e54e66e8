"""The hooks through which the runtime reaches an algorithm (``AlgorithmSpec.check_launch``,
``elastic``, ``switch``), as DiLoCo declares them: the runtime's refusals, launch and re-plan
switch are the same as when it named DiLoCo itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from syncplane import algorithms
from syncplane.algorithms.diloco import SPEC, SWITCH_KEYS
from syncplane.algorithms.spec import LaunchSettings
from syncplane.config import ConfigError
from syncplane.runtime import replan
from syncplane.runtime.settings import parse_job

PLAIN = LaunchSettings(emulated=False, resume=None, max_restarts=0)


def job(tmp_path: Path, kwargs: dict[str, Any], **top: Any) -> Any:
    return parse_job({"strategy": {"name": "diloco", "kwargs": kwargs}, "recipe": {"name": "digits"}, **top},
                     run_dir=str(tmp_path))


def test_an_elastic_job_is_launched_by_its_spec_and_others_are_not(tmp_path: Path) -> None:
    elastic = job(tmp_path, {"elastic": True, "join_timeout_s": 7, "lighthouse_host": "127.0.0.2"})
    assert elastic.elastic and elastic.elastic_launch is SPEC.elastic
    assert elastic.elastic_launch.timeouts(elastic.strategy.kwargs) == {"min_replicas": 1, "join_timeout_s": 7.0,
                                                                         "heartbeat_timeout_s": 5.0}
    assert elastic.elastic_launch.bind(elastic.strategy.kwargs) == "127.0.0.2"
    assert not job(tmp_path, {"elastic": False}).elastic and not job(tmp_path, {}).elastic
    assert algorithms.elastic_launch("auto", {"elastic": True}) is None       # not a family's name
    assert algorithms.elastic_mode("canary") is None
    assert algorithms.elastic_settings() == ["strategy=diloco strategy.kwargs.elastic=true"]


def test_the_launch_checks_refuse_what_they_refused_in_the_runtime(tmp_path: Path) -> None:
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"")
    assert job(tmp_path, {"elastic": True}, resume=str(checkpoint)).resume == str(checkpoint)   # elastic resumes
    assert job(tmp_path, {"elastic": True, "membership": "quorum"}, resume=str(checkpoint)).resume == str(checkpoint)
    with pytest.raises(ConfigError, match=r"^trainer.max_restarts=1: only elastic jobs \(strategy=diloco "
                                          r"strategy.kwargs.elastic=true\) restart a failed rank"):
        job(tmp_path, {}, trainer={"max_restarts": 1})
    with pytest.raises(ConfigError, match=r"^trainer.max_restarts=1: only elastic jobs"):
        parse_job({"strategy": {"name": "canary"}, "recipe": {"name": "digits"}, "trainer": {"max_restarts": 1}},
                  run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="lighthouse_host=10.0.0.1: on an emulated cluster"):
        SPEC.check_launch("diloco", {"elastic": True, "lighthouse_host": "10.0.0.1"},
                          LaunchSettings(emulated=True, resume=None, max_restarts=0))
    # what is not elastic, or not emulated, passes
    SPEC.check_launch("diloco", {"lighthouse_host": "10.0.0.1"}, LaunchSettings(emulated=True, resume="x",
                                                                                max_restarts=0))
    SPEC.check_launch("diloco", {"elastic": True, "lighthouse_host": "10.0.0.1"}, PLAIN)
    assert job(tmp_path, {}, resume=str(checkpoint)).resume == str(checkpoint)


class Recorder:
    """A running strategy's ``switch_settings`` (what the spec's switch calls), recorded."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def switch_settings(self, changes: Any) -> None:
        self.calls.append(dict(changes))


def test_a_replan_switches_the_familys_keys_through_the_strategy() -> None:
    assert replan.switchable("diloco") == SWITCH_KEYS == ("streams", "exchange", "compression")
    assert replan.not_switchable("diloco", {"replica": "rank"}) is None
    assert "only replica=rank switches" in replan.not_switchable("diloco", {"replica": "auto"})
    assert replan.fixed_part("diloco", {"sync_every": 4, "streams": 2, "exchange": "mesh"}) == {"sync_every": 4}
    running = Recorder()
    replan.apply_switch("diloco", running, "diloco", {"sync_every": 4, "exchange": "gather", "compression": "sparse"})
    assert running.calls == [{"streams": 1, "exchange": "gather", "compression": "sparse"}]   # streams: the default


def test_the_replanner_waits_for_the_running_familys_period() -> None:
    def planner(strategy: str, kwargs: dict[str, Any]) -> replan.Replanner:
        return replan.Replanner({"choice": {"strategy": strategy, "kwargs": kwargs}}, 1.0, lambda: None,
                                lambda x: x, 0)

    assert planner("diloco", {"sync_every": 4}).period == 4
    assert planner("flexreduce", {}).period == 1


def test_the_quorum_service_names_a_strategy_with_an_elastic_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from syncplane.runtime import lighthouse

    with pytest.raises(SystemExit):
        lighthouse.main(["--strategy", "canary", "--host", "127.0.0.1"])
    assert "--strategy canary: not a strategy with an elastic mode (strategy=diloco " in capsys.readouterr().err
