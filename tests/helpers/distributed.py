"""Run a function on N real processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes,
initializes ``torch.distributed`` (gloo, TCP rendezvous on 127.0.0.1) with torchrun's
environment variables set (so Lightning's ``TorchElasticEnvironment`` works inside),
calls ``fn(rank, world_size, *args)`` in each and returns the results in rank order.
The first rank to raise has its exception re-raised here with the remote traceback;
a rank that neither returns nor fails within ``timeout`` is named in a TimeoutError, and one
that dies (before it returns, or on its way out after) with its exit code, never a hang.
``fn`` must be importable (a module-level function), its arguments and result picklable.

The ranks are forks of a fork server that has imported torch, Lightning and ``syncplane.comm``
once for the whole test session: each rank is still a process of its own (own pid, memory,
process group and gloo sockets), but skips the seconds of CPU that a spawned interpreter
spends importing them. On 2 cores that import was most of a multi-process test's time:
``tests/dist`` took 22.8 min with spawned ranks and 4.2 min with forked ones. Each rank takes
the test's current environment and working directory, as a spawned one would, not the
server's.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from syncplane.runtime import forkserver
from syncplane.runtime.launcher import free_port


class RemoteError(RuntimeError):
    """An exception raised on one of the ranks."""


#: What every rank imports anyway, imported once by the fork server (the one the launcher's
#: ranks are forked from as well: ``syncplane.runtime.forkserver``).
PRELOAD = [*forkserver.PRELOAD, "syncplane.comm", "tests.helpers.distributed"]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
           out: Any, pg_timeout_s: float, environ: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)    # a native crash prints every thread's Python stack
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        # Serialized to bytes here: a tensor pickled as-is travels as a shared-memory handle
        # that dies with this process, before the parent has read it.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        outcome = ("ok", buffer.getvalue())
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    # Sent whole before the teardown starts (a pipe write returns once the parent has it all):
    # a rank that then dies on its way out cannot leave the parent half a message.
    try:
        out.send(outcome)
    except BrokenPipeError:     # the parent has given up (another rank failed first): nobody to tell
        pass
    out.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    pg_timeout_s: float = 60.0) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, pipes[r][1], pg_timeout_s, *here),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    for _, writer in pipes:     # the ranks hold the only writers: a rank that dies is an EOF here
        writer.close()
    waiting = {pipes[r][0]: r for r in range(world_size)}
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(waiting.values())} did not finish within {timeout:.0f} s")
            for reader in mp.connection.wait(list(waiting), timeout=min(remaining, 1.0)):
                rank = waiting.pop(reader)
                try:
                    status, value = reader.recv()
                except (EOFError, OSError):
                    procs[rank].join(timeout=10)
                    raise RemoteError(f"rank {rank} died with exit code {procs[rank].exitcode} before it "
                                      "returned") from None
                if status == "error":
                    raise RemoteError(f"rank {rank} raised {value}")
                outcomes[rank] = value
        for rank, p in enumerate(procs):
            p.join(timeout=10)
            if p.exitcode not in (None, 0):
                raise RemoteError(f"rank {rank} returned, then died on its way out with exit code {p.exitcode}")
    finally:
        for reader, _ in pipes:
            reader.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    import torch

    return [torch.load(io.BytesIO(outcomes[r]), weights_only=False) for r in range(world_size)]


def straggle_after_peers_started(key: str, late: bool, timeout_s: float) -> None:
    """The late rank waits until every other rank has started the round (set ``key/<rank>``),
    then stays away for three times their timeout: their round fails for certain, however
    loaded the machine is, while rounds without a straggler get a generous timeout."""
    import time

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    if not late:
        store.set(f"{key}/{dist.get_rank()}", "started")
        return
    store.wait([f"{key}/{r}" for r in range(dist.get_world_size()) if r != dist.get_rank()])
    time.sleep(3 * timeout_s)


def rounds_with_a_straggler(exchange: Any, rank: int, late_rank: int, numel: int, key: str
                            ) -> tuple[list[bool], list[tuple[Any, Any]], int]:
    """Three rounds of ``exchange.allreduce_mean_`` (a ``StreamRunner``); in the second,
    ``late_rank`` straggles past everyone's 1-s timeout. Returns each round's commit flag,
    (input, output) per round, and the exchange's failure count; closes the exchange."""
    import torch

    flats, outcomes = [], []
    for round_ in range(3):
        flat = torch.full((numel,), float(rank + 10 * round_))
        before = flat.clone()
        if round_ == 1:   # a straggler: every other rank's round times out (after 1 s)
            exchange.timeout_s = 1.0
            straggle_after_peers_started(key, rank == late_rank, exchange.timeout_s)
        else:
            exchange.timeout_s = 60.0
        outcomes.append(exchange.allreduce_mean_(flat))
        flats.append((before, flat.clone()))
    exchange.close()
    return outcomes, flats, exchange.failures


def assert_only_the_straggled_round_discarded(results: list[Any], world: int, numel: int) -> None:
    """What ``rounds_with_a_straggler`` must give on every rank: rounds 1 and 3 commit the
    mean of the ranks' inputs, round 2 is discarded and leaves its input untouched."""
    import torch

    for outcomes, flats, failures in results:
        assert outcomes == [True, False, True]
        assert failures == 1
        before, after = flats[1]
        assert torch.equal(before, after), "a discarded round leaves the input untouched"
        for round_ in (0, 2):
            want = torch.full((numel,), (world - 1) / 2 + 10 * round_)
            torch.testing.assert_close(flats[round_][1], want, rtol=1e-6, atol=1e-6)


def mix_steps_with_a_late_rank(tensors: list[Any], generator: Any, mix: Callable[[int], None], steps: int,
                               late_rank: int | None, late_step: int) -> tuple[list[Any], list[Any]]:
    """``steps`` steps of: a random local update of ``tensors``, then ``mix(step)`` (in place).
    ``late_rank`` (None: nobody) starts ``late_step`` only after every other rank has mixed it
    (a store key, no sleep). Returns the values each step sent and the mixed ones, flat."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store, rank, world = distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    sent, mixed = [], []
    for step in range(steps):
        if rank == late_rank and step == late_step:   # late: only after the others combined this step
            store.wait([f"combined/{step}/{r}" for r in range(world) if r != rank])
        for t in tensors:
            t.add_(torch.randn(t.shape, generator=generator))   # this step's local update
        sent.append(torch.cat([t.reshape(-1) for t in tensors]).clone())
        mix(step)
        store.set(f"combined/{step}/{rank}", "1")
        mixed.append(torch.cat([t.reshape(-1) for t in tensors]).clone())
    return sent, mixed
