"""``tiny_lm``: a causal transformer language model on Python's own standard library.

The workload for DiLoCo and compression claims: what those methods are judged on is
language-model loss, and this one trains on CPU in minutes. Nothing is downloaded:

- **Corpus.** The ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, tests, ``site-packages`` and files over
  ``max_file_kb`` left out), or any other source tree given as ``corpus_root``. Real code
  written by hundreds of people over thirty years: long-range structure (indentation,
  names defined far above their use), docstrings and comments in English, a heavy-tailed
  token distribution -- what code LMs train on, not a synthetic toy.
- **Fixed split, by file.** Files are put in the order of the SHA-1 of
  ``"{split_seed}/{relative path}"`` (a fixed shuffle, independent of the file system and
  of the rank); the first ``val_mb`` of them are the held-out set, the next ``train_mb``
  the training set. A file is in one split only.
- **Tokenizer.** A byte-level BPE (HF ``tokenizers``, the ``nlp`` extra) trained once on
  the training split and cached under ``cache_dir`` keyed by the training files' content
  and the vocabulary size, or ``tokenizer=byte`` (256 byte values, no training). The
  token streams of both splits are cached beside it. Files are joined with an
  end-of-text token.
- **Examples.** The stream cut into consecutive windows of ``seq_length + 1`` tokens
  (inputs and their next tokens); Lightning's DistributedSampler shards them.
- **Model.** A pre-LayerNorm GPT (learned positions, GELU MLP, tied input/output
  embedding, PyTorch's fused causal attention); ``size=tiny|small|base`` is about
  1.3 M / 8.8 M / 27 M parameters at the default 4,096-token vocabulary.

- **Optimizer.** ``optimizer=adamw`` (default) or ``muon``: ``torch.optim.Muon`` on the
  transformer blocks' weight matrices and AdamW on the rest (embeddings and the tied head,
  LayerNorms, biases), as MuLoCo's inner optimizer; one peak ``lr`` and schedule for both
  (Muon's step matched to AdamW's update RMS, ``recipes.optim.MuonAdamW``).

Metrics: ``val_loss`` (mean next-token cross-entropy in nats, weighted by tokens over the
whole validation set), ``val_perplexity`` (its exponential) and ``val_acc`` (next-token
accuracy); ``summary.json`` gets ``throughput.tokens_per_s``.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric

from syncplane.config import ConfigError
from syncplane.recipes import Recipe
from syncplane.recipes.cache import fingerprint, publish
from syncplane.recipes.flops import train_flops_per_sample
from syncplane.recipes.optim import MuonAdamW, decay_groups, hidden_matrices, schedule_factor

EOT = "<|endoftext|>"
# (layers, hidden, heads) per size: ~1.3 M, ~8.8 M, ~27 M parameters at vocabulary 4096
DIMENSIONS = {"tiny": (4, 128, 4), "small": (6, 320, 5), "base": (8, 512, 8)}
DEFAULT_LR = {"tiny": 2e-3, "small": 1e-3, "base": 6e-4}  # AdamW peak; smaller models take larger steps
# folders that are not the library itself: tests (some deliberately malformed), installed packages
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass
class TinyLmSettings:
    size: Literal["tiny", "small", "base"] = "tiny"
    corpus_root: str | None = None   # a source tree; null: this interpreter's standard library
    pattern: str = "*.py"            # which files of corpus_root are text
    max_file_kb: int = 256           # larger files (generated tables, pydoc's topics) are left out
    train_mb: float = 2.0            # training text, whole files in the split order
    val_mb: float = 0.2              # held-out text, the files before the training ones
    split_seed: int = 0              # the file order (and so the split) for every run and rank
    tokenizer: Literal["bpe", "byte"] = "bpe"
    vocab_size: int = 4096           # bpe only (byte: 256 + end-of-text)
    cache_dir: str = "~/.cache/syncplane/tiny_lm"  # trained tokenizer and token streams
    seq_length: int = 128
    batch_size: int = 16             # sequences per rank
    optimizer: Literal["adamw", "muon"] = "adamw"   # muon: Muon on the blocks' matrices, AdamW on the rest
    lr: float | None = None          # peak; null: 2e-3 (tiny), 1e-3 (small), 6e-4 (base)
    weight_decay: float = 0.1        # never on LayerNorm parameters and biases
    warmup: float = 0.05             # fraction of all optimizer steps, then cosine decay to 0
    dropout: float = 0.0

    def validate(self) -> None:
        if self.size not in DIMENSIONS:
            raise ConfigError(f"size: one of {', '.join(DIMENSIONS)}, got {self.size!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"optimizer: adamw or muon, got {self.optimizer!r}")
        if self.tokenizer not in ("bpe", "byte"):
            raise ConfigError(f"tokenizer: bpe or byte, got {self.tokenizer!r}")
        for key in ("batch_size", "seq_length", "max_file_kb"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.train_mb <= 0 or self.val_mb <= 0:
            raise ConfigError(f"train_mb, val_mb: must be positive, got {self.train_mb}, {self.val_mb}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"lr: must be positive (or null), got {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"warmup: a fraction of the steps in [0, 1), got {self.warmup}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.tokenizer == "bpe":
            if self.vocab_size < 257 + 1:
                raise ConfigError(f"vocab_size: a byte-level BPE needs more than 257 tokens (bytes and {EOT}), "
                                  f"got {self.vocab_size}")
            try:
                import tokenizers  # noqa: F401
            except ImportError:
                raise ConfigError("tokenizer: bpe needs the 'tokenizers' package (pip install 'syncplane[nlp]'); "
                                  "or set recipe.tokenizer=byte") from None
        select_corpus(self)

    def root(self) -> Path:
        return Path(self.corpus_root or sysconfig.get_paths()["stdlib"]).expanduser()

    def model_vocab(self) -> int:
        return self.vocab_size if self.tokenizer == "bpe" else 257

    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.size]


# ------------------------------------------------------------------ corpus and split

@dataclass(frozen=True)
class Corpus:
    """The held-out and training files (relative to ``root``), each in split order."""

    root: Path
    train: tuple[str, ...]
    val: tuple[str, ...]

    def texts(self, split: Literal["train", "val"]) -> list[str]:
        return [(self.root / name).read_bytes().decode("utf-8", errors="replace") for name in getattr(self, split)]

    def identity(self, split: Literal["train", "val"]) -> list[tuple[str, str]]:
        """(relative path, SHA-1 of the content) of each file: the cache key of what is built from it."""
        return [(name, hashlib.sha1((self.root / name).read_bytes()).hexdigest()) for name in getattr(self, split)]


def source_files(root: Path, pattern: str, max_bytes: int) -> list[str]:
    """Files under ``root`` matching ``pattern`` (relative POSIX paths, sorted), outside
    ``EXCLUDED_DIRS``, non-empty and at most ``max_bytes``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in files:
            path = Path(folder) / name
            if path.match(pattern) and 0 < path.stat().st_size <= max_bytes:
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def split_order(names: list[str], seed: int) -> list[str]:
    """``names`` in a fixed pseudo-random order: by SHA-1 of ``"{seed}/{name}"``."""
    return sorted(names, key=lambda name: hashlib.sha1(f"{seed}/{name}".encode()).hexdigest())


