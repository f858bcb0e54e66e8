"""Every setting a job can give is checked in the launching process: one bad value per key of
every strategy config (``configs/strategy/*.yaml``) and of the job itself (``seed``,
``fault.*``, ``trainer.*``, a recipe's data) stops ``launch_job`` with a ConfigError naming the
key before any rank is started (``train.py`` turns that into exit 2; ``tests/e2e/test_train.py``
and ``tests/e2e/test_recipes.py`` run a few of them end to end: a launcher costs ~15 s here)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from syncplane.config import ConfigError
from syncplane.experiments.comparison import compose_job
from syncplane.runtime import entry
from syncplane.runtime.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
STRATEGY_CONFIGS = {path.stem: yaml.safe_load(path.read_text()) for path in sorted((ROOT / "configs/strategy").glob("*.yaml"))}

#: keys a strategy config documents in comments (added with +strategy.kwargs.KEY=VALUE)
OPTIONAL_KEYS = {"canary": ("staleness", "proportion", "warmup_steps", "momentum_compensation", "compress_in_host")}

_DECENTRALIZED = {"schedule": "sometimes", "topology": "NoSuchGraph", "topology_kwargs": {"nope": 1},
                  "global_every": -1, "bucket_mb": 0, "consensus_eval": "maybe", "consensus_every": -1,
                  "consensus_sketch": -1,
                  "check_schedule": "maybe", "timeout_s": 0}
_HIERARCHICAL = {**_DECENTRALIZED, "machines": "pod", "ranks_per_machine": 3}   # 3 does not divide 2 ranks
_LATE_PEERS = {"max_staleness": -1, "late_after_s": -0.5, "hierarchy": "pod"}

#: strategy -> key -> one bad value for a job of 2 ranks on this machine
BAD_STRATEGY_VALUES: dict[str, dict[str, Any]] = {
    "atc": {**_DECENTRALIZED, **_LATE_PEERS}, "awc": {**_DECENTRALIZED, **_LATE_PEERS},
    "h_atc": _HIERARCHICAL, "h_awc": _HIERARCHICAL,
    "canary": {"compression": "fp4", "exact_fraction": 2, "quantile_weight": -1, "nics": 0,
               "exchange": "nested",   # 2 ranks on one host do not nest: known before launch
               "bucket_cap_mb": 0, "first_bucket_cap_mb": -1, "sync_timeout_s": 0, "staleness": -1, "proportion": 2, "warmup_steps": -1,
               "momentum_compensation": "x", "compress_in_host": "x", "colayers_in_flight": 0},
    "auto": {"accept": "exakt", "compute_ms": -1, "time_steps": 0, "cluster": "nope", "strategies": ["nope"],
             "period": 0, "replan_every_s": 0},
    "ddp": {},
    "diloco": {"sync_every": -1, "outer_optimizer": "torch.optim.Nope", "outer_kwargs": {"nope": 1}, "streams": 0, "shards": 0,
               "compression": "fp4", "block_size": 0, "density": 0, "bits": 3, "chunk": 0,
               "error_feedback_beta": 2, "outer": "adam", "exchange": "star", "topology": [3], "sync_timeout_s": 0,
               "fragments": 20, "overlap_steps": 10, "mix_alpha": 2, "consensus_eval": "x", "elastic": "x",
               "round_timeout_s": 0, "quorum_timeout_s": 0, "heartbeat_timeout_s": 0, "join_timeout_s": 0,
               "lighthouse_host": "", "replica": "cluster",
               "inner": "fsdp",   # inner=fsdp with replica=rank
               "inner_steps": "sometimes", "round_budget_s": -1.0, "time_weighting": "fednovo",
               "time_samples": "deal", "membership": "sometimes", "min_replicas": 0, "grace_s": 0},
    "ds_sync": {"topology": "two_racks", "adjust_every": -1, "imbalance": 0.5, "slow_factor": 2, "probe_mb": 0,
                "ema": "x", "ema_decay": 2, "pair_streams": 0,      # two_racks has 8 ranks, the job 2
                "max_staleness": -1, "late_after_s": -0.5},
    "flexreduce": {"topology": [3], "chunk_mb": -3, "bucket_cap_mb": 0},
    "torch_fp16": {},
    "torch_powersgd": {"matrix_approximation_rank": 0, "start_powerSGD_iter": -1, "min_compression_rate": "x",
                       "use_error_feedback": "x", "warm_start": "x"},
}

#: ``trainer.<key>`` -> one bad value (every field of TrainerSettings)
BAD_TRAINER_VALUES: dict[str, Any] = {
    "accelerator": "tpu", "devices": 0, "max_epochs": "abc", "max_steps": -5, "precision": "17",
    "accumulate_grad_batches": 0, "log_every_n_steps": 0, "check_val_every_n_epoch": 0, "gradient_clip_val": -1,
    "deterministic": "x", "threads_per_rank": -1, "rendezvous_timeout_s": 0, "heartbeat_timeout_s": -1,
    "max_restarts": -1, "restart_delay_s": -1, "emulated_step_s": -0.5, "target_val_loss": -1.0,
}

#: the job's own keys: (dotted key, value) -> the key the message must name
BAD_JOB_VALUES: list[tuple[str, Any, str]] = [
    ("seed", -5, "seed"), ("seed", 2**32, "seed"), ("seed", "x", "seed"),
    ("fault", {"kind": "explode"}, "fault.kind"), ("fault", {"kind": "kill", "rank": 9, "step": 2}, "fault.rank"),
    ("fault", {"rank": -1}, "fault.rank"), ("fault", {"step": 0}, "fault.step"),
    ("fault", [{"kind": "kill", "rank": 1, "step": 2}, {"kind": "stop", "rank": 2, "step": 2}], "fault[1].rank"),
    ("fault", {"kind": "netdown", "rank": 1, "step": 2}, "fault.kind=netdown"),
    ("fault", {"kind": "slow", "rank": 1, "factor": 0, "step": 0}, "fault.factor"),
    ("fault", {"kind": "slow", "rank": 2, "factor": 2.0, "step": 0}, "fault.rank"),   # the job has 2 ranks
    *((f"trainer.{key}", value, f"trainer.{key}") for key, value in BAD_TRAINER_VALUES.items()),
]

GOOD = {"strategy": {"name": "ddp", "kwargs": {}}, "recipe": {"name": "digits"},
        "trainer": {"accelerator": "cpu", "devices": 2, "max_epochs": 1}, "seed": 1, "fault": None}


def strategy_cases() -> list[tuple[str, str, Any]]:
    return [(name, key, value) for name, bad in BAD_STRATEGY_VALUES.items() for key, value in bad.items()]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a rank fails the test: every case must stop before."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a worker was started for a bad config")

    for starter in ("launch", "launch_on_cluster", "launch_elastic"):
        monkeypatch.setattr(entry, starter, refuse)


def refused(cfg: dict[str, Any], run_dir: Path) -> str:
    with pytest.raises(ConfigError) as info:
        entry.launch_job(cfg, run_dir)
    assert not (run_dir / "logs").exists()
    return str(info.value)


def test_the_table_covers_every_key_of_every_strategy_config_and_of_the_trainer():
    assert set(BAD_STRATEGY_VALUES) == set(STRATEGY_CONFIGS)
    for name, config in STRATEGY_CONFIGS.items():
        keys = {*(config.get("kwargs") or {}), *OPTIONAL_KEYS.get(name, ())}
        assert keys == set(BAD_STRATEGY_VALUES[name]), name
    assert set(BAD_TRAINER_VALUES) == {f.name for f in dataclasses.fields(TrainerSettings)}


@pytest.mark.parametrize("name,key,value", strategy_cases(), ids=lambda v: str(v)[:20])
def test_a_bad_strategy_value_is_refused_before_launch_naming_its_key(name, key, value, tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    cfg["strategy"] = {"name": name, "kwargs": {**(STRATEGY_CONFIGS[name].get("kwargs") or {}), key: value}}
    assert key in refused(cfg, tmp_path)


def test_an_unknown_strategy_key_is_refused_before_launch_listing_the_allowed_ones(tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    cfg["strategy"] = {"name": "ddp", "kwargs": {**(STRATEGY_CONFIGS["ddp"].get("kwargs") or {}), "bucket_capp": 1}}
    assert "strategy.kwargs: unknown key(s) bucket_capp; allowed keys:" in refused(cfg, tmp_path)


@pytest.mark.parametrize("path,value,key", BAD_JOB_VALUES, ids=lambda v: str(v)[:30])
def test_a_bad_job_value_is_refused_before_launch_naming_its_key(path, value, key, tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[leaf] = value
    assert key in refused(cfg, tmp_path)


@pytest.mark.parametrize("name", ["h_atc", "h_awc"])
def test_late_peer_mixing_is_refused_for_the_hierarchical_forms_naming_its_key(name, tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    cfg["strategy"] = {"name": name, "kwargs": {**(STRATEGY_CONFIGS[name].get("kwargs") or {}), "max_staleness": 1}}
    assert "max_staleness" in refused(cfg, tmp_path)


def test_late_peer_averaging_with_several_pair_streams_is_refused_naming_both_keys(tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    cfg["strategy"] = {"name": "ds_sync", "kwargs": {**STRATEGY_CONFIGS["ds_sync"]["kwargs"], "max_staleness": 1,
                                                     "pair_streams": 2}}
    message = refused(cfg, tmp_path)
    assert "max_staleness" in message and "pair_streams" in message


@pytest.mark.parametrize("overrides,message", [
    (["recipe=resnet50_imagenet", "recipe.data_root=/nonexistent/imagenet"],
     "recipe.data_root: '/nonexistent/imagenet' is not a directory; expected <data_root>/train/<class>/"),
    (["recipe=bert_large", "recipe.vocab_file=/nonexistent/vocab.txt", "recipe.data_files=[{corpus}]"],
     "recipe.vocab_file: '/nonexistent/vocab.txt' does not exist"),
    (["recipe=bert_large"], "recipe.data_files: required"),
    (["recipe=fashion_mnist", "recipe.data_dir=/nonexistent/fm"], "recipe.data_dir: '/nonexistent/fm' does not exist"),
    (["recipe=tiny_lm", "recipe.corpus_root=/nonexistent/src"], "recipe.corpus_root: '/nonexistent/src' is not a"),
])
def test_a_recipe_without_its_data_is_refused_before_launch(overrides, message, tmp_path, no_launch):
    """The job ``python train.py OVERRIDES`` composes (``tests/e2e/test_recipes.py`` runs the
    first end to end)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f():\n    return 1\n")
    cfg = compose_job([o.format(corpus=corpus) for o in overrides], "the job")
    assert message in refused(cfg, tmp_path / "run")


