"""Relative MSE of the gradient sketch vs uniform blockwise int8 on real gradients.

    python scripts/sketch_error.py [--steps 5] [--seed 0]

Gradients: the digits recipe's CNN on scikit-learn's digits (real data, a few SGD steps
in), and torchvision's ResNet-18 on one random batch (real architecture, synthetic data).
Each colayer is one 25 MiB bucket in backward order, each piece 1/4 of it (4 ranks), as
Canary sends them. Prints one row per model: sketch, int8 and their ratio (lower is better).
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from syncplane.comm import DEFAULT_BUCKET_BYTES, GradientSketch, Int8Blockwise, make_buckets, shard_bounds


def _pieces_error(grads: list[torch.Tensor], codec: GradientSketch | Int8Blockwise, pieces: int) -> float:
    err = total = 0.0
    for bucket in make_buckets(list(reversed(grads)), DEFAULT_BUCKET_BYTES):
        flat = bucket.pack()
        for lo, hi in shard_bounds(flat.numel(), pieces):
            x = flat[lo:hi].contiguous()
            y = codec.extract(codec.compress(x), x.numel())
            err += (x.double() - y.double()).pow(2).sum().item()
            total += x.double().pow(2).sum().item()
    return err / total


def _digits_grads(steps: int, seed: int) -> list[torch.Tensor]:
    from sklearn.datasets import load_digits

    from syncplane.recipes.digits import small_cnn

    torch.manual_seed(seed)
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    model = small_cnn(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        idx = torch.randint(0, len(y), (128,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if step < steps - 1:
            opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def _resnet18_grads(seed: int) -> list[torch.Tensor]:
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=100)
    images, labels = torch.randn(8, 3, 112, 112), torch.randint(0, 100, (8,))
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="SGD steps on digits before the measured gradient")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pieces", type=int, default=4, help="pieces per colayer (ranks)")
    args = parser.parse_args()
    table = Table(title=f"relative MSE on real gradients, {args.pieces} pieces per colayer")
    for col in ("gradients", "values", "sketch", "int8 (block 256)", "sketch / int8"):
        table.add_column(col, justify="left" if col == "gradients" else "right")
    for name, grads in (("digits CNN (real data)", _digits_grads(args.steps, args.seed)),
                        ("ResNet-18 (random batch)", _resnet18_grads(args.seed))):
        sketch = _pieces_error(grads, GradientSketch(), args.pieces)
        int8 = _pieces_error(grads, Int8Blockwise(256), args.pieces)
        table.add_row(name, f"{sum(g.numel() for g in grads):,}", f"{sketch:.2e}", f"{int8:.2e}", f"{sketch / int8:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
