"""DiLoCo: H local steps of the user's optimizer, then one outer step on the averaged
pseudo-gradient, with the outer state on CPU and the exchange over gloo.

Overridden hooks (see ``SyncplaneStrategy``), and why:

- ``setup_sync``: lay the model (parameters, then floating buffers) out in one flat
  fp32 host buffer, create the outer optimizer over the parameters' part (``θ_g`` on
  CPU; one per fragment) and the sharded gloo exchange -- separate gloo groups, so this
  works when the training itself uses NCCL; its pattern (``exchange``: owner, or
  FlexReduce's tree on a cluster with hosts/racks/sites) is chosen here, on every rank.
- ``after_optimizer_step``: every ``sync_every`` real steps, counted from
  ``trainer.global_step`` (so a resume stays aligned): ``Δ = θ_g − θ_local`` on CPU,
  averaged over all ranks, one outer step, ``θ_g`` copied back into the model; floating
  buffers (BatchNorm statistics) are averaged in the same exchange. If the exchange is
  discarded (a rank failed or timed out), every rank skips the outer step and keeps its
  local replica: the next round's ``Δ`` then covers both rounds, nothing is lost.
  Streaming (``fragments`` P > 1, ``overlap_steps`` τ > 0; ``syncplane.algorithms.diloco.streaming``):
  the same round per fragment at that fragment's offset, its exchange on a background
  thread for τ steps, its result mixed in as ``α·θ_local + (1 − α)·θ_g``.
- ``finish_pending_sync``: completes the exchanges in flight and their outer steps; the
  merges stay at their scheduled step, so a checkpoint or a validation in between does
  not change the trajectory.
- ``sync_state_dict`` / ``load_sync_state_dict``: outer parameters, outer optimizer
  state (per fragment), error-feedback residuals, the rounds waiting to be merged and the
  position within the round, so a resume is bit-identical (the base restores each rank's
  own replica after the initial broadcast).

Elastic mode (``elastic=true``; ``syncplane.algorithms.diloco.elastic``, transport in
``syncplane.comm.elastic`` on torchft): each rank is an independent replica (a process group
of one for Lightning, its own data shard); rounds run over a torchft quorum that drops a
lost replica and admits a restarted one at a round boundary, healed from a live peer.
``on_train_start`` joins the quorum; ``after_optimizer_step`` runs a round every
``sync_every`` of this replica's steps and stops the trainer after the job's last round.

Host<->device copies (``syncplane.comm.host_mirror``) run on a side CUDA stream when the
model is on a GPU; on CPU the same calls are plain copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.diloco.elastic import ElasticOuter, JobFingerprint, fingerprint
from syncplane.algorithms.diloco.exchange import build_exchange
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.comm import elastic as ft
from syncplane.comm import ShardedAllReduce
from syncplane.comm.host_mirror import HostMirror
from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.streaming import FragmentedOuter, Round
from syncplane.strategies.base import SyncplaneStrategy
from syncplane.strategies.registry import register


@register("diloco")
class DiLoCo(SyncplaneStrategy):
    """Args: those of ``DiLoCoConfig`` (sync_every, outer_optimizer, outer_kwargs, shards,
    compression, block_size, sync_timeout_s, fragments, overlap_steps, mix_alpha, exchange,
    topology), the elastic settings (``elastic``, ``round_timeout_s``: a round's average, vote
    and heal give up after it; ``quorum_timeout_s``: how long a replica waits for a quorum;
    ``heartbeat_timeout_s`` / ``join_timeout_s``: the Lighthouse's, read by the launcher;
    ``lighthouse_host``: the address it and the replicas bind, loopback by default), then
    ``SyncplaneStrategy``'s."""

    def __init__(self, sync_every: int = 10, outer_optimizer: str = "torch.optim.SGD",
                 outer_kwargs: dict[str, Any] | None = None, shards: int = 1,
                 compression: Literal["none", "int8"] = "none", block_size: int = 256,
                 sync_timeout_s: float = 600.0, fragments: int = 1, overlap_steps: int = 0,
                 mix_alpha: float | None = None, exchange: Literal["auto", "owner", "tree"] = "auto",
                 topology: str | list[int] = "auto", elastic: bool = False, round_timeout_s: float = 30.0,
                 quorum_timeout_s: float = 120.0, heartbeat_timeout_s: float = 5.0, join_timeout_s: float = 60.0,
                 lighthouse_host: str = "127.0.0.1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = DiLoCoConfig(sync_every=sync_every, outer_optimizer=outer_optimizer, outer_kwargs=outer_kwargs,
                                   shards=shards, compression=compression, block_size=block_size,
                                   sync_timeout_s=sync_timeout_s, fragments=fragments, overlap_steps=overlap_steps,
                                   mix_alpha=mix_alpha, exchange=exchange, topology=topology)
        self.sync_every, self.fragments, self.overlap_steps = sync_every, fragments, overlap_steps
        self.mix_alpha = self.config.alpha
        self.rounds = 0     # committed outer steps (one per fragment round)
        self.skipped = 0    # discarded rounds
        self._outer: FragmentedOuter | None = None
        self._exchange: ShardedAllReduce | None = None
        self._host: HostMirror | None = None
        self.elastic = bool(elastic)
        self._elastic: ElasticOuter | None = None
        self._local_steps = 0
        if self.elastic:
            check_elastic(self.config, round_timeout_s=round_timeout_s, quorum_timeout_s=quorum_timeout_s,
                          heartbeat_timeout_s=heartbeat_timeout_s, join_timeout_s=join_timeout_s)
            self.lighthouse_host = ft.check_bind_host(lighthouse_host)
            self.round_timeout_s, self.quorum_timeout_s = round_timeout_s, quorum_timeout_s
        self._replica = 0

    # ------------------------------------------------------------ extension points

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.elastic:   # Lightning sees one process; the training shard is the replica's
            stage = self.lightning_module.trainer.state.stage if self.lightning_module is not None else None
            if stage is not None and stage != RunningStage.TRAINING:
                # every replica validates θ on the whole set: replicas are independent jobs,
                # there is no all-reduce of the metrics that would combine shards
                return {"num_replicas": 1, "rank": 0}
            replica, replicas = elastic_identity()
            return {"num_replicas": replicas, "rank": replica}
        return super().distributed_sampler_kwargs

    @override
    def setup_sync(self) -> None:
        if self.elastic:
            self._setup_elastic()
            return
        tensors = self.model_tensors()
        n_params = sum(p.numel() for p in self.lightning_module.parameters())
        self._host = HostMirror(tensors)       # [θ_local | floating buffers], fp32 on the host
        self._host.to_host(tensors)
        if self._outer is not None:
            self._outer.close()
        self._outer = FragmentedOuter(self._host.buffer, n_params, self.fragments, self.sync_every,
                                      self.config.outer_optimizer, self.config.outer_kwargs, pin=self._host.on_gpu)
        self._host.check_cuts(tensors, [start for start, _ in self._outer.bounds[1:]])
        if self._exchange is not None:
            self._exchange.close()
        config = self.config
        # build_exchange logs the pattern it chose (and why) on rank 0; the summary keeps it
        self._exchange, self.details["exchange"] = build_exchange(
            config.shards, config.compression, config.block_size, config.sync_timeout_s, config.exchange,
            config.topology)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self.elastic:
            self._elastic_step()
            return
        assert self._outer is not None
        done = self.step + 1   # self.step (trainer.global_step) counts the steps before this one
        for fragment in self._outer.starting(done):
            if self.overlap_steps == 0:
                self.outer_sync(fragment)
            else:
                self._launch(fragment, done, background=True)
        for round_ in self._outer.pop_due(done):
            self._merge(round_)

    def outer_sync(self, fragment: int = 0) -> bool:
        """One blocking round of a fragment (the whole model when P = 1): average Δ (and
        the floating buffers), outer step, copy back. True if committed."""
        assert self._outer is not None
        self._launch(fragment, self.step + 1, background=False)
        round_ = self._outer.pop(fragment)
        self._merge(round_)
        return bool(round_.committed)

    @property
    def outer_params(self) -> torch.Tensor:
        """θ_g, the global parameters (a flat copy)."""
        assert self._outer is not None
        return self._outer.params

    @override
    def finish_pending_sync(self) -> None:
        if self._outer is not None:
            self._outer.wait()

    def _launch(self, fragment: int, done: int, background: bool) -> None:
        assert self._outer is not None and self._exchange is not None
        exchange, total = self._exchange, self._host.buffer.numel()
        start, end = self._outer.bounds[fragment]
        # the fragment's slice of the host buffer is reused in place for its Δ and the result
        self._host.to_host(self.model_tensors(), start, end)
        self._outer.launch(fragment, lambda flat, offset: exchange.allreduce_mean_(
            flat, self.comm_meter, offset=offset, total=total), due=done + self.overlap_steps, background=background)

    def _merge(self, round_: Round) -> None:
        if not round_.committed:
            self.skipped += 1
            return
        assert self._outer is not None
        self._host.from_host(self.model_tensors(), *self._outer.bounds[round_.fragment], alpha=self.mix_alpha)
        self.rounds += 1

    # ------------------------------------------------------------ elastic mode

    def _setup_elastic(self) -> None:
        self._replica, _ = elastic_identity()
        tensors = self.model_tensors()
        params = list(self.lightning_module.parameters())
        n_params = sum(p.numel() for p in params)
        self._host = HostMirror(tensors)
        self._host.to_host(tensors)
        config = self.config
        outer = OuterOptimizer(self._host.buffer[:n_params], config.outer_optimizer, config.outer_kwargs,
                               pin=self._host.on_gpu)
        ours = fingerprint(self._host.buffer.numel(), self.sync_every, config.outer_optimizer, config.outer_kwargs,
                           [tuple(t.shape) for t in tensors])
        # before any contact with the quorum: a replica with other settings never disturbs it
        JobFingerprint(os.environ[ft.ELASTIC_DIR_ENV]).check(ours, f"replica {self._replica}")
        self._elastic = ElasticOuter(outer, ours, total_rounds=0, on_event=self._record_event)
        self.details["exchange"] = "torchft quorum (elastic)"

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if not self.elastic:
            return
        assert self._elastic is not None
        trainer = self.lightning_module.trainer
        self._elastic.total_rounds = int(trainer.estimated_stepping_batches) // self.sync_every
        restart = os.environ.get(ft.RESTART_ENV, "0")
        if self._done_marker().exists():   # restarted after the job's last round: nothing to rejoin
            self._record_event({"event": "start", "restart": int(restart), "job_done": True})
            trainer.should_stop = True
            return
        group = ft.ReplicaGroup(f"replica{self._replica}", os.environ[ft.LIGHTHOUSE_ENV],
                                self._elastic.state_dict, self._elastic.load_state_dict, host=self.lighthouse_host,
                                round_timeout_s=self.round_timeout_s, quorum_timeout_s=self.quorum_timeout_s)
        if restart == "0":
            ft.start_barrier(os.environ[ft.ELASTIC_DIR_ENV], self._replica, elastic_identity()[1], self.quorum_timeout_s)
        self._record_event({"event": "start", "restart": int(restart), "total_rounds": self._elastic.total_rounds})
        self._elastic.join(group)
        self._adopt_if_healed()

    def _elastic_step(self) -> None:
        assert self._elastic is not None and self._host is not None
        self._local_steps += 1
        if self._local_steps % self.sync_every or self._elastic.done or self._elastic.transport is None:
            return
        tensors = self.model_tensors()
        self._host.to_host(tensors)
        flat = self._host.buffer
        start = time.perf_counter()
        committed = self._elastic.round_(flat)
        self.comm_meter.record(start, time.perf_counter(), flat.numel() * flat.element_size())
        if committed:
            self._host.from_host(tensors)
            self.rounds += 1
        else:
            self.skipped += 1
        self._adopt_if_healed()
        self.details["elastic"] = self._elastic.stats.as_dict()
        if self._elastic.done:
            # replicas that finished together hold the same θ_g: the summary shows its digest
            self.details["elastic"]["theta_sha256"] = hashlib.sha256(
                self._elastic.outer.params.numpy().tobytes()).hexdigest()
            self._done_marker().touch()
            self.lightning_module.trainer.should_stop = True

    def _done_marker(self) -> Path:
        return Path(os.environ[ft.ELASTIC_DIR_ENV]) / "elastic_done"

    def _adopt_if_healed(self) -> None:
        """After a heal, this replica starts from the peer's θ_g (its buffers stay its own)."""
        assert self._elastic is not None and self._host is not None
        if not self._elastic.healed:
            return
        params = self._elastic.outer.params
        self._host.buffer[: params.numel()].copy_(params)
        self._host.from_host(self.model_tensors(), 0, params.numel())
        self._elastic.healed = False
        self.details["elastic"] = self._elastic.stats.as_dict()

    def _record_event(self, record: dict[str, Any]) -> None:
        """Membership changes, heals and discarded rounds go to the job's ``history.jsonl``
        (one ``O_APPEND`` write per line: replicas share the file)."""
        line = json.dumps({"replica": self._replica, "time": round(time.time(), 3), **record}) + "\n"
        path = Path(os.environ[ft.ELASTIC_DIR_ENV]) / "history.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        if self.elastic:
            assert self._elastic is not None
            return {**self._elastic.state_dict(), "sync_every": self.sync_every, "rounds": self.rounds,
                    "skipped": self.skipped}
        assert self._outer is not None
        assert self._exchange is not None
        return {**self._outer.state_dict(), "sync_every": self.sync_every, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps, "rounds": self.rounds, "skipped": self.skipped}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if self.elastic:
            raise ValueError("elastic=true does not resume from a checkpoint: a restarted replica heals "
                             "from a live peer instead")
        before_streaming = {"fragments": 1, "overlap_steps": 0}   # what older checkpoints imply
        for key in ("sync_every", *before_streaming):
            saved, ours = state.get(key, before_streaming.get(key)), getattr(self, key)
            if saved != ours:
                raise ValueError(f"the checkpoint was written with {key}={saved}, this run has "
                                 f"{key}={ours}: rounds would not line up")
        assert self._outer is not None and self._exchange is not None
        self._outer.load_state_dict(state)
        self.rounds, self.skipped = int(state["rounds"]), int(state["skipped"])

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (int8 only)."""
        if self.elastic:
            return {}
        assert self._exchange is not None
        return {"exchange": self._exchange.state_dict()}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.elastic:
            return
        assert self._exchange is not None
        self._exchange.load_state_dict(state.get("exchange", {}))

    @override
    def teardown(self) -> None:
        if self._outer is not None:
            self._outer.close()
        if self._elastic is not None:
            self._elastic.close()
        if self._exchange is not None:
            self._exchange.close()   # its state stays readable for a checkpoint after fit
        super().teardown()


def check_elastic(config: DiLoCoConfig, **timeouts: float) -> None:
    """What elastic mode supports, checked at construction (before the first step)."""
    for key, value in timeouts.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")
    unsupported = {"fragments": (config.fragments, 1), "overlap_steps": (config.overlap_steps, 0),
                   "compression": (config.compression, "none"), "shards": (config.shards, 1)}
    for key, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(f"elastic=true supports {key}={allowed} only, got {key}={value}")


def elastic_identity() -> tuple[int, int]:
    """(replica index, replicas at start) from the launcher's environment."""
    missing = [k for k in (ft.REPLICA_ENV, ft.REPLICAS_ENV, ft.LIGHTHOUSE_ENV, ft.ELASTIC_DIR_ENV) if k not in os.environ]
    if missing:
        raise ValueError(f"elastic=true runs under syncplane's launcher (train.py / syncplane train), which starts "
                         f"the lighthouse and the replicas; missing {', '.join(missing)}")
    return int(os.environ[ft.REPLICA_ENV]), int(os.environ[ft.REPLICAS_ENV])
