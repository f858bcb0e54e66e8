"""What the DiLoCo strategy needs besides Lightning glue, Lightning-free: which engine runs a
replica (its layout: a rank, or the ranks of a node), and the round state a checkpoint carries,
with its check on resume (``strategies/diloco.py`` calls these; the rounds are the engine's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from syncplane.algorithms import sharded
from syncplane.algorithms.diloco.adaptive import TimedRounds
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.engine import DiLoCoEngine
from syncplane.algorithms.diloco.layout import job_layout
from syncplane.algorithms.diloco.transport import GLOO, Transport
from syncplane.job import JobContext

#: The exchange settings a checkpoint records as they ran (a re-plan may have switched them).
EXCHANGE_KEYS: tuple[str, ...] = ("streams", "exchange", "compression")

#: What a checkpoint written before these round settings existed implies.
BEFORE_STREAMING: dict[str, Any] = {"fragments": 1, "overlap_steps": 0, "inner_steps": "fixed"}


def build_engine(config: DiLoCoConfig, job: JobContext, model: torch.nn.Module,
                 device_ids: list[int] | None, transport: Transport = GLOO) -> tuple[DiLoCoEngine, dict[str, Any]]:
    """The replica's engine over ``model``, and what ``summary.json`` says of its layout (a
    collective). With node replicas (``layout.job_layout``) the engine wraps ``model`` (torch's
    DDP over the node's ranks, or FSDP2) and shards the outer state over them -- train its
    ``module``; a model built on the meta device (``configure_model``) makes only its shards."""
    layout = job_layout(config.replica, config.inner, job)
    init = sharded.reset_init(model) if sharded.on_meta(model) else None
    engine = DiLoCoEngine(model, config, job, layout, None if layout.per_rank else device_ids, init, transport)
    details = dict(layout.describe())
    details["streams"], details["exchange"] = engine.streams, engine.exchange_name
    return engine, details


def exchange_ran(engine: DiLoCoEngine, config: DiLoCoConfig) -> dict[str, Any]:
    """The exchange settings as they run (``EXCHANGE_KEYS``): ``streams`` and ``exchange``
    resolved (no ``auto``, old names mapped), ``compression`` as configured."""
    return {"streams": int(engine.streams), "exchange": engine.exchange_name, "compression": config.compression}


def round_state(outer_state: Mapping[str, Any], settings: Mapping[str, Any], rounds: int, skipped: int,
                timed: TimedRounds | None, exchange: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's DiLoCo state: the outer state, the round ``settings`` (``sync_every``,
    ``fragments``, ``overlap_steps``, ``inner_steps``), the committed and discarded rounds, the
    time mode's agreed counts, and the ``exchange`` settings it ran with (``exchange_ran``)."""
    return {**outer_state, **settings, "rounds": rounds, "skipped": skipped, "exchange_ran": dict(exchange),
            **({"timed": timed.state_dict()} if timed is not None else {})}


def check_resumed(state: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """A checkpoint's round settings must be this run's, or the rounds would not line up."""
    for key in ("sync_every", *BEFORE_STREAMING):
        saved, ours = state.get(key, BEFORE_STREAMING.get(key)), settings[key]
        if saved != ours:
            raise ValueError(f"the checkpoint was written with {key}={saved}, this run has "
                             f"{key}={ours}: rounds would not line up")


def check_exchange_resumed(state: Mapping[str, Any], running: Mapping[str, Any]) -> None:
    """A checkpoint's exchange settings (``exchange_ran``) must be the ones this run built. Refused,
    not adopted: a re-plan (``replan_every_s``) may have switched them, and going back breaks the
    bit-identical resume (the residuals and outer state were written by the other exchange) while
    taking the checkpoint's overrides the config. The error names the keys and the values that
    resume it as it ran. A checkpoint from before they were recorded is not checked."""
    saved = dict(state.get("exchange_ran") or {})
    if not saved:
        return
    if "shards" in saved:   # written before ``shards`` was renamed ``streams``
        saved.setdefault("streams", saved.pop("shards"))
    differ = [k for k in EXCHANGE_KEYS if saved.get(k) != running[k]]
    if differ:
        ran = ", ".join(f"{k}={saved[k]}" for k in differ)
        ours = ", ".join(f"{k}={running[k]}" for k in differ)
        fix = " ".join(f"strategy.kwargs.{k}={saved[k]}" for k in EXCHANGE_KEYS)
        raise ValueError(f"the checkpoint's exchange ran {ran} (a re-plan may have switched it), this run has "
                         f"{ours}: the resume would not be bit-identical. Resume with strategy=diloco {fix}, or "
                         f"with the strategy.kwargs.replan_every_s that wrote it (its re-plan state restores "
                         f"the switch)")
