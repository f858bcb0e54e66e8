"""The chunked top-k codec (SparseLoCo's): throughput of the compiled kernel next to the torch
reference, and size, compression ratio and error at each density and bit width.

    python scripts/bench_sparse_codec.py [--numel 25000000] [--repeats 3] [--device cpu|cuda]
                                         [--densities 0.01 0.03] [--chunk 4096] [--rounds 20]

MB/s counts the fp32 input the codec stands for (encode: fp32 in; decode: fp32 out), the
rate a pseudo-gradient is compressed or restored at. The error columns, on Student-t(3)
values (a heavy-tailed stand-in for a pseudo-gradient):
- ``rel. error``: ||decode(encode(x)) − x|| / ||x|| of one message -- mostly the values top-k
  leaves out (at 1 % density a single message carries only a small part of the energy);
- ``kept error``: the same on the kept positions only: what the 2/4/8-bit quantizer costs;
- ``EF error``: after ``--rounds`` rounds of error feedback (β = 1) on fresh values,
  ||Σ sent − Σ x|| / ||Σ x||: what a training run's sum of updates loses.
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
from syncplane.comm import ChunkedTopK, ErrorFeedback


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()  # warm-up (and first-use compilation)
    return statistics.median(timed() for _ in range(repeats))


def student_t3(numel: int, generator: torch.Generator) -> torch.Tensor:
    chi2 = torch.randn(3, numel, generator=generator).pow(2).sum(0)
    return torch.randn(numel, generator=generator) / (chi2 / 3).sqrt()


def throughput_rows(x: torch.Tensor, codec: ChunkedTopK, repeats: int, backends: list[str]) -> list[list[str]]:
    numel, rows = x.numel(), []
    encoded = torch.empty(codec.nbytes(numel), dtype=torch.uint8, device=x.device)
    out = torch.zeros(numel, device=x.device)
    for backend in backends:
        encode = median_seconds(lambda: kernels.sparse_encode(x, codec.k, codec.chunk, codec.bits, out=encoded,
                                                              backend=backend), repeats, x.device)
        decode = median_seconds(lambda: kernels.sparse_decode_add([encoded], out.zero_(), codec.k, codec.chunk,
                                                                  codec.bits, backend=backend), repeats, x.device)
        rows.append([backend, f"{codec.density:g}", str(codec.bits), f"{4 * numel / encode / 1e6:,.0f}",
                     f"{4 * numel / decode / 1e6:,.0f}"])
    return rows


def error_rows(x: torch.Tensor, codec: ChunkedTopK, rounds: int, generator: torch.Generator) -> list[str]:
    numel = x.numel()
    y = codec.extract(codec.compress(x), numel)
    kept = y != 0
    feedback = ErrorFeedback(codec, numel)
    sent, total = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(rounds):
        fresh = student_t3(numel, generator).to(x.device)
        sent += codec.extract(feedback.compress(fresh), numel).double().cpu()
        total += fresh.double().cpu()
    nbytes = codec.nbytes(numel)
    return [f"{codec.density:g}", str(codec.bits), f"{nbytes / 1e6:,.3f}", f"{4 * numel / nbytes:,.1f}x",
            f"{float((y - x).norm() / x.norm()):.3f}", f"{float((y[kept] - x[kept]).norm() / x[kept].norm()):.4f}",
            f"{float((sent - total).norm() / total.norm()):.4f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000_000, help="fp32 values in the buffer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=20, help="error-feedback rounds (on a 1/25 slice)")
    parser.add_argument("--skip-reference", action="store_true", help="time the compiled kernel only")
    args = parser.parse_args()

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    x = student_t3(args.numel, generator).to(device)
    backends = ["ext"] if args.skip_reference or device.type == "cuda" else ["ext", "torch"]
    speed = Table(title=f"sparse codec throughput, {args.numel:,} fp32 values on {args.device}, chunk {args.chunk}, "
                        f"{torch.get_num_threads()} threads (MB/s of fp32)")
    for col in ("implementation", "density", "bits", "encode MB/s", "decode MB/s"):
        speed.add_column(col, justify="left" if col == "implementation" else "right")
    sizes = Table(title=f"sparse codec size and error, {args.numel:,} Student-t(3) values, chunk {args.chunk}")
    for col in ("density", "bits", "MB", "vs fp32", "rel. error", "kept error", f"EF error ({args.rounds} rounds)"):
        sizes.add_column(col, justify="right")
    ef_slice = x[: max(args.chunk, args.numel // 25)]
    for density in args.densities:
        for bits in args.bits:
            codec = ChunkedTopK(density, bits, args.chunk)
            for row in throughput_rows(x, codec, args.repeats, backends if bits == 2 else ["ext"]):
                speed.add_row(*row)
            row = error_rows(x, codec, 0, generator)
            row[-1] = error_rows(ef_slice, codec, args.rounds, generator)[-1]
            sizes.add_row(*row)
    console = Console()
    console.print(speed)
    console.print(sizes)


if __name__ == "__main__":
    main()