def select_corpus(settings: TinyLmSettings) -> Corpus:
    """The fixed, by-file split: in ``split_order``, files go to validation until it holds
    ``val_mb``, then to training until it holds ``train_mb`` (the last file of each may
    overshoot). A ConfigError when the tree cannot fill both."""
    root = settings.root()
    if not root.is_dir():
        raise ConfigError(f"corpus_root: {str(root)!r} is not a directory")
    names = split_order(source_files(root, settings.pattern, settings.max_file_kb * 1024), settings.split_seed)
    splits: dict[str, list[str]] = {"val": [], "train": []}
    budgets = {"val": settings.val_mb * 1e6, "train": settings.train_mb * 1e6}
    filled = dict.fromkeys(splits, 0)
    for name in names:
        split = "val" if filled["val"] < budgets["val"] else "train"
        if split == "train" and filled["train"] >= budgets["train"]:
            break
        splits[split].append(name)
        filled[split] += (root / name).stat().st_size
    if not splits["train"]:
        raise ConfigError(f"corpus_root: {str(root)!r} has {filled['val'] / 1e6:.2f} MB of {settings.pattern!r} "
                          f"files (at most {settings.max_file_kb} KB each): nothing is left for training after "
                          f"val_mb={settings.val_mb}")
    return Corpus(root, tuple(splits["train"]), tuple(splits["val"]))


