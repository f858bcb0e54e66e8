"""Every command the docs tell a user to type is checked, and so are the keys, strategy lists
and links they name, so a documented command, setting or page cannot rot.

What counts (``tests/helpers/docs_check.py``, whose rules ``test_docs_checker.py`` proves on
planted bad snippets), in ``README.md`` and ``docs/**/*.md``:

- **commands**: lines of fenced ``bash``/``sh``/``shell`` blocks, and inline code spans in
  prose and tables that start with a known program and have an argument. Each is checked as
  deep as it can be without training or building a cluster:
  ``python train.py …`` (also after ``torchrun``/``srun``): composed by Hydra from
  ``configs/`` and validated as a launch is (``parse_job``); ``syncplane …``: the real
  argument parser (so a ``bench`` without its required ``--json`` fails), profile and
  strategy names resolved; ``python -m MODULE …`` / ``python scripts/X.py …``: ``--help``
  exits 0; ``make TARGET``: the Makefile has it (``make -n``).
- **config keys**: ``strategy.kwargs.X``, ``trainer.X``, ``recipe.X`` anywhere, and the
  first column of configuration tables, must exist in a YAML file under ``configs/`` or in
  a strategy's accepted settings (its config dataclass); ``trainer.X`` may also be an
  attribute of Lightning's ``Trainer`` (``trainer.global_step``).
- **strategy lists**: every strategy table (first column ``name``/``strategy``) lists
  exactly the registered strategies; every ``strategy=X`` names one.
- **links**: every relative link's file exists, and its ``#anchor`` is a heading there.

Placeholders: ``a|b|c`` in a token expands into one command per alternative; a line with an
``<angle-bracket>`` placeholder (or a span abbreviated with ``…``) is illustrative and is not
run. A run-time argument that names a file the reader provides (an ImageNet folder) is
checked for its shape only.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from syncplane.runtime.autopilot import AUTO
from tests.helpers import docs_check

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _where(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


#: Pages whose inline spans are not checked yet, and why (their shell blocks are).
INLINE_PENDING: dict[str, str] = {}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in the docs, blocks and inline spans."""
    return [(_where(doc), command) for doc in DOCS
            for command in docs_check.commands(doc.read_text(), inline=_where(doc) not in INLINE_PENDING)]


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

    from syncplane.config import ConfigError
    from syncplane.runtime.settings import parse_job

    multirun = "-m" in overrides or "--multirun" in overrides
    kept = []
    for i, override in enumerate(overrides):
        if override in ("-m", "--multirun", "--cfg", "-c") or override.startswith("hydra."):
            continue
        if i and overrides[i - 1] in ("--cfg", "-c"):
            continue                               # --cfg job: print the config (it must still compose)
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
    try:
        parse_job(container, run_dir=str(tmp_path))
    except ConfigError as exc:
        # the reader's GPU: everything else was validated before this last check
        if container["trainer"]["accelerator"] not in ("gpu", "cuda") or "CUDA kernels;" not in str(exc):
            raise


def check_syncplane(argv: list[str]) -> None:
    from syncplane.bench.runner import parse_strategies
    from syncplane.cli import build_parser
    from syncplane.cluster import load_profile

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:                     # argparse exits 2 on a bad or missing flag
        raise AssertionError(f"syncplane {shlex.join(argv)}: rejected by the argument parser (see stderr)") from exc
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
    elif args.command == "bench":   # its required keys (--json, or --matrix) and every cell, as the command does
        from syncplane.cli import check_bench_args

        check_bench_args(args)
        parse_strategies(args.strategies or "ddp")
    elif getattr(args, "strategies", None):
        parse_strategies(args.strategies)
    if getattr(args, "profile", None) and args.command != "bench" and not _readers_own_file(args.profile):
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
        returncode, stderr = help_of(tuple(program))
        assert returncode == 0, f"{where}: {command}: {stderr[-2000:]}"


