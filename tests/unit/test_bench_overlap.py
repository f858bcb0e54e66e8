"""The bench's overlap accounting: a sync that runs behind part of the step's compute is
charged only for what stays exposed; one that blocks is charged in full."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from syncplane.algorithms import spec_for
from syncplane.bench.syncs import compute_split
from syncplane.bench.worker import timed_step
from syncplane.comm import CommMeter


@pytest.mark.parametrize("window", [None, "backward", "forward", "step"])
def test_compute_split_spends_the_whole_compute_once(window):
    before, during, after = compute_split(window, 0.9)
    assert before + during + after == pytest.approx(0.9)
    assert during == pytest.approx({None: 0.0, "backward": 0.6, "forward": 0.3, "step": 0.9}[window])


def test_the_strategies_overlap_where_they_schedule_their_sync():
    window = {name: spec_for(name).overlap.get(name) for name in ("ddp", "atc", "h_atc", "awc", "h_awc",
                                                                   "ds_sync", "diloco")}
    assert window["ddp"] == "backward"                      # bucket all-reduces during the backward
    assert window["atc"] == window["h_atc"] == "forward"    # waited per module in the next forward
    assert window["awc"] == window["h_awc"] == "step"       # combined after the backward
    assert window["ds_sync"] is None and window["diloco"] is None


class SleepySync:
    """A sync whose communication takes ``seconds`` on a background thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.thread = seconds, None

    def launch(self, payload, step, meter) -> None:
        self.thread = threading.Thread(target=time.sleep, args=(self.seconds,))
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()

    def __call__(self, payload, step, meter) -> None:
        self.launch(payload, step, meter)
        self.wait()


def test_a_sync_hidden_behind_compute_is_not_charged_and_a_blocking_one_is():
    payload = torch.zeros(4)
    hidden = timed_step(SleepySync(0.3), payload, 0, CommMeter(), "step", compute_s=0.6)
    assert hidden < 0.15                                   # 0.3 s of comm behind 0.6 s of compute
    partly = timed_step(SleepySync(0.6), payload, 0, CommMeter(), "forward", compute_s=0.6)
    assert 0.6 - 0.2 <= partly < 0.6 - 0.2 + 0.15          # only the forward (0.2 s) hides it
    blocking = timed_step(SleepySync(0.3), payload, 0, CommMeter(), None, compute_s=0.6)
    assert blocking >= 0.3
