"""Canary's per-step exchange on a flat payload, for ``syncplane bench``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from syncplane.algorithms.canary.config import CanaryConfig
from syncplane.algorithms.canary.engine import CanaryEngine
from syncplane.algorithms.flexreduce.tree import job_hosts, job_tree, world_tree
from syncplane.algorithms.spec import JobWorld
from syncplane.cluster.probe import CLUSTER_ENV
from syncplane.cluster.profile import ClusterProfile, load_profile
from syncplane.comm import (DEFAULT_BUCKET_BYTES, CommMeter, CubeAllReduce, NestedAllReduce, ShardedAllReduce,
                            shard_bounds)
from syncplane.comm.sharded import interfaces_from_env
from syncplane.config import ConfigError

log = logging.getLogger(__name__)


def nic_count(nics: int | str) -> int:
    """``auto``: one gloo group per NIC named in ``GLOO_SOCKET_IFNAME`` (1 if none)."""
    if nics == "auto":
        return len(interfaces_from_env() or [None])
    return int(nics)


def cube_shape(profile: ClusterProfile | None = None) -> tuple[int, int] | None:
    """(α, β) when the job runs on a BCube profile (default: the one the cluster launcher
    named in ``SYNCPLANE_CLUSTER``), else None. The cube exchange needs what BCube's
    addressing gives it -- β NICs on every host (the profile checks that) and one rank per
    host (checked here, naming the field)."""
    if profile is None:
        path = os.environ.get(CLUSTER_ENV)
        if not path:
            return None
        profile = load_profile(path)
    if profile.bcube is None:
        return None
    for h, host in enumerate(profile.hosts):
        if host.spec.ranks != 1:
            raise ConfigError(f"cluster.racks[0].hosts[{h}].ranks: canary's cube exchange on "
                              f"BCube({profile.bcube.alpha}, {profile.bcube.beta}) runs one rank per host, "
                              f"host {host.name!r} has {host.spec.ranks}")
    return profile.bcube.alpha, profile.bcube.beta


def job_radices(world_size: int, world: JobWorld | None = None) -> tuple[list[int] | None, str, bool]:
    """How the job's ranks nest, innermost level first (``FlexTree.radices``), its tree in
    words, and whether the innermost level is the ranks of one host: FlexReduce's tree of
    the job -- the cluster profile the launcher named, else hosts of ``LOCAL_WORLD_SIZE``
    ranks (``torchrun`` and ``srun`` number a node's ranks together), so a real multi-node
    job nests by node with no profile at all. ``world``: the same answer in the launching
    process, before the ranks (and their environment) exist."""
    try:
        if world is None:
            tree = job_tree("auto", world_size)
            per_host = len(job_hosts(world_size)[0])
        else:
            tree = world_tree("auto", world)
            per_host = len(world.profile.hosts[0].ranks) if world.profile is not None else world.local_size
    except ConfigError as exc:
        return None, str(exc), False
    radices = tree.radices()
    return radices, tree.describe(), innermost_is_host(radices, per_host)


def innermost_is_host(radices: list[int] | None, ranks_per_host: int) -> bool:
    """Whether the nested exchange's level 0 is the ranks of one host (its hop then goes
    through memory, raw): the transport and the cost model decide it here, alike."""
    return bool(radices) and ranks_per_host > 1 and radices[0] == ranks_per_host


def make_transport(config: CanaryConfig) -> ShardedAllReduce:
    """The exchange (a collective; every rank decides alike from the same profile or
    environment): on a BCube profile the paper's two-stage cube all-reduce (one gloo group
    per level, i.e. per NIC; ``config.nics`` must then be auto or β); where the ranks are
    grouped in hosts or racks the nested exchange (one stream per NIC); else the
    piece-level mesh exchange, one gloo group per NIC (``CanaryConfig.exchange``)."""
    shape = cube_shape() if config.exchange != "mesh" else None
    if shape is not None:
        alpha, beta = shape
        check_cube_nics(config.nics, shape)
        log.info("canary: two-stage cube exchange on BCube(%d, %d)", alpha, beta)
        return CubeAllReduce(alpha, beta, codec=config.codec(), timeout_s=config.sync_timeout_s)
    streams = nic_count(config.nics)
    if config.exchange != "mesh":
        radices, tree, in_host = job_radices(dist.get_world_size())
        if radices is not None and len(radices) > 1:
            exact = [0] if in_host and not config.compress_in_host else []
            if exact and config.nics == "auto":
                # two streams per NIC: one stream's in-host fp32 hop (memory) then overlaps the
                # other's wire hop; on multi_nic 2.28 -> 1.83 s/step (4 ranks, ResNet-50). With
                # no in-host hop a second stream only adds flows: two_racks 5.24 -> 5.31 s
                streams *= 2
            log.info("canary: nested exchange, levels %s (innermost first)%s, %d stream(s), tree %s", radices,
                     " (in-host level exact fp32)" if exact else "", streams, tree)
            return NestedAllReduce(radices, streams=streams, codec=config.codec(), exact_levels=exact,
                                   timeout_s=config.sync_timeout_s)
        if config.exchange == "nested":
            raise nested_refused(tree)
        log.info("canary: piece-level mesh exchange (the job's tree %s does not nest evenly)", tree)
    return ShardedAllReduce(streams, codec=config.codec(), timeout_s=config.sync_timeout_s, layout="pieces")


def check_cube_nics(nics: int | str, shape: tuple[int, int]) -> None:
    """The cube exchange runs one gloo group per BCube level (one NIC each)."""
    alpha, beta = shape
    if nics != "auto" and nics != beta:
        raise ConfigError(f"nics: BCube({alpha}, {beta}) gives every host {beta} NICs and the cube exchange "
                          f"uses one per level; set nics=auto or {beta}, got {nics}")


def nested_refused(tree: str) -> ConfigError:
    return ConfigError(f"exchange: nested needs the ranks grouped in hosts or racks of equal size (at "
                       f"least two groups of two); this job's tree is {tree}")


def check_job(name: str, kwargs: Mapping[str, Any], world: JobWorld) -> None:
    """``make_transport``'s choice made in the launching process, so that what it would
    refuse on every rank (``exchange: nested`` on ranks that do not nest, the cube's NIC
    count, a BCube host of several ranks) is refused before any rank starts."""
    exchange, nics = kwargs.get("exchange", "auto"), kwargs.get("nics", "auto")
    if exchange == "mesh":
        return
    shape = cube_shape(world.profile) if world.profile is not None else None
    if shape is not None:
        check_cube_nics(nics, shape)
        return
    radices, tree, _ = job_radices(world.size, world)
    if exchange == "nested" and not (radices is not None and len(radices) > 1):
        raise nested_refused(tree)


#: ``syncplane bench --exchange`` (DiLoCo's names) -> Canary's: the flat owner exchange is the mesh
BENCH_EXCHANGE = {"auto": "auto", "owner": "mesh", "tree": "nested"}


class CanaryStep:
    """Canary's exchange of the payload as DDP-sized colayers (25 MiB), every step, after
    the backward (it does not overlap it), always with the gradient sketch (the bench's
    ``compression`` option is DiLoCo's). ``options["shards"]`` > 1 sets the gloo groups;
    otherwise one per NIC named in ``GLOO_SOCKET_IFNAME``. ``options["exchange"]``: ``owner``
    runs the flat mesh, ``tree`` the nested exchange, ``auto`` what training would pick."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        shards = int(options.get("shards") or 1)
        self.config = CanaryConfig(compression="sketch", nics=shards if shards > 1 else "auto",
                                   exchange=BENCH_EXCHANGE[str(options.get("exchange") or "auto")])
        self.transport = make_transport(self.config)
        self.engine: CanaryEngine | None = None

    def describe(self) -> str:
        if isinstance(self.transport, CubeAllReduce):
            layout = f"cube exchange on BCube({self.transport.alpha}, {self.transport.beta})"
        elif isinstance(self.transport, NestedAllReduce):
            exact = sorted(self.transport.exact_levels)
            layout = f"nested exchange, levels {self.transport.radices}" + (f", exact level(s) {exact}" if exact else "")
        else:
            layout = "piece mesh"
        return f"canary: {self.config.compression}, {self.transport.shards} gloo group(s), {layout}"

    def __call__(self, payload: torch.Tensor, step: int, meter: CommMeter) -> None:
        per_colayer = DEFAULT_BUCKET_BYTES // payload.element_size()
        colayers = list(payload.split(per_colayer))
        if self.engine is None or self.engine.total != payload.numel():
            self.engine = CanaryEngine([c.numel() for c in colayers], dist.get_world_size(), self.transport)
        self.engine.exchange_all_(colayers, meter)


def sketch_ratio(numel: int, pieces: int, config: CanaryConfig = CanaryConfig()) -> float:
    """Bytes of a sketched colayer of ``numel`` values cut in ``pieces``, over its fp32 bytes."""
    codec = config.codec()
    return sum(codec.nbytes(hi - lo) for lo, hi in shard_bounds(numel, pieces)) / max(1, 4 * numel)
