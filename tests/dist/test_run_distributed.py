"""The test helper's ranks are forks of one preloaded server (``tests/helpers/distributed.py``):
they must still be separate processes that see the calling test's environment and working
directory, as spawned interpreters did -- not whatever the server had when it started."""

from __future__ import annotations

import os

from tests.helpers.distributed import run_distributed


def _where(rank: int, world_size: int) -> tuple[int, str | None, str]:
    return os.getpid(), os.environ.get("SYNCPLANE_HELPER_PROBE"), os.getcwd()


def test_ranks_are_separate_processes_with_the_tests_environment_and_cwd(tmp_path, monkeypatch):
    run_distributed(_where, 2)   # the fork server is up before the test changes anything
    for value in ("first", "second"):
        monkeypatch.setenv("SYNCPLANE_HELPER_PROBE", value)
        (tmp_path / value).mkdir()
        monkeypatch.chdir(tmp_path / value)
        seen = run_distributed(_where, 3)
        assert len({pid for pid, _, _ in seen} | {os.getpid()}) == 4
        assert [(env, cwd) for _, env, cwd in seen] == [(value, str(tmp_path / value))] * 3
