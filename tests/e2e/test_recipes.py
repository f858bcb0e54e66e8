"""The large recipes end to end through ``train.py`` at ``size=tiny``: 2 CPU processes over
gloo, on data generated here (JPEGs in an ImageFolder, a text file, IDX files) and read by
the recipes' real loading code."""

from __future__ import annotations

import gzip
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
# The GPU presets, brought down to this CPU machine (the rest of the preset stays as is).
ON_CPU = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "recipe.size=tiny",
          "recipe.num_workers=0"]


def train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_ok(run_dir: Path, *overrides: str) -> dict:
    result = train(*overrides, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank0.log", "rank1.log"}
    return json.loads((run_dir / "summary.json").read_text())


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def make_jpeg_folder(root: Path, classes: int = 3, train_per_class: int = 16, val_per_class: int = 4) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(count):
                # a class-dependent tint so there is something to learn
                pixels = rng.integers(0, 128, (40, 48, 3)) + 127 * (np.arange(3) == c)
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{split}_{c}_{i}.JPEG")
    return root


def make_corpus(path: Path, lines: int = 500) -> Path:
    rng = random.Random(0)
    words = ("the a cat dog sat on mat runs fast slow blue red green house tree river stone quick brown fox "
             "jumps over lazy bird sings song night day").split()
    with open(path, "w") as f:
        for i in range(lines):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))).capitalize() + ".\n")
            if i % 25 == 24:
                f.write("\n")   # a document boundary
    return path


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def make_fashion_idx(root: Path, train: int = 256, test: int = 64) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 100, (n, 28, 28)) + 15 * labels[:, None, None]
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return root


