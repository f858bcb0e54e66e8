"""Throughput of syncplane's compiled kernels next to the torch reference and a plain copy.

    python scripts/bench_kernels.py [--mb 64] [--tensors 160] [--repeats 15]

GB/s counts the bytes each kernel must read and write (pack: read + write the payload;
combine with k neighbours: read (k+1) buffers, write one), except the gradient sketch rows,
which count the fp32 payload it stands for (encode: fp32 in; decode: fp32 out) -- the
rate a gradient is compressed or restored at. "copy" is one
``torch.Tensor.copy_`` of the payload -- the memory-bandwidth ceiling for a pack.
Run it on an idle machine; numbers vary with the other core's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from syncplane import kernels
from syncplane.comm import GradientSketch


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (and first-use compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=64.0, help="payload size in MB (float32)")
    parser.add_argument("--tensors", type=int, default=160, help="tensors the payload is split into (pack/unpack)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    numel = int(args.mb * 2**20 / 4)
    sizes = [numel // args.tensors] * args.tensors
    sizes[-1] += numel - sum(sizes)
    tensors = [torch.randn(s) for s in sizes]
    flat = torch.empty(numel)
    payload = numel * 4
    rows: list[tuple[str, str, float]] = []

    def add(kernel: str, impl: str, bytes_moved: int, fn: Callable[[], object]) -> None:
        rows.append((kernel, impl, bytes_moved / median_seconds(fn, args.repeats) / 1e9))

    source = torch.randn(numel)
    add("copy (ceiling)", "torch copy_", 2 * payload, lambda: flat.copy_(source))
    for impl in ("ext", "torch"):
        add("pack", impl, 2 * payload, lambda impl=impl: kernels.pack(tensors, flat, backend=impl))
        add("pack x0.5", impl, 2 * payload, lambda impl=impl: kernels.pack(tensors, flat, 0.5, backend=impl))
        add("unpack", impl, 2 * payload, lambda impl=impl: kernels.unpack(flat, tensors, backend=impl))
    x = torch.randn(numel)
    out = torch.empty(numel)
    for k in (1, 2, 4):
        ys = [torch.randn(numel) for _ in range(k)]
        weights = [1.0 / (k + 1)] * k
        for impl in ("ext", "torch"):
            add(f"combine k={k}", impl, (k + 2) * payload,
                lambda impl=impl, ys=ys, weights=weights: kernels.weighted_combine(
                    x, ys, weights, 1.0 / (k + 1), out=out, backend=impl))

    sketch = GradientSketch()
    k = sketch.exact_count(numel)
    encoded = torch.empty(kernels.sketch_nbytes(numel, k), dtype=torch.uint8)
    for impl in ("ext", "torch"):
        add("sketch encode", impl, payload, lambda impl=impl: kernels.sketch_encode(
            x, k, sketch.sample, sketch.quantile_weight, out=encoded, backend=impl))
        add("sketch decode", impl, payload, lambda impl=impl: kernels.sketch_decode(
            encoded, k, numel, out=out, backend=impl))

    table = Table(title=f"syncplane kernels, {args.mb:g} MB float32, {torch.get_num_threads()} threads")
    for col in ("kernel", "implementation", "GB/s"):
        table.add_column(col, justify="right" if col == "GB/s" else "left")
    for kernel, impl, gbps in rows:
        table.add_row(kernel, impl, f"{gbps:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