def test_the_ranks_another_launcher_started_are_the_world_checked(tmp_path):
    """Under torchrun a fault may name a rank of another node: the world is the launcher's."""
    from syncplane.job import JobContext
    from syncplane.runtime.settings import parse_job

    cfg = {**copy.deepcopy(GOOD), "fault": {"kind": "kill", "rank": 3, "step": 2}}
    assert parse_job(cfg, str(tmp_path), world=JobContext(world_size=4, local_world_size=2)).faults[0].rank == 3
    cfg["strategy"] = {"name": "canary", "kwargs": {"exchange": "nested"}}
    parse_job(cfg, str(tmp_path), world=JobContext(world_size=4, local_world_size=2))      # 2 hosts of 2 ranks nest


def test_canary_nested_is_checked_against_the_emulated_clusters_profile(tmp_path, no_launch):
    """On two_racks (8 ranks, hosts of 2 in 2 racks) the ranks nest; a flat profile refuses it."""
    from syncplane.job import JobContext
    from syncplane.cluster import load_profile
    from syncplane.strategies import registry

    registry.validate("canary", {"exchange": "nested"}, JobContext.planned(8, load_profile("two_racks")))
    with pytest.raises(ConfigError, match="exchange: nested"):
        registry.validate("canary", {"exchange": "nested"}, JobContext.planned(8))


