"""Elastic DiLoCo with ``membership=quorum``: each rank an independent replica, each round's
members decided by a torchft quorum within a grace window.

``DiLoCo(..., elastic=True, membership="quorum")`` constructs this class (``membership=fixed``
is ``ElasticDiLoCo``, ``strategies/diloco_elastic.py``, whose round is ``DiLoCoEngine``'s; this
one still runs its own loop, fp32 plain rounds: porting it onto the engine is what remains); the engine is ``syncplane.algorithms.diloco.elastic`` and the transport
``syncplane.algorithms.diloco.ft`` (torchft's Manager, Lighthouse and reconfigurable gloo groups).
Kept apart from ``DiLoCo`` because almost every hook differs, and why:

- ``distributed_sampler_kwargs``: Lightning sees a process group of one; the training shard
  is the replica's (its index among the replicas at start), while every replica validates
  on the whole set (no all-reduce combines the metrics of independent jobs).
- ``setup_sync``: the flat host buffer and the outer optimizer as in ``DiLoCo``, plus the
  job's fingerprint (shapes, ``sync_every``, outer optimizer), checked against the one on
  disk *before* any contact with the quorum, so a mismatched replica never disturbs it.
- ``on_train_start``: join the quorum (the first start waits for every replica; a restart
  joins at a round boundary and heals θ_g, the outer state and its round from a live peer).
- ``after_optimizer_step``: a round every ``sync_every`` of this replica's steps; the
  replicas vote to commit or discard it; the trainer stops after the job's last round.
- ``sync_state_dict``: what the checkpoint holds; a replica does not resume from one
  (``load_sync_state_dict`` refuses): it heals from a peer instead.

Membership changes, heals and discarded rounds go to the job's ``history.jsonl``.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Mapping

from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.diloco.config import DiLoCoConfig
from syncplane.algorithms.diloco.elastic import ElasticOuter, JobFingerprint, RoundBoard, fingerprint
from syncplane.algorithms.diloco.outer import OuterOptimizer
from syncplane.algorithms.diloco import ft
from syncplane.algorithms.diloco.engine import host_mirror
from syncplane.job import JobContext
from syncplane import lightning_adapter
from syncplane.strategies.diloco import DiLoCo
from syncplane.strategies.diloco_elastic import ElasticDiLoCo


class QuorumDiLoCo(ElasticDiLoCo):
    """``DiLoCo`` with ``elastic=True, membership="quorum"``; same arguments (see ``DiLoCo``)."""

    ELASTIC = True
    MEMBERSHIP = "quorum"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_quorum(self.config)
        self._elastic: ElasticOuter | None = None
        self._local_steps = 0
        self._round_steps = 0   # steps since this replica's last round (more than H after it was late)

    @override
    def setup_sync(self, job: JobContext) -> None:
        self._replica = self._place().replica
        tensors = self.model_tensors()
        params = list(self.lightning_module.parameters())
        n_params = sum(p.numel() for p in params)
        self._host = host_mirror(tensors)
        config = self.config
        outer = OuterOptimizer(self._host.buffer[:n_params], config.outer_optimizer, config.outer_kwargs,
                               pin=self._host.on_gpu)
        ours = fingerprint(self._host.buffer.numel(), self.sync_every, config.outer_optimizer, config.outer_kwargs,
                           [tuple(t.shape) for t in tensors])
        # before any contact with the quorum: a replica with other settings never disturbs it
        JobFingerprint(self._place().folder).check(ours, f"replica {self._replica}")
        quorum = config.membership == "quorum"
        self._elastic = ElasticOuter(outer, ours, total_rounds=0, on_event=self._record_event,
                                     membership=config.membership,
                                     board=RoundBoard(self._place().folder, f"replica{self._replica}") if quorum
                                     else None, boundary_timeout_s=self.quorum_timeout_s, hold_s=config.grace_s)
        self.details["exchange"] = "torchft quorum (elastic)"

    @override
    def on_train_start(self) -> None:
        DiLoCo.on_train_start(self)   # not ElasticDiLoCo's: this loop joins its own way
        assert self._elastic is not None
        trainer = self.lightning_module.trainer
        self._elastic.total_rounds = int(trainer.estimated_stepping_batches) // self.sync_every
        place = self._place()
        restart = str(place.restarts)
        if self._done_marker().exists():   # restarted after the job's last round: nothing to rejoin
            self._record_event({"event": "start", "restart": int(restart), "job_done": True})
            trainer.should_stop = True
            return
        group = ft.ReplicaGroup(f"replica{self._replica}", place.lighthouse,
                                self._elastic.state_dict, self._elastic.load_state_dict,
                                host=ft.check_bind_host(place.bind or self.lighthouse_host),
                                round_timeout_s=self.round_timeout_s, quorum_timeout_s=self.quorum_timeout_s,
                                min_replicas=self.config.min_replicas if self.config.membership == "quorum" else 1)
        if restart == "0":
            ft.start_barrier(place.folder, self._replica, place.replicas, self.quorum_timeout_s)
        self._record_event({"event": "start", "restart": int(restart), "total_rounds": self._elastic.total_rounds})
        assert self._host is not None
        # membership=quorum: a restart takes part, with nothing, in the round it joins (to receive θ_g)
        if self._elastic.join(group, self._host.buffer if restart != "0" else None):
            self._host.from_host(self.model_tensors())
            self.rounds += 1
        self._adopt_peer()

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        assert self._elastic is not None and self._host is not None
        self._local_steps += 1
        self._round_steps += 1
        if self._round_steps < self.sync_every or self._elastic.done or self._elastic.transport is None:
            return
        if self._elastic.waits_for_boundary():   # late: train on until the next boundary opens
            return
        extra, steps = self._round_steps - self.sync_every, self._round_steps
        self._round_steps = 0
        lightning_adapter.extend_max_steps(self.lightning_module.trainer, extra)   # still reach the last round
        tensors = self.model_tensors()
        self._host.to_host(tensors)
        flat = self._host.buffer
        start = time.perf_counter()
        committed = self._elastic.round_(flat, steps / self.sync_every)
        self.comm_meter.record(start, time.perf_counter(), flat.numel() * flat.element_size())
        if committed:
            self._host.from_host(tensors)
            self.rounds += 1
        else:
            self.skipped += 1
        self._adopt_peer()
        self.details["elastic"] = self._elastic.stats.as_dict()
        if self._elastic.done:
            # replicas that finished together hold the same θ_g: the summary shows its digest
            self.details["elastic"]["theta_sha256"] = hashlib.sha256(
                self._elastic.outer.params.numpy().tobytes()).hexdigest()
            self._done_marker().touch()
            self._record_event({"event": "done", "position": self._elastic.position})
            self.lightning_module.trainer.should_stop = True

    def _adopt_peer(self) -> None:
        """After a heal, this replica starts from the peer's θ_g (its buffers stay its own)."""
        assert self._elastic is not None and self._host is not None
        if not self._elastic.healed:
            return
        params = self._elastic.outer.params
        self._host.buffer[: params.numel()].copy_(params)
        self._host.from_host(self.model_tensors(), 0, params.numel())
        self._elastic.healed = False
        self.details["elastic"] = self._elastic.stats.as_dict()

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        assert self._elastic is not None
        return {**self._elastic.state_dict(), "sync_every": self.sync_every, "rounds": self.rounds,
                "skipped": self.skipped}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError("membership=quorum does not resume from a checkpoint: a restarted replica heals "
                             "from a live peer instead")

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        return

    @override
    def teardown(self) -> None:
        if self._elastic is not None:
            self._elastic.close()
        DiLoCo.teardown(self)


def check_quorum(config: DiLoCoConfig) -> None:
    """What ``membership=quorum``'s own loop supports, checked at construction."""
    unsupported = {"fragments": (config.fragments, 1), "overlap_steps": (config.overlap_steps, 0),
                   "inner_steps": (config.inner_steps, "fixed"),
                   "compression": (config.compression, "none"), "streams": (config.streams, 1)}
    for key, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(f"membership=quorum supports {key}={allowed} only, got {key}={value} "
                             "(membership=fixed runs every round setting elastic)")