@functools.cache
def help_of(program: tuple[str, ...]) -> tuple[int, str]:
    """``python PROGRAM --help``'s exit status and stderr, run once per program (a script named
    by several pages, or a module under both ``python -m`` and ``torchrun -m``: seconds each)."""
    result = subprocess.run([sys.executable, *program, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    return result.returncode, result.stderr


def _yaml_keys(node: object) -> set[str]:
    if isinstance(node, dict):
        return set(map(str, node)) | {k for v in node.values() for k in _yaml_keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _yaml_keys(v)}
    return set()


@functools.lru_cache(maxsize=1)
def known_keys() -> dict[str, set[str]]:
    """namespace -> the names a doc may use: YAML keys under configs/, strategies' settings."""
    import lightning.pytorch as pl

    import syncplane.strategies  # noqa: F401  (registers every strategy)
    from syncplane.strategies import registry

    def keys_of(group: str) -> set[str]:
        return {k for f in (ROOT / "configs" / group).glob("*.yaml") for k in _yaml_keys(yaml.safe_load(f.read_text()))}

    strategy = keys_of("strategy") | {k for name in registry.names() for k in registry.accepted_params(name)}
    experiments = [yaml.safe_load(f.read_text()) or {} for f in (ROOT / "configs" / "experiment").glob("*.yaml")]
    recipe = keys_of("recipe") | {k for e in experiments for k in _yaml_keys(e.get("recipe", {}))}
    trainer = keys_of("trainer") | {a for a in dir(pl.Trainer) if not a.startswith("_")}
    return {"strategy.kwargs": strategy, "recipe": recipe, "trainer": trainer}


#: The pages whose strategy table is the list of every strategy a job can name.
LISTING_PAGES = ("README.md", "docs/choosing.md")


def registered() -> list[str]:
    import syncplane.strategies  # noqa: F401
    from syncplane.strategies import registry

    return registry.names()


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_named_config_keys_exist(doc):
    keys = docs_check.config_keys(doc.read_text(), strategy_page=doc.parent.name == "strategies")
    unknown = docs_check.unknown_keys(keys, known_keys())
    assert not unknown, f"{_where(doc)} names settings that no config or strategy has: {', '.join(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_strategy_lists_match_the_registry(doc):
    """The pages that list the strategies (README, choosing.md) list exactly the registry's;
    a strategy column anywhere names a strategy, a bench peer or a training peer."""
    from syncplane import algorithms
    from syncplane.experiments.peers import PEERS

    text = doc.read_text()
    names = registered()
    if _where(doc) in LISTING_PAGES:
        tables = docs_check.strategy_table_names(text, headers=("name", "strategy"))
        assert tables, f"{_where(doc)} has no strategy table"
        for listed in tables:
            problem = docs_check.registry_mismatch(listed, names)
            assert problem is None, f"{_where(doc)}: its strategy table is not the registry's list: {problem}"
    known = set(names) | set(algorithms.all_names()) | set(PEERS)
    for listed in docs_check.strategy_table_names(text):
        assert set(listed) <= known, f"{_where(doc)}: unknown strategies {', '.join(sorted(set(listed) - known))}"
    named = {n for value in re.findall(r"\bstrategy=([a-z0-9_|,]+)", text) for n in re.split(r"[|,]", value) if n}
    nameable = {*names, AUTO}     # strategy=auto picks one of them by plan
    assert named <= nameable, f"{_where(doc)}: strategy={', '.join(sorted(named - nameable))} is not registered"


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else ("" if path.is_dir() else None)


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_links_resolve(doc):
    broken = docs_check.broken_links(doc, doc.read_text(), _read)
    assert not broken, f"{_where(doc)}: broken links: {'; '.join(broken)}"


def shipped_profiles_table_names(text: str) -> set[str]:
    """The profile names (first column, backticked) of the table under ``## Shipped profiles``."""
    section = text.split("## Shipped profiles", 1)[1].split("\n## ", 1)[0]
    return {name for row in re.findall(r"^\| (.+?) \|", section, re.M) for name in re.findall(r"`([a-z0-9_]+)`", row)}


def test_the_shipped_profiles_table_lists_every_profile():
    """The one hand-written list of profiles (shape and use) cannot lose one: the reference links it."""
    listed = shipped_profiles_table_names((ROOT / "docs" / "cluster-profiles.md").read_text())
    shipped = {p.stem for p in (ROOT / "configs" / "cluster").glob("*.yaml")}
    assert shipped <= listed, f"docs/cluster-profiles.md's shipped profiles lack {', '.join(sorted(shipped - listed))}"
    planted = "## Shipped profiles\n\n| name | shape |\n|---|---|\n| `two_racks` | 2 racks |\n\n## Next\n| `local` | x |\n"
    assert shipped_profiles_table_names(planted) == {"two_racks"}


def test_readme_links_every_guide():
    text = (ROOT / "README.md").read_text()
    guides = [d for d in DOCS[1:] if d.parent.name in ("docs", "strategies")]
    missing = [_where(d) for d in guides if f"({_where(d)}" not in text]
    assert not missing, f"README.md links no guide page for: {', '.join(missing)}"


#: Each strategy's guide: its configuration table lists every key of its YAML.
GUIDES = {"atc": "decentralized", "awc": "decentralized", "h_atc": "decentralized", "h_awc": "decentralized",
          "ds_sync": "ds_sync", "diloco": "diloco", "flexreduce": "flexreduce", "canary": "canary"}


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_every_setting_is_in_its_guides_configuration_table(name):
    page = ROOT / "docs" / "strategies" / f"{GUIDES[name]}.md"
    documented = {k for ns, k in docs_check.config_keys(page.read_text(), strategy_page=True) if ns == "strategy.kwargs"}
    settings = set(yaml.safe_load((ROOT / "configs" / "strategy" / f"{name}.yaml").read_text())["kwargs"] or {})
    assert settings <= documented, f"{_where(page)}: no configuration row for {', '.join(sorted(settings - documented))}"
