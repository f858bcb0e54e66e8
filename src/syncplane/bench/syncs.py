"""What the bench runner and its workers share: payload presets and how a step's compute is
split around a sync that overlaps part of it.

Which step each strategy runs, and behind which part of the compute, is declared by its
algorithm package (``syncplane.algorithms``: ``AlgorithmSpec.bench_step`` / ``overlap``).
"""

from __future__ import annotations


def compute_split(window: str | None, compute_s: float) -> tuple[float, float, float]:
    """(before launch, between launch and wait, after wait) seconds of one step's compute,
    forward : backward = 1 : 2 (their FLOP ratio), for a sync that runs behind ``window``:
    ``backward`` (DDP's buckets), ``forward`` (ATC: waited per module in the next forward),
    ``step`` (AWC: forward and backward) or None (blocking)."""
    forward, backward = compute_s / 3, 2 * compute_s / 3
    return {None: (compute_s, 0.0, 0.0), "backward": (forward, backward, 0.0),
            "forward": (0.0, forward, backward), "step": (0.0, compute_s, 0.0)}[window]


#: Payload presets: the real parameter bytes of the reference models (float32).
PRESETS_BYTES = {"resnet50": 25_557_032 * 4, "bert_large": 335_141_888 * 4}
