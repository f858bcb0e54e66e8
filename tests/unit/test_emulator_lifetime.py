"""The emulated cluster outlives the command that built it (the next run reuses it), and
every command that runs on one says so at its end, finished or failed, with the command that
removes it (issue 38). The emulator itself is faked here: its namespaces are listed, not
built; ``tests/cluster/test_emulator.py`` checks the same on real namespaces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from syncplane import cli
from syncplane.cluster import emulator


@pytest.fixture
def cluster_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """two_racks' 9 namespaces (a switch and 8 hosts) exist under this run's prefix."""
    prefix = emulator.ns_prefix()
    names = [f"{prefix}switch", *(f"{prefix}h-{h}" for h in ("a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"))]
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"profile": "two_racks"}))
    monkeypatch.setattr(emulator, "namespaces", lambda: names)
    monkeypatch.setattr(emulator, "_state_file", lambda: state)
    return f"the emulated cluster 'two_racks' is still up (9 network namespaces {prefix}*)"


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_the_line_names_the_cluster_and_the_command_that_removes_it(cluster_up):
    state = emulator.left_up()
    assert state is not None and state["namespaces"] == 9 and state["profile"] == "two_racks"
    prefix = emulator.ns_prefix()
    assert state["remove_with"] == f"{emulator.PREFIX_ENV}={prefix} syncplane emulate down"   # its own prefix
    assert cluster_up in emulator.left_up_line(state)


def test_nothing_is_said_when_nothing_is_up_or_no_cluster_was_used(monkeypatch, capsys, cluster_up):
    with emulator.say_if_left_up(False):
        pass
    monkeypatch.setattr(emulator, "namespaces", lambda: [])
    with emulator.say_if_left_up(True):
        pass
    assert capsys.readouterr().out == ""


def test_bench_says_so_last_and_in_its_report(tmp_path, monkeypatch, capsys, cluster_up):
    from syncplane.runtime import launcher

    def fake_launch(command: list[str], profile: Any, log_dir: Path, **kwargs: Any) -> None:
        spec = json.loads(Path(command[-1]).read_text())
        results = {n: {"step_s": [1.0], "comm_bytes": [1.0] * 8, "nic_tx_bytes": [1.0] * 8}
                   for n in spec["strategies"]}
        (log_dir.parent / "results.json").write_text(json.dumps({"results": results}))

    monkeypatch.setattr(launcher, "launch_on_cluster", fake_launch)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--cluster", "two_racks", "--payload-mb", "1", "--steps", "1", "--json", str(out)]) == 0
    assert cluster_up in last_line(capsys.readouterr().out)
    report = json.loads(out.read_text())
    assert report["emulated_cluster"]["namespaces"] == 9
    assert report["emulated_cluster"]["remove_with"].endswith("syncplane emulate down")


def test_a_failed_bench_says_so_too(tmp_path, monkeypatch, capsys, cluster_up):
    from syncplane.runtime import launcher

    def failing_launch(*args: Any, **kwargs: Any) -> None:
        raise launcher.LaunchError("rank 3 failed (exit code 1)")

    monkeypatch.setattr(launcher, "launch_on_cluster", failing_launch)
    assert cli.main(["bench", "--cluster", "two_racks", "--payload-mb", "1", "--json", str(tmp_path / "b.json")]) == 1
    assert cluster_up in last_line(capsys.readouterr().out)


def test_compare_on_a_cluster_says_so(tmp_path, monkeypatch, capsys, cluster_up):
    from syncplane.experiments import comparison

    ran = []
    monkeypatch.setattr(comparison, "run_comparison", lambda settings: ran.append(settings.cluster))
    monkeypatch.setattr(comparison, "print_report", lambda out: print("report"))
    assert cli.main(["compare", "--cluster", "two_racks", "--strategies", "ddp", "--out", str(tmp_path)]) == 0
    assert ran == ["two_racks"] and cluster_up in last_line(capsys.readouterr().out)
    assert cli.main(["compare", "--strategies", "ddp", "--out", str(tmp_path)]) == 0      # this machine: nothing
    assert last_line(capsys.readouterr().out) == "report"


def test_chaos_on_a_cluster_says_so(tmp_path, monkeypatch, capsys, cluster_up):
    from syncplane.experiments import chaos

    monkeypatch.setattr(chaos, "run_chaos", lambda plan, **kwargs: {"ok": True})
    monkeypatch.setattr(chaos, "print_report", lambda report, path: print("report"))
    assert cli.main(["chaos", "--fault", "kill:rank=1:step=5", "--out", str(tmp_path / "c"), "cluster=two_racks",
                     "trainer.devices=8"]) == 0
    assert cluster_up in last_line(capsys.readouterr().out)
    monkeypatch.setattr(chaos, "run_matrix", lambda plans, **kwargs: [{"ok": True}])
    monkeypatch.setattr(chaos, "print_matrix", lambda rows, deadline, path: print("matrix"))
    assert cli.main(["chaos", "--matrix", "--strategies", "ddp", "--kinds", "netdown", "--out", str(tmp_path / "m"),
                     "trainer.devices=4"]) == 0     # a netdown cell runs on an emulated cluster (multi_nic)
    assert cluster_up in last_line(capsys.readouterr().out)


def test_train_py_says_so_around_its_job(monkeypatch, capsys, cluster_up):
    """``train.py cluster=…`` runs its job inside the same notice (its real run:
    ``tests/cluster/test_emulator.py::test_train_on_an_emulated_multi_nic_cluster``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_entry", Path(__file__).resolve().parents[2] / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from syncplane.runtime import entry

    jobs = []
    monkeypatch.setattr(entry, "run_job", lambda cfg: jobs.append(cfg["cluster"]))
    train.main({"cluster": {"name": "two_racks"}})
    assert jobs == [{"name": "two_racks"}] and cluster_up in last_line(capsys.readouterr().out)
    train.main({"cluster": None})
    assert capsys.readouterr().out == ""