# ------------------------------------------------------------------ tokenizers

def train_bpe(texts: list[str], vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE (GPT-2's pre-tokenization) on ``texts``; writes ``tokenizer.json``.
    ``EOT`` is token 0; every byte is in the alphabet, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))


class ByteCodec:
    """The ``byte`` tokenizer: UTF-8 bytes 0..255, end-of-text 256."""

    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class BpeCodec:
    """A trained ``tokenizer.json``; end-of-text is its ``EOT`` token."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.eot = self.tokenizer.token_to_id(EOT)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids


def encode_stream(texts: list[str], codec: ByteCodec | BpeCodec) -> np.ndarray:
    """The files' tokens, each file followed by end-of-text, as one int32 array."""
    ids: list[int] = []
    for text in texts:
        ids.extend(codec.encode(text))
        ids.append(codec.eot)
    return np.asarray(ids, dtype=np.int32)


class TokenWindows(Dataset):
    """Window ``i`` is ``stream[i*T : i*T + T + 1]``: ``T`` inputs and their next tokens."""

    def __init__(self, stream: torch.Tensor, seq_length: int) -> None:
        self.stream, self.seq_length = stream, seq_length

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_length)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_length
        return self.stream[start:start + self.seq_length + 1].long()


class TinyLmData(LightningDataModule):
    """Corpus -> tokenizer (trained once) -> token streams (cached) -> windows.

    ``prepare_data`` (local rank 0) builds the cache; ``setup`` (every rank) only reads it.
    """

    def __init__(self, settings: TinyLmSettings) -> None:
        super().__init__()
        self.settings = settings
        self.cache = Path(settings.cache_dir).expanduser()
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def tokenizer_dir(self, corpus: Corpus) -> Path | None:
        """Where the BPE trained on ``corpus``'s training files lives; None for bytes."""
        s = self.settings
        if s.tokenizer == "byte":
            return None
        return self.cache / f"bpe-{fingerprint(corpus.identity('train'), s.vocab_size)}"

    def streams_dir(self, corpus: Corpus) -> Path:
        tokenizer = self.tokenizer_dir(corpus)
        tokenizer_id = ("byte" if tokenizer is None
                        else hashlib.sha1((tokenizer / "tokenizer.json").read_bytes()).hexdigest())
        return self.cache / f"tokens-{fingerprint(tokenizer_id, corpus.identity('train'), corpus.identity('val'))}"

    def codec(self, corpus: Corpus) -> ByteCodec | BpeCodec:
        tokenizer = self.tokenizer_dir(corpus)
        return ByteCodec() if tokenizer is None else BpeCodec(tokenizer / "tokenizer.json")

    def prepare_data(self) -> None:
        corpus = select_corpus(self.settings)
        tokenizer = self.tokenizer_dir(corpus)
        if tokenizer is not None:
            publish(lambda tmp: train_bpe(corpus.texts("train"), self.settings.vocab_size, tmp), tokenizer)

        def tokenize(tmp: Path) -> None:
            codec = self.codec(corpus)
            for split in ("train", "val"):
                np.save(tmp / f"{split}.npy", encode_stream(corpus.texts(split), codec))

        publish(tokenize, self.streams_dir(corpus))

    def setup(self, stage: str) -> None:
        folder = self.streams_dir(select_corpus(self.settings))
        seq = self.settings.seq_length
        train, val = (torch.from_numpy(np.load(folder / f"{split}.npy")) for split in ("train", "val"))
        self.train_set, self.val_set = TokenWindows(train, seq), TokenWindows(val, seq)
        for name, windows in (("train", self.train_set), ("val", self.val_set)):
            if len(windows) == 0:
                raise ValueError(f"seq_length: the {name} split has {len(windows.stream)} tokens, fewer than one "
                                 f"window of {seq + 1}; raise {name}_mb or lower seq_length")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.settings.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=4 * self.settings.batch_size)


