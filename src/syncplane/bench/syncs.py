"""What the bench runner and its workers share: payload presets, and how a step's compute is
split around a sync that overlaps part of it (``compute_split``, declared beside the overlap
windows in ``syncplane.algorithms.spec``: ``syncplane plan`` reads it too).

Which step each strategy runs, and behind which part of the compute, is declared by its
algorithm package (``syncplane.algorithms``: ``AlgorithmSpec.bench_step`` / ``overlap``).
"""

from __future__ import annotations

from syncplane.algorithms.spec import compute_split

__all__ = ["PRESETS_BYTES", "compute_split"]


#: Payload presets: the real parameter bytes of the reference models (float32).
PRESETS_BYTES = {"resnet50": 25_557_032 * 4, "bert_large": 335_141_888 * 4}
