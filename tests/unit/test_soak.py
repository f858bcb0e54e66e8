"""The soak's detector: what it counts is what the process holds, and its slope verdict
catches a slow leak while ignoring the warm-up. (The soak itself, real processes over
loopback, is ``syncplane soak``; its numbers are in the closing notes.)"""

from __future__ import annotations

import socket
import threading

import numpy as np

from syncplane.bench.soak import RSS_TOLERANCE_MB, rise, sample, verdict


def test_sample_counts_what_the_process_holds():
    before = sample()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    sock = socket.socket()
    try:
        during = sample()
    finally:
        sock.close()
        stop.set()
        thread.join()
    assert during["sockets"] == before["sockets"] + 1
    assert during["fds"] == before["fds"] + 1
    assert during["threads"] == before["threads"] + 1
    assert before["rss"] > 10 * 2**20


def _series(leak_per_step: float, steps: int = 10_000, warmup_jump: float = 0.0, noise: float = 0.0):
    rng = np.random.default_rng(7)
    at = list(range(0, steps, steps // 50))
    values = [100e6 + leak_per_step * s + (warmup_jump if s > steps // 10 else 0.0) + noise * rng.standard_normal()
              for s in at]
    return at, values


def test_a_kilobyte_per_step_is_caught_and_a_warm_up_is_not():
    at, leaking = _series(1024.0)
    assert abs(rise(at, leaking) - 1024.0 * at[-1]) < 1.0
    at, warm = _series(0.0, warmup_jump=30e6, noise=200e3)   # pools filled early, then flat with noise
    assert abs(rise(at, warm)) < 1e6
    flat = [{"rss": v, "fds": 40.0, "threads": 9.0, "sockets": 12.0} for v in warm]
    assert verdict(at, flat, RSS_TOLERANCE_MB)["flat"]
    grows = [{"rss": v, "fds": 40.0, "threads": 9.0, "sockets": 12.0} for v in leaking]
    assert not verdict(at, grows, RSS_TOLERANCE_MB)["flat"]


def test_one_descriptor_more_in_the_second_half_is_a_leak():
    at = list(range(0, 1000, 20))
    samples = [{"rss": 1e8, "fds": 40.0 + (i >= 40), "threads": 9.0, "sockets": 12.0} for i in range(len(at))]
    result = verdict(at, samples, RSS_TOLERANCE_MB)
    assert not result["flat"] and result["rise"]["fds"] > 0.5

