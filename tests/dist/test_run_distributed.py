"""The test helper's ranks are forks of one preloaded server (``tests/helpers/distributed.py``):
they must still be separate processes that see the calling test's environment and working
directory, as spawned interpreters did -- not whatever the server had when it started. A rank
that dies is named with its exit code, whether it dies before it returns or on its way out."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.distributed import RemoteError, run_distributed


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


def _one_rank_aborts(rank: int, world_size: int, when: str) -> bytes:
    import multiprocessing.util

    if rank == 1 and when == "before":
        os.abort()
    if rank == 1:          # on its way out, as a native crash in a teardown would
        multiprocessing.util.Finalize(None, os.abort, exitpriority=100)
    return os.urandom(1 << 20)      # larger than a pipe's buffer


@pytest.mark.parametrize("when, message", [("before", r"rank 1 died with exit code -6 before it returned"),
                                           ("after", r"rank 1 returned, then died on its way out with exit code -6")])
def test_a_rank_that_dies_is_named_with_its_exit_code_never_a_hang(when: str, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(RemoteError, match=message):
        run_distributed(_one_rank_aborts, 2, when, timeout=60)
    assert time.monotonic() - start < 30     # the EOF is seen at once: not the 60-s timeout
