"""``bert_large``: BERT-large pre-training (MLM + NSP, or MLM only) on the user's text files.

The model is Hugging Face ``transformers``' ``BertForPreTraining`` (or
``BertForMaskedLM``) built from a ``BertConfig`` -- 24 layers, hidden 1024, 16 heads,
≈335 M parameters -- with random weights: nothing is downloaded, ever (the HF offline
switches are set before the libraries load). Data: HF ``datasets`` reads local text
files (one sentence or paragraph per line); a WordPiece tokenizer comes from a local
``vocab.txt`` or is trained with ``tokenizers`` on the same corpus. The token stream is
cut into blocks; each example is ``[CLS] A [SEP] B [SEP]`` where B continues A or, half
the time for NSP, comes from another block (block boundaries ignore documents, as in
RoBERTa's FULL-SENTENCES). Masking follows Devlin et al.: 15% of the tokens, at most
``max_predictions`` per sequence, 80% [MASK] / 10% random / 10% kept, drawn anew every
time a batch is made. The MLM head runs only on the masked positions (as in Google's and
NVIDIA's implementations), so a sequence costs what the original did.

Phase 1 (sequence 128, 20 predictions) is the default; ``phase=2`` is 512 / 80.
``size=tiny`` keeps everything but shrinks the encoder (2 layers, hidden 64) and the
trained vocabulary, so it runs on CPU. Throughput: samples/s in ``summary.json`` are
sequences/s; ``throughput.tokens_per_s`` counts attended tokens.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

# Never reach the Hub: set before transformers/datasets are imported (they read these once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers fork after tokenizing

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from syncplane.config import ConfigError  # noqa: E402
from syncplane.recipes import Recipe  # noqa: E402
from syncplane.recipes.cache import fingerprint, publish  # noqa: E402
from syncplane.recipes.flops import train_flops_per_sample  # noqa: E402
from syncplane.recipes.optim import Lamb, decay_groups, schedule_factor  # noqa: E402

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# (layers, hidden, heads, intermediate) per size; BERT-large is Devlin et al.'s Table 1
DIMENSIONS = {"full": (24, 1024, 16, 4096), "tiny": (2, 64, 2, 256)}
PHASES = {1: (128, 20), 2: (512, 80)}  # sequence length, max masked predictions per sequence


@dataclass
class BertSettings:
    data_files: list[str] = field(default_factory=list)  # text files, folders (their *.txt) or globs
    val_files: list[str] = field(default_factory=list)   # empty: hold out val_fraction of the blocks
    val_fraction: float = 0.01
    vocab_file: str | None = None  # a WordPiece vocab.txt; null: train one on data_files
    vocab_size: int | None = None  # size to train; null: 30522 (full), 1000 (tiny)
    lowercase: bool = True
    cache_dir: str = "~/.cache/syncplane/bert"  # trained tokenizer and tokenized blocks
    size: Literal["full", "tiny"] = "full"
    phase: Literal[1, 2] = 1
    seq_length: int | None = None       # null: 128 (phase 1), 512 (phase 2)
    max_predictions: int | None = None  # null: 20 (phase 1), 80 (phase 2)
    mask_probability: float = 0.15
    objective: Literal["pretraining", "mlm"] = "pretraining"  # MLM + next-sentence, or MLM only
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.01          # never on LayerNorm parameters and biases
    warmup: float = 0.01                # fraction of all optimizer steps
    schedule: Literal["linear", "cosine"] = "linear"
    batch_size: int = 32                # sequences per rank
    num_workers: int = 2
    split_seed: int = 0

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"warmup: a fraction of the steps in [0, 1), got {self.warmup}")
        if not 0.0 < self.mask_probability < 1.0:
            raise ConfigError(f"mask_probability: must be in (0, 1), got {self.mask_probability}")
        if not self.val_files and not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction: must be in (0, 1) when val_files is empty, got {self.val_fraction}")
        seq, preds = self.shape()
        if not 8 <= seq <= 512:
            raise ConfigError(f"seq_length: must be between 8 and 512 (BERT's position table), got {seq}")
        if not 1 <= preds <= seq - 3:
            raise ConfigError(f"max_predictions: must be between 1 and seq_length - 3 = {seq - 3}, got {preds}")
        if self.vocab_size is not None and self.vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ConfigError(f"vocab_size: must be larger than {len(SPECIAL_TOKENS)}, got {self.vocab_size}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers: must be >= 0, got {self.num_workers}")
        resolve_files(self.data_files, "data_files", required=True)
        resolve_files(self.val_files, "val_files", required=False)
        if self.vocab_file is not None:
            read_vocab(self.vocab_file)

    def shape(self) -> tuple[int, int]:
        """(sequence length, max predictions) after the phase defaults."""
        seq, preds = PHASES[self.phase]
        return self.seq_length or seq, self.max_predictions or preds

    def target_vocab_size(self) -> int:
        return self.vocab_size or (30522 if self.size == "full" else 1000)


def resolve_files(patterns: list[str], key: str, required: bool) -> list[str]:
    """Text files named by ``patterns`` (files, folders -> their ``*.txt``, globs), sorted."""
    if required and not patterns:
        raise ConfigError(f"{key}: required -- list local text files (one sentence or paragraph per line), "
                          f"e.g. recipe.{key}=[/data/wiki/*.txt]")
    files: list[str] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        matches = (sorted(str(p) for p in path.glob("*.txt")) if path.is_dir()
                   else [str(path)] if path.is_file() else sorted(glob.glob(str(path))))
        matches = [m for m in matches if Path(m).is_file() and Path(m).stat().st_size > 0]
        if not matches:
            raise ConfigError(f"{key}: {pattern!r} matches no non-empty text file")
        files.extend(matches)
    return files


def read_vocab(vocab_file: str) -> dict[str, int]:
    """A WordPiece vocabulary (one token per line) that has BERT's special tokens."""
    path = Path(vocab_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"vocab_file: {vocab_file!r} does not exist; give a WordPiece vocab.txt (one token "
                          "per line, with [PAD] [UNK] [CLS] [SEP] [MASK]) or null to train one on data_files")
    tokens = path.read_text(encoding="utf-8").splitlines()
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ConfigError(f"vocab_file: {vocab_file!r} lacks the special token(s) {', '.join(missing)}")
    return {t: i for i, t in enumerate(tokens)}


