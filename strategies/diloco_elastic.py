"""Elastic DiLoCo: each rank (or each node's L ranks, ``replica=node``) an independent replica
over a torchft quorum; ``DiLoCo(..., elastic=True)`` constructs it. A node replica is one
Lightning job (its outer state sharded over its ranks: ``layout.job_layout``) and one torchft
replica group (``ft``): its ranks leave, restart and heal together. The round is ``DiLoCo``'s,
its exchanges over the current quorum (``elastic.QuorumTransport``); the vote and the next
quorum at each boundary, and the heal, are ``elastic.Membership``'s.

Lightning sees one replica's process group: ``distributed_sampler_kwargs`` shards the training
set by the rank's place in the whole job, while every replica validates on the whole set (no
all-reduce combines independent jobs' metrics). Membership changes, heals and discarded rounds
go to the job's ``history.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.optim import Optimizer
from typing_extensions import override

from syncplane.algorithms.diloco import ft
from syncplane.algorithms.diloco.adaptive import TimedRounds
from syncplane.algorithms.diloco.elastic import JobFingerprint, Membership, QuorumTransport, RoundBoard, fingerprint
from syncplane.algorithms.diloco.streaming import Round
from syncplane.algorithms.diloco.transport import Transport
from syncplane import lightning_adapter
from syncplane.job import ElasticPlace, JobContext, missing_elastic
from syncplane.strategies.diloco import DiLoCo


class ElasticDiLoCo(DiLoCo):
    """``DiLoCo`` with ``elastic=True``; same arguments (see ``DiLoCo``)."""

    ELASTIC = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # refused in elastic mode only (``DiLoCo`` checks the timeouts in either mode)
        if self.config.membership == "quorum" and self.config.inner_steps == "time":
            raise ValueError("inner_steps=time with membership=quorum: a quorum round already weighs each replica's "
                             "Δ by its steps; use inner_steps=fixed, or membership=fixed")
        if self.config.exchange == "tree":
            raise ValueError("exchange=tree with elastic=true: the tree is planned over the job's fixed hosts, "
                             "a quorum's members change; use exchange=mesh or auto")
        self.lighthouse_host = ft.check_bind_host(self.lighthouse_host)
        self.round_timeout_s = self.elastic_timeouts["round_timeout_s"]
        self.quorum_timeout_s = self.elastic_timeouts["quorum_timeout_s"]
        self._membership: Membership | None = None
        self._offset = 0          # the job's steps minus this replica's (a joiner's or healed one's)
        self._resumed: Mapping[str, Any] | None = None
        self._replica = 0
        self._quorum: QuorumTransport | None = None
        self._total_steps = 0     # the job's steps (trainer.estimated_stepping_batches)
        self._timed_quorum: int | None = None   # the quorum inner_steps=time's plan is for
        self._finished = False
        self.quorum = self.config.membership == "quorum"
        self._at = 0 if self.quorum else self.overlap_steps   # where in its period a replica meets the quorum
        self._out = False         # quorum: late (or restarted), training on until the next point opens
        self._since = 0           # quorum: this replica's steps not yet sent in a round (its Δ's weight)
        self._scale = 1.0         # quorum: this period's factor on Δ (``Membership.scale``)
        self._restarted = False   # quorum: a restart, out until its first point

    @property
    def membership(self) -> Membership:
        if self._membership is None:
            raise RuntimeError("elastic diloco is not set up yet (setup_sync runs when fitting starts)")
        return self._membership

    def _place(self) -> ElasticPlace:
        """This replica's place in the elastic job (the launcher's elastic mode, or torchft's variables)."""
        place = self.job.elastic
        if place is None:
            raise ValueError(f"elastic=true: this replica's place is unknown, {', '.join(missing_elastic())} unset; "
                             "start each replica group as its own torchrun job with torchft's TORCHFT_LIGHTHOUSE, "
                             "REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (docs/lightning.md), or run python train.py, "
                             "whose launcher starts the lighthouse and the replicas")
        return place

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        stage = self.lightning_module.trainer.state.stage if self.lightning_module is not None else None
        if stage is not None and stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        place = self._place()
        ranks = self.world_size   # a node replica's, all of one size
        return {"num_replicas": place.replicas * ranks, "rank": place.replica * ranks + self.global_rank}

    @property
    @override
    def round_step(self) -> int:
        return self.step + self._offset

    def _bind(self) -> str:
        return ft.check_bind_host(self._place().bind or self.lighthouse_host)

    @override
    def _transport(self, job: JobContext) -> Transport:
        self._quorum = QuorumTransport(self._bind(), self.round_timeout_s)
        return self._quorum

    @override
    def setup_sync(self, job: JobContext) -> None:
        place = self._place()
        self._replica = place.replica
        super().setup_sync(job)
        engine, config, transport = self.engine, self.config, self._quorum
        assert transport is not None
        settings = {key: getattr(config, key) for key in ("fragments", "overlap_steps", "compression", "outer")}
        node = {"ranks_per_replica": job.world_size} if job.world_size > 1 else {}
        ours = fingerprint(engine.host.buffer.numel(), self.sync_every, config.outer_optimizer, config.outer_kwargs,
                           [tuple(t.shape) for t in self.model_tensors()],
                           {**settings, **node, "streams": engine.streams, "exchange": engine.exchange_name})
        if not place.restarts and self._done_marker().exists():   # a first start: the marker is an earlier job's
            raise ValueError(f"elastic: {place.folder} holds an elastic job that finished; give each job a fresh "
                             "folder (SYNCPLANE_ELASTIC_DIR) or delete it")
        # before any contact with the quorum: a replica with other settings never disturbs it
        JobFingerprint(place.folder).check(ours, f"replica {self._replica}")
        board = RoundBoard(place.folder, f"replica{self._replica}") if self.quorum else None
        self._membership = Membership(transport, ours, 0, engine.shard_state_dict, engine.load_shard_state_dict,
                                      on_event=self._record_event, board=board, hold_s=config.grace_s,
                                      boundary_timeout_s=self.quorum_timeout_s, agree=self._from_rank0)
        self.details["exchange"] = f"{engine.exchange_name} over the torchft quorum (elastic)"

    def _from_rank0(self, value: Any) -> Any:
        """A node replica's rank 0's ``value`` on each of its ranks (Lightning's broadcast over the node)."""
        return value if self.world_size == 1 else self.broadcast(value, src=0)

    def _theta_digest(self) -> str:
        """θ_g's SHA-256; a node's: of its ranks' shard digests in shard order (a collective of the node)."""
        digest = hashlib.sha256(self.engine.params.numpy().tobytes()).hexdigest()
        if self.world_size > 1:
            every: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(every, digest)
            digest = hashlib.sha256("".join(every).encode()).hexdigest()
        return digest

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        membership, place, trainer = self.membership, self._place(), self.lightning_module.trainer
        # a boundary after each period's first round has merged: steps H + τ, 2H + τ, ...
        # (membership=quorum: a point before each period's rounds, steps H, 2H, ...)
        self._total_steps = int(trainer.estimated_stepping_batches)
        membership.total = (self._total_steps - self._at) // self.sync_every
        if self._done_marker().exists():   # restarted after the job's last round: nothing to rejoin
            self._record_event({"event": "start", "restart": place.restarts, "job_done": True})
            trainer.should_stop = True
            return
        group = ft.ReplicaGroup(f"replica{self._replica}", place.lighthouse, membership.state_dict,
                                membership.load_state_dict, host=self._bind(),
                                round_timeout_s=self.round_timeout_s, quorum_timeout_s=self.quorum_timeout_s,
                                min_replicas=self.config.min_replicas if self.quorum else 1,
                                group_rank=self.global_rank, group_world_size=self.world_size,
                                share_port=self._from_rank0)
        if self._resumed is not None:   # where the checkpoint stood: torchft heals it if the others went on
            group.set_step(int(self._resumed["ft_step"]))
        if place.restarts == 0:
            ft.start_barrier(place.folder, self._replica, place.replicas, self.quorum_timeout_s)
        self._record_event({"event": "start", "restart": place.restarts, "total_rounds": membership.total})
        if self.quorum and place.restarts:   # enters at the next point that opens, from θ_g
            membership.group, self._out, self._restarted = group, True, True
            return
        membership.join(group)
        self._adopt_if_healed(self.step)

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        membership = self.membership
        if membership.group is None or self._finished:
            return
        if not self.quorum or self._quorum_point():
            super().after_optimizer_step(optimizer)
        done = self.round_step + 1
        if not self.quorum and self._at_boundary(done):
            membership.boundary()   # no round in flight here: vote, then the next quorum
            self._adopt_if_healed(self.step + 1)
            self._plan_time(done)
        if done >= self._total_steps:   # the job's last step (a joiner's local steps are fewer)
            self.engine.wait()
            self._finished = True
            # replicas that finished together hold the same θ_g: the summary shows its digest
            self.details["elastic"] = {**membership.stats.as_dict(), "theta_sha256": self._theta_digest()}
            self._done_marker().touch()
            self._record_event({"event": "done", "position": membership.position})
            self.lightning_module.trainer.should_stop = True

    def _at_boundary(self, done: int) -> bool:
        """Whether this replica meets the quorum after step ``done`` (no round in flight there)."""
        return not self.membership.done and done >= self.sync_every and done % self.sync_every == self._at

    def _quorum_point(self) -> bool:
        """``membership=quorum``, before this step's rounds: at a point, the vote, this period's
        quorum and the weight of this replica's Δ (its steps since it last sent one). False: late,
        it trains on without rounds until the next point opens, then heals and carries its work."""
        membership = self.membership
        self._since += 1
        if self._out:
            if membership.late():
                return False
            restart, self._restarted, self._out = self._restarted, False, False
            old = None if restart else self.engine.params.clone()
            membership.rejoin(0.0 if restart else (self._since - self.sync_every) / self.sync_every)
            if restart and membership.healed:   # its steps since it started were on a stale model
                self._since = 0
            self._adopt_if_healed(self.step + 1, old)
            self._at_job_step(self.step + 1)   # healed or not, it enters at the job's step
        elif self._at_boundary(self.round_step + 1):
            if not membership.point():
                self._out = True
                return False
            self._adopt_if_healed(self.step + 1)
        else:
            return True
        self._scale = membership.scale(self._since)
        membership.work, self._since = self._since / self.sync_every, 0
        return True

    @override
    def _launch(self, fragment: int, done: int, background: bool) -> None:
        if not self.quorum:
            return super()._launch(fragment, done, background)
        self.engine.launch(self.model_tensors(), fragment, done + self.overlap_steps, background, self.comm_meter,
                           scale=self._scale)

    @override
    def _decide(self, timed: TimedRounds, done: int) -> None:
        return   # after the boundary, over its quorum (``_plan_time``)

    def _plan_time(self, done: int) -> None:
        """``inner_steps=time``: the plan over the quorum just formed (a new one at a membership
        change, every replica first computing every slot: a joiner has measured nothing). A node
        replica's step time is its slowest rank's, so that its ranks plan alike."""
        membership = self.membership
        group, view = membership.group, membership.transport.view
        assert group is not None
        if self._timed is None or membership.done or view is None:
            return
        if view.quorum_id != self._timed_quorum:
            self._timed, self._timed_quorum = self._timed_rounds(view.participants, view.rank), view.quorum_id
        self.details["round_steps"] = self._timed.decide(
            lambda value: group.gather_floats(self._slowest(value), view), done // self.sync_every)

    def _slowest(self, value: float) -> float:
        """The largest of a node replica's ranks' ``value`` (Lightning's reduce over the node)."""
        if self.world_size == 1:
            return value
        return float(self.reduce(torch.tensor([value], dtype=torch.float64), reduce_op="max"))

    @override
    def _merge(self, round_: Round) -> None:
        committed = self.rounds
        super()._merge(round_)
        self.membership.record(self.rounds > committed, round_.fragment, self.fragments)

    def _done_marker(self) -> Path:
        return self._place().folder / "elastic_done"

    def _adopt_if_healed(self, done: int, old: torch.Tensor | None = None) -> None:
        """After a quorum: a healed replica starts from the peer's θ_g (its buffers stay its own;
        given ``old``, θ_g before the heal, its own work since stays on top: ``rebase``) at the
        job's step, ``done`` of its own steps being complete."""
        membership = self.membership
        if membership.healed:
            if old is None:
                self.engine.adopt(self.model_tensors())
            else:
                self.engine.rebase(self.model_tensors(), old)
            membership.healed = False
            self._at_job_step(done)
        self.details["elastic"] = membership.stats.as_dict()

    def _at_job_step(self, done: int) -> None:
        """Count the job's steps (its position's), ``done`` of this replica's own being complete;
        one ahead of the job (it trained on while late) gets a larger step limit."""
        membership = self.membership
        position = membership.position
        offset = (position * self.sync_every + self._at if position else 0) - done
        lightning_adapter.extend_max_steps(self.lightning_module.trainer, self._offset - offset)
        self._offset = offset
        self.rounds, self.skipped = membership.stats.committed, membership.stats.discarded

    def _record_event(self, record: dict[str, Any]) -> None:
        """One line of the job's ``history.jsonl`` (one ``O_APPEND`` write: replicas share the file)."""
        node = {"rank": self.global_rank} if self.world_size > 1 else {}   # a node replica: which of its ranks
        line = json.dumps({"replica": self._replica, **node, "time": round(time.time(), 3), **record}) + "\n"
        with open(self._place().folder / "history.jsonl", "ab", buffering=0) as f:
            f.write(line.encode())

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        membership = self.membership
        group = membership.group
        return {**super().sync_state_dict(),
                "elastic": {"position": membership.position, "offset": self._offset,
                            "ft_step": group.step if group is not None else 0, "replica": self._replica,
                            "committed": membership.stats.committed, "discarded": membership.stats.discarded}}

    @override
    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        # inner_steps=time: the plan was the old quorum's; it is made again at the first boundary
        super().load_sync_state_dict({k: v for k, v in state.items() if k != "timed"})
        membership, mine = self.membership, state["elastic"]
        membership.position, self._offset = int(mine["position"]), int(mine["offset"])
        membership.stats.committed, membership.stats.discarded = int(mine["committed"]), int(mine["discarded"])
        self._resumed = mine

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {**super().rank_state_dict(), "replica": self._replica}

    @override
    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        # every replica is rank 0 of its own job: residuals are this replica's only if it wrote them
        if state.get("replica") == self._replica:
            super().load_rank_state_dict({k: v for k, v in state.items() if k != "replica"})

    @override
    def teardown(self) -> None:
        if self._membership is not None:
            self._membership.close()
        super().teardown()
