"""``tiny_lm``'s parts on the real corpus-reading code: the by-file split, the cached
tokenizer and token streams, the windows, the model and its metrics.

The end-to-end run on 2 gloo ranks is in ``tests/e2e/test_recipes.py``.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from syncplane import recipes
from syncplane.config import ConfigError
from syncplane.recipes.tiny_lm import (DIMENSIONS, ByteCodec, Perplexity, TinyLm, TinyLmData, TinyLmSettings,
                                       TokenWindows, causal_lm, encode_stream, select_corpus, source_files,
                                       split_order)

ROOT = Path(__file__).resolve().parents[2]
# a small slice of the standard library: a tokenizer trains on it in well under a second
SMALL = {"train_mb": 0.08, "val_mb": 0.02, "vocab_size": 300}


def settings(tmp_path: Path, **changes) -> TinyLmSettings:
    s = TinyLmSettings(cache_dir=str(tmp_path / "cache"), **{**SMALL, **changes})
    s.validate()
    return s


def make_tree(root: Path, files: dict[str, int]) -> Path:
    for name, size in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * (size // 6) + "#" * (size % 6))
    return root


# ------------------------------------------------------------------ corpus and split

def test_the_default_corpus_is_this_interpreters_standard_library(tmp_path):
    s = settings(tmp_path, train_mb=2.0, val_mb=0.2)
    corpus = select_corpus(s)
    assert corpus.root == Path(sysconfig.get_paths()["stdlib"])
    assert not set(corpus.train) & set(corpus.val)                      # held out by file
    assert all(name.endswith(".py") for name in corpus.train + corpus.val)
    assert not any(part in ("test", "tests", "site-packages") for name in corpus.train for part in name.split("/"))
    sizes = {split: sum((corpus.root / n).stat().st_size for n in getattr(corpus, split)) for split in ("train", "val")}
    assert 2.0e6 <= sizes["train"] <= 2.0e6 + 256 * 1024 and 0.2e6 <= sizes["val"] <= 0.2e6 + 256 * 1024
    assert select_corpus(s) == corpus                                     # the same files every time


def test_split_is_a_fixed_function_of_names_seed_and_budgets(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": 1000 for i in range(40)} | {
        "tests/test_a.py": 1000, "pkg0/test/b.py": 1000, "site-packages/c.py": 1000,   # not the library
        "big.py": 5000, "empty.py": 0, "notes.txt": 1000}
    root = make_tree(tmp_path / "tree", files)
    names = source_files(root, "*.py", max_bytes=4096)
    assert names == sorted(f"pkg{i % 3}/mod{i}.py" for i in range(40))
    s = TinyLmSettings(corpus_root=str(root), tokenizer="byte", train_mb=0.02, val_mb=0.005, max_file_kb=4)
    corpus = select_corpus(s)
    order = split_order(names, seed=0)
    assert corpus.val == tuple(order[:5]) and corpus.train == tuple(order[5:25])  # 1,000-byte files
    # the order depends on the names only: another tree with the same names splits the same way
    other = make_tree(tmp_path / "other", dict(reversed(list(files.items()))))
    assert select_corpus(TinyLmSettings(corpus_root=str(other), tokenizer="byte", train_mb=0.02, val_mb=0.005,
                                        max_file_kb=4)).val == corpus.val
    reseeded = select_corpus(TinyLmSettings(corpus_root=str(root), tokenizer="byte", train_mb=0.02, val_mb=0.005,
                                            max_file_kb=4, split_seed=1))
    assert reseeded.val != corpus.val and not set(reseeded.val) & set(reseeded.train)


def test_bad_corpus_settings_are_named(tmp_path):
    root = make_tree(tmp_path / "tree", {"a.py": 1000})
    with pytest.raises(ConfigError, match="corpus_root: '/nonexistent' is not a directory"):
        TinyLmSettings(corpus_root="/nonexistent").validate()
    with pytest.raises(ConfigError, match="nothing is left for training after val_mb=0.1"):
        TinyLmSettings(corpus_root=str(root), tokenizer="byte", val_mb=0.1).validate()
    with pytest.raises(ConfigError, match="vocab_size: a byte-level BPE needs more than 257 tokens"):
        TinyLmSettings(vocab_size=200).validate()
    with pytest.raises(ConfigError, match="size: one of tiny, small, base, got 'huge'"):
        TinyLmSettings(size="huge").validate()  # type: ignore[arg-type]


# ------------------------------------------------------------------ tokenizer and cache

def cache_entries(tmp_path: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}


def test_bpe_is_trained_once_on_the_training_split_and_cached(tmp_path):
    s = settings(tmp_path)
    TinyLmData(s).prepare_data()
    first = cache_entries(tmp_path)
    assert sorted(name.split("-")[0] for name in first) == ["bpe", "tokens"]
    tokenizer = next((tmp_path / "cache").glob("bpe-*/tokenizer.json"))
    TinyLmData(s).prepare_data()                                   # a second run reuses both
    assert cache_entries(tmp_path) == first
    # trained anew elsewhere (another node), the tokenizer is byte-identical: the key is the content
    elsewhere = settings(tmp_path / "node2")
    TinyLmData(elsewhere).prepare_data()
    assert next((tmp_path / "node2" / "cache").glob("bpe-*/tokenizer.json")).read_bytes() == tokenizer.read_bytes()
    # another vocabulary size is another tokenizer (and token streams)
    TinyLmData(settings(tmp_path, vocab_size=320)).prepare_data()
    assert len(list((tmp_path / "cache").glob("bpe-*"))) == 2 and len(list((tmp_path / "cache").glob("tokens-*"))) == 2


def test_streams_are_the_files_tokens_joined_by_end_of_text(tmp_path):
    from tokenizers import Tokenizer

    s = settings(tmp_path)
    data = TinyLmData(s)
    data.prepare_data()
    data.setup("fit")
    corpus = select_corpus(s)
    tokenizer = Tokenizer.from_file(str(next((tmp_path / "cache").glob("bpe-*/tokenizer.json"))))
    eot = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for text in corpus.texts("val") for i in [*tokenizer.encode(text).ids, eot]]
    assert data.val_set is not None and data.train_set is not None
    assert data.val_set.stream.tolist() == expected
    assert tokenizer.decode(expected[:expected.index(eot)]) == corpus.texts("val")[0]   # lossless
    assert int(data.train_set.stream.max()) < s.vocab_size
    assert len(data.train_set) == (len(data.train_set.stream) - 1) // s.seq_length


def test_byte_tokenizer_needs_no_training(tmp_path):
    s = settings(tmp_path, tokenizer="byte")
    data = TinyLmData(s)
    data.prepare_data()
    data.setup("fit")
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()] == ["tokens"]
    text = select_corpus(s).texts("val")[0]
    assert data.val_set is not None and data.val_set.stream[:len(text.encode())].tolist() == list(text.encode())
    assert encode_stream(["ab", "é"], ByteCodec()).tolist() == [97, 98, 256, 0xC3, 0xA9, 256]


def test_windows_are_consecutive_and_share_one_token():
    windows = TokenWindows(torch.arange(10, dtype=torch.int32), seq_length=3)
    assert len(windows) == 3
    assert [windows[i].tolist() for i in range(3)] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert windows[0].dtype == torch.long and len(TokenWindows(torch.arange(3), 3)) == 0


# ------------------------------------------------------------------ model and metrics

def test_size_presets_span_one_to_thirty_million_parameters():
    counts = {}
    for size in DIMENSIONS:
        with torch.device("meta"):
            counts[size] = sum(p.numel() for p in causal_lm(size, 4096, 128).parameters())
    assert counts == {"tiny": 1_334_016, "small": 8_750_080, "base": 27_382_784}   # tied embeddings counted once


def test_the_model_is_causal_and_starts_near_uniform(test_seed):
    torch.manual_seed(test_seed)
    model = causal_lm("tiny", 300, 16).eval()
    ids = torch.randint(300, (2, 16))
    changed = ids.clone()
    changed[:, 9:] = torch.randint(300, (2, 7))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])            # no position sees a later token
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    loss = torch.nn.functional.cross_entropy(a.flatten(0, 1), torch.randint(300, (32,)))
    assert abs(loss.item() - math.log(300)) < 0.1


def test_validation_metrics_are_token_weighted_and_perplexity_is_exp_of_the_loss(tmp_path):
    metric = Perplexity()
    metric.update(torch.tensor(2.0), weight=30)
    metric.update(torch.tensor(4.0), weight=10)
    assert metric.compute().item() == pytest.approx(math.exp(2.5))
    module = TinyLm(settings(tmp_path, tokenizer="byte", seq_length=8))
    batch = torch.randint(257, (3, 9))
    assert module.batch_tokens(batch) == 24
    assert module.train_flops_per_sample() > 6 * sum(p.numel() for p in module.parameters()) * 8 * 0.9


def test_registered_with_a_config():
    assert recipes.get("tiny_lm").settings is TinyLmSettings
    assert (ROOT / "configs" / "recipe" / "tiny_lm.yaml").exists()


def test_summary_metrics_keep_the_contract_and_add_the_recipes_other_validation_metrics():
    from syncplane.runtime.report import validation_metrics

    logged = {"val_loss": torch.tensor(2.0), "val_perplexity": torch.tensor(7.5), "train_loss": torch.tensor(1.0)}
    assert validation_metrics(logged) == {"val_acc": None, "val_loss": 2.0, "val_perplexity": 7.5}
    assert list(validation_metrics({"val_acc": 0.5, "val_loss": 1.0})) == ["val_acc", "val_loss"]


# ------------------------------------------------------------------ optimizer=muon (MuLoCo's inner)

def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(tmp_path):
    module = TinyLm(settings(tmp_path, tokenizer="byte", seq_length=8, optimizer="muon"))
    optimizer = module.make_optimizer()
    names = {id(p): n for n, p in module.model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    rest = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    layers = DIMENSIONS["tiny"][0]
    assert muon == {f"blocks.{i}.{w}.weight" for i in range(layers) for w in ("qkv", "proj", "mlp.0", "mlp.2")}
    assert {"tokens.weight", "positions.weight", "ln_f.weight", "blocks.0.qkv.bias"} <= rest
    assert not muon & rest and len(muon | rest) == len(names)   # every parameter once (the head is tied)
    # the decay groups carry over: no weight decay on LayerNorms and biases
    assert all(g["weight_decay"] == 0.0 for g in optimizer.param_groups
               if any(names[id(p)].endswith("bias") for p in g["params"]))
    with pytest.raises(ConfigError, match="optimizer: adamw or muon, got 'sgd'"):
        settings(tmp_path, optimizer="sgd")


def test_muon_adamw_steps_as_torchs_two_optimizers_and_resumes_from_its_state(test_seed):
    from syncplane.recipes.optim import MuonAdamW

    torch.manual_seed(test_seed)
    weights = [torch.randn(6, 5), torch.randn(5), torch.randn(4, 3)]
    grads = [[torch.randn_like(w) for _ in range(4)] for w in weights]

    def groups(params):
        return [{"params": [params[0]], "muon": True, "weight_decay": 0.1},
                {"params": [params[1]], "weight_decay": 0.0}, {"params": [params[2]], "weight_decay": 0.1}]

    ours = [nn.Parameter(w.clone()) for w in weights]
    optimizer = MuonAdamW(groups(ours), lr=0.01, betas=(0.9, 0.95))
    ref = [nn.Parameter(w.clone()) for w in weights]
    muon = torch.optim.Muon([ref[0]], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [ref[1]], "weight_decay": 0.0}, {"params": [ref[2]], "weight_decay": 0.1}],
                              lr=0.01, betas=(0.9, 0.95))
    for step in range(4):
        if step == 2:   # resume from a saved state into a fresh optimizer: the same steps follow
            saved = optimizer.state_dict()
            optimizer = MuonAdamW(groups(ours), lr=0.01, betas=(0.9, 0.95))
            optimizer.load_state_dict(saved)
            assert [g["lr"] for g in optimizer.param_groups] == [0.01 / 2] * 3   # the schedule's, loaded
        for opt in (optimizer, muon, adamw):   # a schedule sets the groups' learning rate
            for group in opt.param_groups:
                group["lr"] = 0.01 / (step + 1)
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g[step].clone(), g[step].clone()
        for opt in (optimizer, muon, adamw):
            opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert set(optimizer.state) == set(ours)   # one state for both halves: Muon's momentum, AdamW's moments
    assert "momentum_buffer" in optimizer.state[ours[0]] and "exp_avg" in optimizer.state[ours[1]]
    # Lightning's LR scheduler moves both halves
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for opt in (optimizer._muon, optimizer._adamw) for g in opt.param_groups] == [0.01 / 4 * 0.5] * 3


def test_tiny_lm_trains_with_muon(tmp_path):
    from lightning.pytorch import Trainer, seed_everything

    seed_everything(0, verbose=False)
    s = settings(tmp_path, seq_length=32, batch_size=8, optimizer="muon")
    module, data = TinyLm(s), TinyLmData(s)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=20, limit_val_batches=10,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    loss = float(trainer.callback_metrics["val_loss"])
    # from the uniform guess over the 300-token vocabulary (5.70) in 20 steps: 4.33-4.34 measured
    # (20, not more: torch's Muon orthogonalizes in bfloat16, ~0.9 s a step on this CPU)
    assert loss < math.log(300) - 1.0, loss