def _files_identity(files: list[str]) -> list[tuple[str, int, int]]:
    return [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]


class BertData(LightningDataModule):
    """Text files -> WordPiece ids -> fixed-length blocks (prepared once per node, cached)."""

    def __init__(self, settings: BertSettings) -> None:
        super().__init__()
        self.settings = settings
        self.cache = Path(settings.cache_dir).expanduser()
        self.train_set: PairedBlocks | None = None
        self.val_set: PairedBlocks | None = None
        self.collate: MaskingCollator | None = None

    # -------------------------------------------------------------- paths

    def vocab_path(self) -> Path:
        s = self.settings
        if s.vocab_file is not None:
            return Path(s.vocab_file).expanduser()
        files = resolve_files(s.data_files, "data_files", required=True)
        key = fingerprint(_files_identity(files), s.target_vocab_size(), s.lowercase)
        return self.cache / f"wordpiece-{key}" / "vocab.txt"

    def blocks_path(self) -> Path:
        """Where the tokenized train/val blocks live (a saved HF ``DatasetDict``)."""
        s = self.settings
        train = resolve_files(s.data_files, "data_files", required=True)
        val = resolve_files(s.val_files, "val_files", required=False)
        vocab_hash = hashlib.sha1(self.vocab_path().read_bytes()).hexdigest()
        key = fingerprint(_files_identity(train), _files_identity(val), vocab_hash, s.lowercase, s.shape()[0],
                           s.val_fraction if not val else None, s.split_seed)
        return self.cache / f"blocks-{key}"

    # -------------------------------------------------------------- preparing (local rank 0)

    def prepare_data(self) -> None:
        s = self.settings
        vocab = self.vocab_path()
        train_files = resolve_files(s.data_files, "data_files", required=True)
        if s.vocab_file is None:
            publish(lambda tmp: train_wordpiece(train_files, tmp, s.target_vocab_size(), s.lowercase), vocab.parent)
        publish(lambda tmp: self._split_blocks(vocab).save_to_disk(str(tmp)), self.blocks_path())

    def _split_blocks(self, vocab: Path) -> Any:
        from datasets import DatasetDict

        s = self.settings
        block, hf_cache = s.shape()[0] - 3, self.cache / "hf"
        train = tokenize_into_blocks(resolve_files(s.data_files, "data_files", True), vocab, s.lowercase, block,
                                     hf_cache)
        if s.val_files:
            val = tokenize_into_blocks(resolve_files(s.val_files, "val_files", True), vocab, s.lowercase, block,
                                       hf_cache)
            return DatasetDict(train=train, val=val)
        if len(train) < 2:
            raise ValueError(f"data_files: the corpus gives {len(train)} block of {block} tokens; need at least 2 "
                             "to hold some out for validation (or give val_files)")
        parts = train.train_test_split(test_size=max(1, round(len(train) * s.val_fraction)), seed=s.split_seed)
        return DatasetDict(train=parts["train"], val=parts["test"])

    # -------------------------------------------------------------- every rank

    def setup(self, stage: str) -> None:
        from datasets import load_from_disk

        s = self.settings
        vocab = read_vocab(str(self.vocab_path()))
        model_vocab = len(vocab) if s.vocab_file is not None else s.target_vocab_size()
        if len(vocab) > model_vocab:
            raise ValueError(f"vocab_size: the trained vocabulary has {len(vocab)} tokens (the alphabet alone can "
                             f"exceed a small target), more than the model's {model_vocab}; raise vocab_size")
        blocks = load_from_disk(str(self.blocks_path()))
        ids = {name: vocab[name] for name in SPECIAL_TOKENS}
        nsp = s.objective == "pretraining"
        self.train_set = PairedBlocks(blocks["train"], ids, nsp, s.split_seed)
        self.val_set = PairedBlocks(blocks["val"], ids, nsp, s.split_seed + 1)
        self.collate = MaskingCollator(ids, len(vocab), s.shape()[1], s.mask_probability)

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.settings.num_workers
        return DataLoader(dataset, batch_size=self.settings.batch_size, shuffle=train, drop_last=train,
                          collate_fn=self.collate, num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=self.trainer is not None and self.trainer.strategy.root_device.type == "cuda")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, train=False)