@pytest.mark.parametrize("kwargs,job,key", [
    ({"replica": "node"}, ("homogeneous8", 8), "replica='node' on a job of one rank per host"),
    ({"replica": "node"}, (None, 5, 2), "replica='node': the job's nodes do not divide"),
    ({"replica": "node", "elastic": True}, ("asymmetric_2_3", 5), "replica='node' with elastic=true needs hosts of one size"),
    ({"replica": "node", "exchange": "tree"}, ("multi_nic", 4), "replica='node' exchanges each outer shard"),
], ids=lambda v: str(v)[:30])
def test_diloco_node_replicas_refuse_a_job_they_cannot_run_naming_the_key(kwargs, job, key):
    """``replica: node`` needs hosts of several ranks that divide the job (the profile's hosts,
    or ``LOCAL_WORLD_SIZE`` under torchrun); the tree, and in elastic mode hosts of different
    sizes, are refused by name."""
    from syncplane.cluster import load_profile
    from syncplane.job import JobContext
    from syncplane.strategies import registry

    cluster, world, *local = job
    context = (JobContext.planned(world, load_profile(cluster)) if cluster
               else JobContext(world_size=world, local_world_size=local[0]))
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        registry.validate("diloco", kwargs, context)


def test_diloco_node_replicas_take_the_hosts_of_the_profile_or_the_launcher():
    from syncplane.algorithms.diloco.layout import check_replica, node_layout
    from syncplane.cluster import load_profile
    from syncplane.job import JobContext
    from syncplane.strategies import registry

    registry.validate("diloco", {"replica": "node"}, JobContext.planned(4, load_profile("multi_nic")))
    for settings in ({"membership": "quorum"}, {"inner_steps": "time"}):
        registry.validate("diloco", {"replica": "node", "elastic": True, **settings},
                          JobContext.planned(4, load_profile("multi_nic")))
    assert node_layout("node", "ddp", JobContext(world_size=8, local_world_size=4)).sizes == [4, 4]
    assert node_layout("auto", "ddp", JobContext.planned(5, load_profile("asymmetric_2_3"))).sizes == [2, 3]
    assert node_layout("auto", "ddp", JobContext.planned(8, load_profile("homogeneous8"))) is None
    assert node_layout("rank", "ddp", JobContext(world_size=8, local_world_size=4)) is None
    assert node_layout("node", "fsdp", JobContext(world_size=8, local_world_size=4)).inner == "fsdp"
    with pytest.raises(ValueError, match="inner='fsdp' needs node replicas .*replica='auto', which is 'rank' on this job"):
        node_layout("auto", "fsdp", JobContext.planned(8, load_profile("homogeneous8")))
    with pytest.raises(ValueError, match="inner='fsdp' needs node replicas .*with replica='rank' a replica is one"):
        check_replica("rank", "fsdp")
    # FSDP2 on nodes of different sizes (each parameter exchanged in the units of the nodes' row chunks)
    assert node_layout("node", "fsdp", JobContext.planned(5, load_profile("uneven_nodes"))).sizes == [2, 1, 2]
    registry.validate("diloco", {"replica": "node", "inner": "fsdp"}, JobContext.planned(5, load_profile("asymmetric_2_3")))


def test_a_check_only_the_running_ranks_can_make_fails_with_one_line(tmp_path, capsys, monkeypatch):
    """What is left to the ranks (what a host has, what they agree on) ends each rank with
    exit 2 and one line naming the key, not a traceback."""
    from syncplane.runtime import worker

    def rank_check(spec: Any) -> None:
        raise ConfigError("fault.kind=netdown: this rank does not run inside an emulated host")

    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    monkeypatch.setattr(worker, "run", rank_check)
    monkeypatch.setenv("RANK", "1")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"config": GOOD, "run_dir": str(tmp_path), "job_name": "train"}))
    assert worker.main([str(job)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "syncplane: rank 1: invalid configuration: fault.kind=netdown: this rank does not run inside an emulated host"]


def test_time_budgeted_diloco_shares_no_deal_in_elastic_mode_before_launch(tmp_path, no_launch):
    cfg = copy.deepcopy(GOOD)
    cfg["strategy"] = {"name": "diloco", "kwargs": {"inner_steps": "time", "time_samples": "share", "elastic": True}}
    assert "time_samples=share with elastic=true" in refused(cfg, tmp_path)
