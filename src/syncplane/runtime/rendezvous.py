"""How the ranks of a job find each other, and what a rank says when some never come.

- **Local jobs** (``python train.py`` starting its own processes): a ``FileStore`` in the
  run directory. No TCP listener at all.
- **External launchers and emulated clusters**: a ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``,
  the address the user (``torchrun --rdzv-endpoint``, SLURM's first node) or the emulator
  (rank 0's NIC) names, listening on that address only (``syncplane.net``: torch's
  own server would listen on every interface). Under torchrun the agent's store is reused
  (its rendezvous already admitted every node).

Either way every rank checks in under ``syncplane/<restart>/joined/<rank>`` and waits for
all the others up to ``trainer.rendezvous_timeout_s``; on timeout *every* rank that got
this far raises ``RendezvousTimeout`` naming the ranks that never came, instead of torch's
"1/2 clients joined" after half an hour. Lightning then finds the process group
initialized and skips its own setup (``_init_dist_connection`` returns early).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Mapping

import torch.distributed as dist

from syncplane.net import env_store, master_endpoint

#: Where a local job's ranks rendezvous (a file path); set by ``train.py``'s own launcher.
FILE_ENV = "SYNCPLANE_RENDEZVOUS_FILE"


class RendezvousTimeout(RuntimeError):
    """Some ranks never joined; the message names them."""


def backend_for(accelerator: str) -> str:
    """Model data's backend: NCCL for GPU jobs, gloo for CPU jobs (control traffic gets
    its own gloo group either way: ``syncplane.comm.process_groups``)."""
    return "nccl" if accelerator in ("gpu", "cuda") else "gloo"


def _store(world: int, timeout: datetime.timedelta, env: Mapping[str, str]) -> tuple[dist.Store, str]:
    path = env.get(FILE_ENV)
    if path:
        return dist.FileStore(path, world), f"file {path}"
    addr, port = master_endpoint(env)
    return env_store(timeout, env), f"{addr}:{port}"


def wait_for_all(store: dist.Store, rank: int, world: int, timeout_s: float, where: str, prefix: str) -> None:
    """Check in, then wait until every rank has; raise naming the missing ranks."""
    store.set(f"{prefix}/joined/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    missing = list(range(world))
    while True:
        missing = [r for r in missing if not store.check([f"{prefix}/joined/{r}"])]
        if not missing:
            return
        if time.monotonic() > deadline:
            shown = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
            raise RendezvousTimeout(
                f"rank {rank}: after {timeout_s:.0f} s, {len(missing)} of {world} ranks never joined the "
                f"rendezvous at {where}: rank(s) {shown}. Check that every node started, that they name the "
                "same address and world size, and trainer.rendezvous_timeout_s")
        time.sleep(0.1)


def join(accelerator: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
    """Initialize the default process group for this rank (torchrun-style variables)."""
    env = os.environ if env is None else env
    if dist.is_initialized():
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store, where = _store(world, timeout, env)
    prefix = _prefix(env)
    wait_for_all(store, rank, world, timeout_s, where, prefix)
    dist.init_process_group(backend_for(accelerator), store=dist.PrefixStore(f"{prefix}/pg", store), rank=rank,
                            world_size=world, timeout=max(timeout, datetime.timedelta(minutes=30)))


def _prefix(env: Mapping[str, str]) -> str:
    return f"syncplane/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def heartbeat_store(timeout_s: float, env: Mapping[str, str] | None = None) -> tuple[dist.Store, str, str]:
    """A client of the job's store for the heartbeat (``syncplane.runtime.heartbeat``), its
    address for messages, and the key prefix: a TCP client of its own whose operations give
    up after ``timeout_s`` (the training's client waits up to the process-group timeout),
    or the same file store (a file never hangs)."""
    env = os.environ if env is None else env
    prefix = f"{_prefix(env)}/heartbeat"
    path = env.get(FILE_ENV)
    if path:
        return dist.FileStore(path, -1), f"file {path}", prefix
    addr, port = master_endpoint(env)
    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"{addr}:{port}", prefix
