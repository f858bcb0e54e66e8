"""Every command the docs tell a user to type is checked, so a documented command cannot rot.

A command is any line of a fenced ``bash``/``sh``/``shell`` block in ``README.md`` and
``docs/**/*.md`` (continuation lines joined, comments dropped). Each is checked as deep as
it can be without training or building a cluster:

- ``python train.py …`` (also after ``torchrun``/``srun``): the overrides are composed by
  Hydra from ``configs/`` and the result goes through the same validation a real launch
  does (``parse_job``: every key, value and strategy setting) -- a typo fails here.
- ``syncplane …``: parsed by the real argument parser; profile and strategy names resolved.
- ``python -m MODULE …`` / ``python scripts/X.py …``: the program's ``--help`` exits 0.
- ``make TARGET``: the Makefile has the target (``make -n``).

Placeholders: ``a|b|c`` in a token expands into one command per alternative; a line with an
``<angle-bracket>`` placeholder is illustrative and is not run (keep those rare). A run-time
argument that names a file the reader provides (an ImageNet folder) is checked for its
shape only.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
CHECKED_PREFIXES = ("python train.py", "syncplane ", "python -m ", "python scripts/", "make ", "torchrun ", "srun ")


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command line in the docs' shell blocks."""
    found = []
    for doc in DOCS:
        for block in SHELL_BLOCK.findall(doc.read_text()):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.strip().removeprefix("$ ")
                if not line.startswith(CHECKED_PREFIXES) or re.search(r"<[^>]+>", line):
                    continue
                tokens = shlex.split(line, comments=True)
                for variant in _expand(tokens):
                    found.append((doc.relative_to(ROOT).as_posix(), shlex.join(variant)))
    return found


def _expand(tokens: list[str]) -> list[list[str]]:
    """``up|down|status`` -> three commands (a token without ``=`` whose parts are words)."""
    for i, token in enumerate(tokens):
        if "|" in token and "=" not in token and all(part.isidentifier() for part in token.split("|")):
            return [variant for part in token.split("|") for variant in _expand(tokens[:i] + [part] + tokens[i + 1:])]
    return [tokens]


def reader_data(key: str, tmp_path: Path) -> str | None:
    """A stand-in of the right shape for a data path the reader provides (their ImageNet, their
    text corpus), so the rest of the command is still validated; None for other keys."""
    if key == "recipe.data_root":          # an ImageFolder tree: train/ and val/ with the same classes
        for split in ("train", "val"):
            folder = tmp_path / "imagenet" / split / "n01440764"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "x.JPEG").write_bytes(b"")
        return str(tmp_path / "imagenet")
    if key == "recipe.data_files":
        (tmp_path / "corpus.txt").write_text("a line of text\n")
        return f"[{tmp_path / 'corpus.txt'}]"
    if key == "recipe.vocab_file":
        (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]) + "\n")
        return str(tmp_path / "vocab.txt")
    return None


def check_train(overrides: list[str], tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from syncplane.runtime.settings import parse_job

    multirun = "-m" in overrides or "--multirun" in overrides
    kept = []
    for override in overrides:
        if override in ("-m", "--multirun") or override.startswith("hydra."):
            continue
        key, _, value = override.partition("=")
        if multirun and "," in value and not value.startswith(("[", "'[")):
            value = value.split(",")[0]           # a sweep: every value has the same shape; check the first
        value = reader_data(key, tmp_path) or value
        kept.append(f"{key}={value}")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=kept)
    container = OmegaConf.to_container(cfg, resolve=True)
    if container.get("resume"):
        container["resume"] = None                 # the reader's own checkpoint
    parse_job(container, run_dir=str(tmp_path))


def check_syncplane(argv: list[str]) -> None:
    from syncplane.bench.runner import parse_strategies
    from syncplane.cli import build_parser
    from syncplane.cluster import load_profile

    args = build_parser().parse_args(argv)        # argparse exits 2 on a bad flag
    if getattr(args, "cluster", None) and not _readers_own_file(args.cluster):
        load_profile(args.cluster)
    if args.command == "compare":   # strategies and training peers, composed like train.py
        from syncplane.experiments.comparison import settings_from_args

        settings_from_args(args).validate()
    elif args.command == "chaos" and args.matrix:   # every cell planned, as the command does first
        from syncplane.experiments.chaos import matrix_plans

        matrix_plans(parse_strategies(args.strategies), args.kinds.split(","), args.overrides,
                     Path(args.out or "outputs/chaos/check"), rank=args.rank, step=args.step)
    elif args.command == "chaos":   # the job composed like train.py, the faults placed on it
        from syncplane.experiments.chaos import prepare

        prepare(args.overrides, args.fault, Path(args.out or "outputs/chaos/check"))
    elif getattr(args, "strategies", None):
        parse_strategies(args.strategies)
    if getattr(args, "profile", None):
        load_profile(args.profile)


def _readers_own_file(value: str) -> bool:
    """A profile path the reader writes for their own cluster (``my_cluster.yaml``): not in
    the repository, so only the rest of the command can be checked."""
    return value.endswith((".yaml", ".yml")) and not (ROOT / value).exists() and "/" not in value.strip("./")


COMMANDS = documented_commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 20          # the collector works: README alone has more than ten


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w}: {c[:60]}" for w, c in COMMANDS])
def test_documented_command_is_valid(where, command, tmp_path):
    tokens = shlex.split(command)
    if "train.py" in tokens:
        check_train(tokens[tokens.index("train.py") + 1:], tmp_path)
    elif tokens[0] == "syncplane":
        check_syncplane(tokens[1:])
    elif tokens[0] == "make":
        result = subprocess.run(["make", "-n", *tokens[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{where}: {command}: {result.stderr}"
    else:   # python -m MODULE ... / python scripts/X.py ... / torchrun|srun ... -m MODULE ...
        program = tokens[tokens.index("-m"):tokens.index("-m") + 2] if "-m" in tokens else tokens[1:2]
        result = subprocess.run([sys.executable, *program, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, f"{where}: {command}: {result.stderr[-2000:]}"