def train_wordpiece(files: list[str], out_dir: Path, vocab_size: int, lowercase: bool) -> None:
    """Train a BERT WordPiece vocabulary on ``files`` with HF ``tokenizers``; writes ``vocab.txt``."""
    from tokenizers.implementations import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=lowercase)
    tokenizer.train(files, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                    show_progress=False)
    tokenizer.save_model(str(out_dir))


def tokenize_into_blocks(files: list[str], vocab: Path, lowercase: bool, block: int, hf_cache: Path) -> Any:
    """HF ``datasets``: read the lines, tokenize (no special tokens), and cut the
    concatenated stream into rows of exactly ``block`` ids (a short tail is dropped)."""
    import datasets
    from transformers import BertTokenizerFast

    datasets.disable_progress_bars()  # rank logs are files, not terminals

    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=lowercase)
    lines = datasets.load_dataset("text", data_files=files, split="train", cache_dir=str(hf_cache))
    lines = lines.filter(lambda batch: [bool(t.strip()) for t in batch["text"]], batched=True)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False,
                                 return_token_type_ids=False)["input_ids"]}

    def cut(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        stream = [i for ids in batch["ids"] for i in ids]
        return {"ids": [stream[k:k + block] for k in range(0, len(stream) - block + 1, block)]}

    tokens = lines.map(tokenize, batched=True, remove_columns=["text"])
    blocks = tokens.map(cut, batched=True, batch_size=4096)
    if len(blocks) == 0:
        total = sum(len(ids) for ids in tokens["ids"])
        raise ValueError(f"data_files: {total} tokens in {', '.join(files)} -- fewer than one block of {block}")
    return blocks


class PairedBlocks(Dataset):
    """``[CLS] A [SEP] B [SEP]`` from one block: B is A's continuation, or (NSP, p=0.5) the
    same-length tail of another block. The pairing is a fixed function of the index."""

    def __init__(self, blocks: Any, ids: dict[str, int], nsp: bool, seed: int) -> None:
        self.blocks = blocks.with_format("numpy")
        self.ids, self.nsp, self.seed = ids, nsp, seed

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        block = self.blocks[index]["ids"]
        cut = int(rng.integers(1, len(block)))
        tail, is_random = block[cut:], 0
        if self.nsp and len(self.blocks) > 1 and rng.random() < 0.5:
            other = int(rng.integers(len(self.blocks) - 1))
            other += other >= index
            tail, is_random = self.blocks[other]["ids"][cut:], 1
        cls, sep = self.ids["[CLS]"], self.ids["[SEP]"]
        input_ids = np.concatenate([[cls], block[:cut], [sep], tail, [sep]]).astype(np.int64)
        types = np.zeros_like(input_ids)
        types[cut + 2:] = 1
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(types),
                "next_sentence_label": torch.tensor(is_random)}


class MaskingCollator:
    """Stacks examples and masks each sequence (Devlin et al. §3.1 / ``create_pretraining_data``).

    ``n = min(max_predictions, max(1, round(probability * candidates)))`` positions per
    sequence, never [CLS]/[SEP]/[PAD]; 80% become [MASK], 10% a random token, 10% stay.
    Output ``masked_positions`` / ``masked_labels`` are ``[batch, max_predictions]``,
    padded with position 0 and label -100 (ignored by the loss).
    """

    def __init__(self, ids: dict[str, int], vocab_size: int, max_predictions: int, probability: float) -> None:
        self.ids, self.vocab_size = ids, vocab_size
        self.max_predictions, self.probability = max_predictions, probability
        self.special = torch.tensor([ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]])

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([e[key] for e in examples]) for key in examples[0]}
        input_ids = batch["input_ids"].clone()
        positions = torch.zeros(len(examples), self.max_predictions, dtype=torch.long)
        labels = torch.full((len(examples), self.max_predictions), -100, dtype=torch.long)
        for row, ids in enumerate(input_ids):
            candidates = torch.nonzero(~torch.isin(ids, self.special)).flatten()
            n = min(self.max_predictions, max(1, round(self.probability * len(candidates))), len(candidates))
            chosen = candidates[torch.randperm(len(candidates))[:n]].sort().values
            positions[row, :n], labels[row, :n] = chosen, ids[chosen]
            action = torch.rand(n)
            ids[chosen[action < 0.8]] = self.ids["[MASK]"]
            swap = chosen[(action >= 0.8) & (action < 0.9)]
            ids[swap] = torch.randint(self.vocab_size, (len(swap),))
        batch.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                     masked_positions=positions, masked_labels=labels)
        return batch