@pytest.mark.slow
def test_resnet50_preset_trains_tiny_on_cpu_from_an_image_folder(tmp_path):
    data = make_jpeg_folder(tmp_path / "imagenet")
    summary = run_ok(tmp_path / "run", "+experiment=resnet50_b32", *ON_CPU, f"recipe.data_root={data}",
                     "recipe.batch_size=8", "trainer.max_epochs=2", "recipe.label_smoothing=0.1")
    assert summary["recipe"] == "resnet50_imagenet" and summary["world_size"] == 2
    assert summary["steps"] == 2 * (48 // 2 // 8)           # 48 images, 2 ranks, batch 8, 2 epochs
    assert len(history(tmp_path / "run")) == 2
    assert summary["metrics"]["val_acc"] is not None and summary["metrics"]["val_loss"] > 0
    throughput = summary["throughput"]
    assert throughput["samples_per_s"] > 0 and throughput["model_flops_per_s"] > 0
    assert throughput["mfu"] is None and throughput["tokens_per_s"] is None   # CPU; not a language model


@pytest.mark.slow
def test_bert_phase1_preset_trains_tiny_on_cpu_from_a_text_file(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt")
    cache = tmp_path / "cache"
    summary = run_ok(tmp_path / "run", "+experiment=bert_large_phase1", *ON_CPU, f"recipe.data_files=[{corpus}]",
                     f"recipe.cache_dir={cache}", "recipe.batch_size=8", "recipe.seq_length=32",
                     "recipe.max_predictions=5", "recipe.val_fraction=0.2", "trainer.accumulate_grad_batches=2",
                     "trainer.max_steps=-1", "trainer.max_epochs=3")
    assert summary["recipe"] == "bert_large" and summary["steps"] > 0
    epochs = history(tmp_path / "run")
    assert len(epochs) == 3 and epochs[-1]["val_loss"] < epochs[0]["val_loss"], epochs
    throughput = summary["throughput"]
    # every sequence is a full block of 32 attended tokens, counted on both ranks
    assert throughput["tokens_per_s"] == pytest.approx(32 * throughput["samples_per_s"], rel=1e-9)
    assert throughput["model_flops_per_s"] > 0 and throughput["mfu"] is None
    # the WordPiece vocabulary was trained on the corpus, the blocks cached once
    vocab = next(cache.glob("wordpiece-*/vocab.txt")).read_text().splitlines()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and "river" in vocab
    assert len(list(cache.glob("blocks-*"))) == 1


@pytest.mark.slow
def test_bert_mlm_with_a_local_vocab_file_and_adamw(tmp_path):
    from syncplane.recipes.bert_large import train_wordpiece

    corpus = make_corpus(tmp_path / "corpus.txt")
    train_wordpiece([str(corpus)], tmp_path, vocab_size=200, lowercase=True)
    summary = run_ok(tmp_path / "run", "recipe=bert_large", "recipe.size=tiny", "recipe.num_workers=0",
                     f"recipe.data_files=[{corpus}]", f"recipe.val_files=[{corpus}]",
                     f"recipe.vocab_file={tmp_path / 'vocab.txt'}", f"recipe.cache_dir={tmp_path / 'cache'}",
                     "recipe.objective=mlm", "recipe.optimizer=adamw", "recipe.lr=0.001", "recipe.phase=1",
                     "recipe.seq_length=64", "recipe.batch_size=8", "trainer.max_epochs=1")
    assert summary["steps"] > 0 and summary["metrics"]["val_loss"] > 0
    assert summary["throughput"]["tokens_per_s"] == pytest.approx(64 * summary["throughput"]["samples_per_s"])
    assert not list((tmp_path / "cache").glob("wordpiece-*")), "a given vocab is used, not retrained"


@pytest.mark.slow
def test_fashion_mnist_trains_from_idx_files(tmp_path):
    """From Debian's real files where ``dataset-fashion-mnist`` is installed (``make setup``
    installs it as root): it learns. Else from IDX files generated here (random pixels): it
    trains. One launch either way: the reader is the same (``tests/unit/test_recipes.py``
    checks it on plain and gzipped files)."""
    real = DEBIAN_FASHION.is_dir()
    data = (["recipe.train_limit=4096", "recipe.val_limit=1000"] if real
            else [f"recipe.data_dir={make_fashion_idx(tmp_path / 'fashion')}", "recipe.batch_size=16"])
    summary = run_ok(tmp_path / "run", "recipe=fashion_mnist", "recipe.size=tiny", *data, "trainer.max_epochs=2")
    assert summary["recipe"] == "fashion_mnist" and summary["metrics"]["val_acc"] is not None
    assert summary["throughput"]["model_flops_per_s"] > 0 and summary["throughput"]["mfu"] is None
    if real:
        assert summary["metrics"]["val_acc"] > 0.6, summary["metrics"]   # chance is 0.1
    else:
        assert summary["steps"] == 2 * (256 // 2 // 16)


@pytest.mark.slow
def test_tiny_lm_learns_python_on_two_gloo_ranks(tmp_path):
    """The language-model recipe on its real corpus (a slice of the standard library), a
    BPE trained on it: validation loss falls from the uniform guess, epoch over epoch."""
    vocab = 300
    summary = run_ok(tmp_path / "run", "recipe=tiny_lm", "strategy=ddp", f"recipe.cache_dir={tmp_path / 'cache'}",
                     "recipe.train_mb=0.08", "recipe.val_mb=0.02", f"recipe.vocab_size={vocab}",
                     "recipe.seq_length=32", "recipe.batch_size=8", "trainer.max_epochs=2")
    epochs = history(tmp_path / "run")
    initial = math.log(vocab)      # the freshly initialized model's loss (tests/unit/test_tiny_lm.py)
    assert len(epochs) == 2 and epochs[1]["val_loss"] < epochs[0]["val_loss"] < initial - 0.5, epochs
    metrics = summary["metrics"]
    assert summary["recipe"] == "tiny_lm" and summary["world_size"] == 2 and summary["steps"] > 20
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-4)
    assert 0.05 < metrics["val_acc"] < 1.0                                   # next-token accuracy
    throughput = summary["throughput"]
    assert throughput["tokens_per_s"] == pytest.approx(32 * throughput["samples_per_s"], rel=1e-9)
    assert throughput["model_flops_per_s"] > 0
    assert [p.name.split("-")[0] for p in sorted((tmp_path / "cache").iterdir())] == ["bpe", "tokens"]


def test_a_missing_data_root_fails_before_any_worker_starts(tmp_path):
    """One recipe end to end; every recipe's missing data, in-process through the same
    ``launch_job``: ``tests/unit/test_launch_checks.py``."""
    message = "recipe.data_root: '/nonexistent/imagenet' is not a directory; expected <data_root>/train/<class>/"
    result = train("recipe=resnet50_imagenet", "recipe.data_root=/nonexistent/imagenet",
                   f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "run" / "logs").exists(), "no worker may start on a bad config"