# ------------------------------------------------------------------ model

class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    """GPT-style decoder: token + learned position embeddings, blocks, final LayerNorm,
    output projection tied to the token embedding. GPT-2's initialization: N(0, 0.02),
    residual output projections scaled by 1/sqrt(2 * layers)."""

    def __init__(self, vocab: int, seq_length: int, layers: int, hidden: int, heads: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq_length, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def causal_lm(size: str, vocab: int, seq_length: int, dropout: float = 0.0) -> CausalLM:
    layers, hidden, heads = DIMENSIONS[size]
    return CausalLM(vocab, seq_length, layers, hidden, heads, dropout)


def next_token_loss(model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, logits) of predicting ``windows[:, 1:]`` from ``windows[:, :-1]``."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten()), logits


class Perplexity(MeanMetric):
    """exp of the token-weighted mean loss over the whole validation set (all ranks)."""

    def compute(self) -> torch.Tensor:
        return super().compute().exp()


class TinyLm(LightningModule):
    """Next-token cross-entropy with AdamW (or Muon and AdamW), linear warm-up and cosine decay."""

    def __init__(self, settings: TinyLmSettings) -> None:
        super().__init__()
        self.settings = settings
        self.model = causal_lm(settings.size, settings.model_vocab(), settings.seq_length, settings.dropout)
        # token-weighted over the whole set, synchronized across ranks when computed
        self.val_loss, self.val_acc, self.val_perplexity = MeanMetric(), MeanMetric(), Perplexity()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, _ = next_token_loss(self.model, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, logits = next_token_loss(self.model, batch)
        tokens = batch[:, 1:].numel()
        accuracy = (logits.argmax(-1) == batch[:, 1:]).float().mean()
        for name, metric, value in (("val_loss", self.val_loss, loss), ("val_acc", self.val_acc, accuracy),
                                    ("val_perplexity", self.val_perplexity, loss)):
            metric.update(value.detach(), weight=tokens)
            self.log(name, metric, on_step=False, on_epoch=True, prog_bar=name != "val_perplexity")

    def batch_tokens(self, batch: torch.Tensor) -> int:
        """Input tokens in a batch (the run report's tokens/s)."""
        return batch.shape[0] * (batch.shape[1] - 1)

    def train_flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sequence, counted on the meta device."""
        s = self.settings
        return train_flops_per_sample(
            partial(causal_lm, s.size, s.model_vocab(), s.seq_length),
            lambda n: torch.zeros(n, s.seq_length + 1, dtype=torch.long),
            lambda model, batch: next_token_loss(model, batch)[0])

    def make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW, or Muon on the blocks' matrices and AdamW on the rest (``optimizer``)."""
        s = self.settings
        groups = decay_groups(self.model, s.weight_decay)
        if s.optimizer == "muon":
            matrices = hidden_matrices(self.model)
            split = [{**g, "params": [p for p in g["params"] if (id(p) in matrices) is muon], "muon": muon}
                     for g in groups for muon in (True, False)]
            optimizer: torch.optim.Optimizer = MuonAdamW([g for g in split if g["params"]], lr=s.peak_lr(),
                                                         betas=(0.9, 0.95))
        else:
            optimizer = torch.optim.AdamW(groups, lr=s.peak_lr(), betas=(0.9, 0.95))
        return optimizer

    def configure_optimizers(self):  # type: ignore[override]
        s = self.settings
        optimizer = self.make_optimizer()
        total = max(1, int(self.trainer.estimated_stepping_batches))
        factor = schedule_factor("cosine", total_steps=total, warmup_steps=round(s.warmup * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build(settings: TinyLmSettings) -> tuple[TinyLm, TinyLmData]:
    return TinyLm(settings), TinyLmData(settings)


RECIPE = Recipe(name="tiny_lm", settings=TinyLmSettings, build=build,
                description="causal transformer LM on Python's standard library (CPU, bundled text)")