def bert_config(size: Literal["full", "tiny"], vocab_size: int) -> Any:
    from transformers import BertConfig

    layers, hidden, heads, intermediate = DIMENSIONS[size]
    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=intermediate, max_position_embeddings=512)


def bert_model(size: Literal["full", "tiny"], vocab_size: int, objective: str) -> nn.Module:
    """``BertForPreTraining`` (MLM + NSP heads) or ``BertForMaskedLM``, randomly initialized."""
    from transformers import BertForMaskedLM, BertForPreTraining

    cls = BertForPreTraining if objective == "pretraining" else BertForMaskedLM
    return cls(bert_config(size, vocab_size))


def pretraining_loss(model: nn.Module,
                     batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, MLM logits at the masked positions, MLM labels). The MLM head runs on the
    ``max_predictions`` gathered positions only; NSP is added when the model has its head."""
    out = model.bert(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],  # type: ignore[operator]
                     attention_mask=batch.get("attention_mask"))
    hidden = out[0]
    positions = batch["masked_positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    logits = model.cls.predictions(hidden.gather(1, positions))  # type: ignore[union-attr, operator]
    labels = batch["masked_labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    if hasattr(model.cls, "seq_relationship"):
        nsp = model.cls.seq_relationship(out[1])  # type: ignore[union-attr, operator]
        loss = loss + F.cross_entropy(nsp.float(), batch["next_sentence_label"])
    return loss, logits, labels


class BertPretraining(LightningModule):
    """Trains a BERT model with masked-LM (+ NSP) loss; ``val_acc`` is masked-LM accuracy."""

    def __init__(self, settings: BertSettings, vocab_size: int) -> None:
        super().__init__()
        self.settings, self.vocab_size = settings, vocab_size
        self.model = bert_model(settings.size, vocab_size, settings.objective)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = pretraining_loss(self.model, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits, labels = pretraining_loss(self.model, batch)
        real = labels != -100
        accuracy = (logits.argmax(-1)[real] == labels[real]).float().mean()
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        self.log("val_acc", accuracy, sync_dist=True, prog_bar=True)

    def batch_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Attended tokens in a batch (the run report's tokens/s)."""
        return int(batch["attention_mask"].sum())

    def train_flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sequence, counted on the meta device."""
        seq, preds = self.settings.shape()

        def example(n: int) -> dict[str, torch.Tensor]:
            # no attention_mask: HF inspects its values, which meta tensors lack (same FLOPs)
            return {"input_ids": torch.zeros(n, seq, dtype=torch.long),
                    "token_type_ids": torch.zeros(n, seq, dtype=torch.long),
                    "masked_positions": torch.zeros(n, preds, dtype=torch.long),
                    "masked_labels": torch.zeros(n, preds, dtype=torch.long),
                    "next_sentence_label": torch.zeros(n, dtype=torch.long)}

        return train_flops_per_sample(
            partial(bert_model, self.settings.size, self.vocab_size, self.settings.objective), example,
            lambda model, batch: pretraining_loss(model, batch)[0])

    def configure_optimizers(self):  # type: ignore[override]
        s = self.settings
        groups = decay_groups(self.model, s.weight_decay)
        if s.optimizer == "lamb":
            optimizer: torch.optim.Optimizer = Lamb(groups, lr=s.lr, betas=(0.9, 0.999), eps=1e-6)
        else:
            optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.999), eps=1e-6)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        factor = schedule_factor(s.schedule, total_steps=total, warmup_steps=round(s.warmup * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build(settings: BertSettings) -> tuple[BertPretraining, BertData]:
    """The model's vocabulary is the vocab file's size, or the size the tokenizer is
    trained to (a small corpus may yield fewer tokens: those embedding rows stay unused)."""
    vocab_size = (len(read_vocab(settings.vocab_file)) if settings.vocab_file is not None
                  else settings.target_vocab_size())
    return BertPretraining(settings, vocab_size), BertData(settings)


RECIPE = Recipe(name="bert_large", settings=BertSettings, build=build,
                description="HF BERT-large pre-training (MLM+NSP) on local text files (GPU; size=tiny on CPU)")
