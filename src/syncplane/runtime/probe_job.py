"""The network of this job, probed, as a cluster profile: what ``syncplane plan --probe`` plans
from, with no hand-written YAML.

Two places to probe:

- **under the job's launcher** (``torchrun``/``srun`` start ``syncplane plan --probe`` once per
  rank): the ranks rendezvous on the launcher's address, check in (a rank that never comes is
  named, ``rendezvous.wait_for_all``), then rank 0 waits for every rank on the gloo group
  (``monitored_barrier``: a rank that joined but that rank 0 cannot hear from is named), and
  all of them run the probe (``syncplane.cluster.probe.probe``); rank 0 gets the profile;
- **on an emulated cluster**: the probe's own command runs on every host of it
  (``launch_on_cluster``), and the profile it writes is read back.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
import yaml

from syncplane.cluster.probe import probe
from syncplane.cluster.profile import ClusterProfile, load_profile, parse_profile
from syncplane.config import ConfigError
from syncplane.job import JobContext
from syncplane.net import env_store, master_endpoint
from syncplane.runtime import external
from syncplane.runtime.rendezvous import wait_for_all

log = logging.getLogger(__name__)


class ProbeError(RuntimeError):
    """A rank the probe needs cannot be reached; the message names it."""


def _join(timeout_s: float) -> None:
    """Initialize gloo from the launcher's variables, naming ranks that never check in."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = env_store(timeout)
    addr, port = master_endpoint(os.environ)
    wait_for_all(store, rank, world, timeout_s, f"{addr}:{port}", "syncplane/probe")
    dist.init_process_group("gloo", store=dist.PrefixStore("syncplane/probe/pg", store), rank=rank,
                            world_size=world, timeout=timeout)


def check_reachable(timeout_s: float) -> None:
    """Collective: every rank answers rank 0 on the gloo group within ``timeout_s``; else
    ``ProbeError`` on rank 0 naming the ranks that did not (torch's message lists them)."""
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        found = re.search(r"Ranks? ([\d, ]+) failed", str(exc))
        ranks = found.group(1).strip() if found else "?"
        raise ProbeError(f"probe: rank(s) {ranks} of {dist.get_world_size()} did not answer rank 0 within "
                         f"{timeout_s:.0f} s (a host the others cannot reach: check its address and "
                         f"GLOO_SOCKET_IFNAME): {exc}") from exc


def probe_here(mb: float, streams: int, timeout_s: float = 120.0) -> ClusterProfile | None:
    """Collective over the launcher's ranks: probe this job's network; the profile on rank 0,
    None on the others. Starts (and ends) the process group unless one is running."""
    started = not dist.is_initialized()
    if started:
        launch = external.detect()
        if launch is None:
            raise ConfigError("plan --probe: no launcher here; run it once per rank under torchrun or srun "
                              "(torchrun --nproc-per-node N -m syncplane plan --probe ...), or give --cluster "
                              "NAME|PATH to probe that emulated cluster")
        external.adopt(launch, os.environ)
        _join(timeout_s)
    try:
        check_reachable(timeout_s)
        job = JobContext.from_environment(rank=dist.get_rank(), world_size=dist.get_world_size())
        topo = probe(int(mb * 2**20), refresh=True, job=job, streams=streams)
        return topo.to_profile("probed") if dist.get_rank() == 0 else None
    finally:
        if started:
            dist.destroy_process_group()


def probe_emulated(cluster: str, mb: float, streams: int, timeout_s: float = 300.0) -> ClusterProfile:
    """Build the emulated cluster ``cluster`` (a shipped name or a YAML path), run the probe on
    every host of it and return the profile it wrote."""
    from syncplane.cluster import emulator
    from syncplane.runtime.launcher import launch_on_cluster

    emulator.require_support()
    with tempfile.TemporaryDirectory(prefix="syncplane-probe-") as tmp:
        written = Path(tmp) / "probed.yaml"
        try:
            launch_on_cluster([sys.executable, "-m", "syncplane.cluster.probe", "--mb", str(mb), "--refresh",
                               "--streams", str(streams), "--profile", str(written)],
                              load_profile(cluster), Path(tmp) / "logs", timeout_s=timeout_s, echo_rank0=False)
        finally:
            emulator.down()
        return parse_profile(yaml.safe_load(written.read_text()))
