"""Comparison peers: the same recipe trained by Horovod or torchft instead of a syncplane strategy.

A peer is not a Lightning strategy: it is another framework's synchronization, run as
that framework is used -- Horovod 0.28.1 (``hvd.DistributedOptimizer``) in its own
virtualenv with torch 2.0.1, torchft 0.2.0 (``torchft.local_sgd.DiLoCo``) next to our
torch. For the comparison to be fair it must train exactly what the strategies train,
so :func:`export` writes, from the composed job config, what ``peer_loop.py`` replays:
the recipe's network (layer list) and its initial weights (same seed), the data, each
rank's sample order per epoch (Lightning's ``DistributedSampler`` with the job's seed),
and the learning rate at every step (the recipe's schedule). The peer's ranks start on
the same emulated cluster as the strategies' (or on loopback) and write the same
``summary.json`` + ``history.jsonl``.

A peer whose environment is missing is reported by :func:`unavailable_reason` with how
to install it; the comparison lists it as such rather than dropping it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from syncplane.config import ConfigError

PEERS = ("horovod", "torchft_diloco")
#: the syncplane strategy whose config a peer shares (torchft's DiLoCo takes our H and outer optimizer)
BASE_STRATEGY = {"horovod": "ddp", "torchft_diloco": "diloco"}
HOROVOD_VENV = Path(os.environ.get("SYNCPLANE_HOROVOD_VENV", Path.home() / ".cache" / "syncplane" / "horovod-venv"))
LOOP = Path(__file__).with_name("peer_loop.py")

# Horovod's HTTP rendezvous server (what horovodrun would start), run with the Horovod venv's python.
HOROVOD_RENDEZVOUS = """
import sys, time
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
server = RendezvousServer(verbose=0)
port = server.start()
server.init(get_host_assignments(parse_hosts(sys.argv[1]), int(sys.argv[2])))
print(port, flush=True)
time.sleep(100000)
"""


def unavailable_reason(peer: str, horovod_venv: Path = HOROVOD_VENV) -> str | None:
    """None when ``peer`` can run here, else what is missing and how to install it."""
    if peer == "horovod":
        python = horovod_venv / "bin" / "python"
        if not python.exists():
            return f"not available: run scripts/setup_horovod.sh (no Horovod venv at {horovod_venv})"
        probe = subprocess.run([str(python), "-c", "import horovod.torch"], capture_output=True, text=True)
        if probe.returncode:
            return f"not available: Horovod in {horovod_venv} does not import; re-run scripts/setup_horovod.sh"
        return None
    if peer == "torchft_diloco":
        try:
            import torchft.local_sgd  # noqa: F401
        except ImportError:
            return "not available: pip install 'syncplane[ft]' (torchft==0.2.0)"
        return None
    raise ConfigError(f"peer: unknown peer {peer!r}; allowed values: {', '.join(PEERS)}")


_LAYER_ARGS = {
    "Conv2d": ("in_channels", "out_channels", "kernel_size", "stride", "padding"),
    "Linear": ("in_features", "out_features"),
    "BatchNorm1d": ("num_features", "eps", "momentum"), "BatchNorm2d": ("num_features", "eps", "momentum"),
    "ReLU": (), "GELU": (), "Tanh": (), "Flatten": ("start_dim", "end_dim"), "Dropout": ("p",),
    "MaxPool2d": ("kernel_size", "stride"), "AdaptiveAvgPool2d": ("output_size",),
}


def network_spec(network: Any) -> list[list[Any]]:
    """An ``nn.Sequential`` of standard layers as ``[[class name, kwargs], ...]`` (JSON), so a
    process under another torch version builds the same network."""
    from torch import nn

    if not isinstance(network, nn.Sequential):
        raise ConfigError(f"recipe: comparison peers replay an nn.Sequential network, this recipe's is a "
                          f"{type(network).__name__}")
    spec = []
    for layer in network:
        name = type(layer).__name__
        if name not in _LAYER_ARGS or type(layer) is not getattr(nn, name):
            raise ConfigError(f"recipe: comparison peers cannot rebuild layer {name}; supported: "
                              f"{', '.join(_LAYER_ARGS)}")
        kwargs = {a: getattr(layer, a) for a in _LAYER_ARGS[name]}
        if name in ("Conv2d", "Linear"):
            kwargs["bias"] = layer.bias is not None
        spec.append([name, json.loads(json.dumps(kwargs))])   # tuples -> lists
    return spec


def export(container: Mapping[str, Any], peer: str, run_dir: Path) -> Path:
    """Write what ``peer_loop.py`` replays (see the module docstring); returns ``peer.json``.

    Raises ConfigError, before anything starts, for a job a peer cannot reproduce."""
    import numpy as np
    from lightning.pytorch import seed_everything
    from torch.utils.data import DistributedSampler, TensorDataset

    from syncplane import recipes
    from syncplane.comm import ring_allreduce_bytes
    from syncplane.recipes.classifier import ImageClassifier
    from syncplane.recipes.optim import schedule_factor
    from syncplane.runtime.settings import parse_job
    from syncplane.runtime.worker import threads_per_rank

    spec = parse_job(container, run_dir=str(run_dir))
    world, trainer = spec.trainer.devices, spec.trainer
    if trainer.max_steps > 0 or trainer.accumulate_grad_batches != 1 or trainer.gradient_clip_val:
        raise ConfigError(f"trainer: the {peer} peer replays whole epochs without accumulation or clipping; "
                          f"leave max_steps, accumulate_grad_batches and gradient_clip_val at their defaults")
    seed_everything(spec.seed, verbose=False)   # what each worker does before building the recipe
    module, data = recipes.get(spec.recipe_name).build(spec.recipe)
    if not isinstance(module, ImageClassifier) or module.reference_batch is not None or not module.decay_norm_and_bias:
        raise ConfigError(f"recipe.name: {spec.recipe_name!r}: comparison peers replay image recipes trained with "
                          "plain SGD (no LR scaling, weight decay on every parameter)")
    data.setup("fit")
    train_set, val_set = data.train_set, data.val_set
    if not (isinstance(train_set, TensorDataset) and isinstance(val_set, TensorDataset)):
        raise ConfigError(f"recipe.name: {spec.recipe_name!r}: comparison peers need in-memory TensorDatasets")
    batch = int(spec.recipe.batch_size)
    orders = []
    for rank in range(world):   # Lightning's sampler: shuffled with the global seed, padded, rank::world
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=spec.seed)
        per_rank = []
        for epoch in range(trainer.max_epochs):
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        orders.append(per_rank)
    steps_per_epoch = len(orders[0][0]) // batch
    total = max(1, steps_per_epoch * trainer.max_epochs)
    factor = schedule_factor(module.schedule, total_steps=total,
                             warmup_steps=round(module.warmup_epochs * steps_per_epoch),
                             milestones=[m * steps_per_epoch for m in module.milestones])
    folder = run_dir / "peer"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "data.npz", train_x=train_set.tensors[0].numpy(), train_y=train_set.tensors[1].numpy(),
             val_x=val_set.tensors[0].numpy(), val_y=val_set.tensors[1].numpy())
    np.save(folder / "order.npy", np.asarray(orders, dtype=np.int64))
    np.save(folder / "lrs.npy", np.asarray([module.lr * factor(s) for s in range(total)], dtype=np.float64))
    np.savez(folder / "weights.npz", **{k: v.detach().cpu().numpy() for k, v in module.network.state_dict().items()})
    param_bytes = sum(p.numel() * p.element_size() for p in module.network.parameters())
    threads = threads_per_rank(spec, world)   # every rank on this machine, emulated cluster or not
    cfg: dict[str, Any] = {
        "peer": peer, "recipe": spec.recipe_name, "run_dir": str(run_dir.resolve()), "seed": spec.seed,
        "epochs": trainer.max_epochs, "batch_size": batch, "momentum": module.momentum,
        "weight_decay": module.weight_decay, "threads": threads, "network": network_spec(module.network),
        "data": str((folder / "data.npz").resolve()), "order": str((folder / "order.npy").resolve()),
        "lrs": str((folder / "lrs.npy").resolve()), "weights": str((folder / "weights.npz").resolve()),
        "bytes_per_sync": ring_allreduce_bytes(param_bytes, world),
    }
    if peer == "torchft_diloco":
        cfg.update(_diloco_settings(spec.strategy.kwargs))
    path = folder / "peer.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return path


def _diloco_settings(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Our DiLoCo's H and outer optimizer, for torchft's DiLoCo (what makes the two comparable)."""
    from syncplane.algorithms.diloco.outer import DEFAULT_KWARGS, DEFAULT_OPTIMIZER, resolve_optimizer

    for key, plain in (("fragments", 1), ("compression", "none"), ("overlap_steps", 0)):
        if kwargs.get(key, plain) != plain:
            raise ConfigError(f"strategy.kwargs.{key}: {kwargs[key]!r}; the torchft_diloco peer is compared with "
                              f"plain DiLoCo ({key}={plain!r})")
    optimizer = str(kwargs.get("outer_optimizer", DEFAULT_OPTIMIZER))
    resolve_optimizer(optimizer)
    outer = kwargs.get("outer_kwargs")
    if outer is None:
        outer = DEFAULT_KWARGS if optimizer == DEFAULT_OPTIMIZER else {}
    return {"sync_every": int(kwargs.get("sync_every", 10)), "outer_optimizer": optimizer,
            "outer_kwargs": dict(outer), "sync_timeout_s": float(kwargs.get("sync_timeout_s", 600.0))}


def run_peer(peer: str, container: Mapping[str, Any], run_dir: Path, *, echo_to: IO[str] | None = None,
             horovod_venv: Path = HOROVOD_VENV) -> dict[str, Any]:
    """Train the job ``container`` describes with ``peer``; returns its summary."""
    from syncplane.runtime.launcher import launch, launch_on_cluster, local_ranks
    from syncplane.runtime.settings import parse_job

    reason = unavailable_reason(peer, horovod_venv)
    if reason is not None:
        raise ConfigError(f"peer {peer}: {reason}")
    run_dir.mkdir(parents=True, exist_ok=True)
    peer_file = export(container, peer, run_dir)
    spec = parse_job(container, run_dir=str(run_dir))
    logs = run_dir / "logs"
    if peer == "torchft_diloco":
        command = [sys.executable, str(LOOP), str(peer_file)]
        if spec.cluster is None:
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
            launch(command, local_ranks(spec.trainer.devices), logs, env=env, echo_to=echo_to)
        else:
            launch_on_cluster(command, spec.cluster, logs, echo_to=echo_to)
    else:
        python = horovod_venv / "bin" / "python"
        with horovod_job(python, spec.cluster, spec.trainer.devices, logs) as ranks:
            launch([str(python), str(LOOP), str(peer_file)], ranks, logs, env=dict(os.environ), echo_to=echo_to)
    summary = run_dir / "summary.json"
    if not summary.exists():
        raise RuntimeError(f"the {peer} peer finished but wrote no {summary}; see {logs}")
    (peer_file.parent / "data.npz").unlink(missing_ok=True)   # a copy of the recipe's data (tens of MB)
    return dict(json.loads(summary.read_text()))


@contextmanager
def _hostname_resolves_to_nic(profile: Any) -> Iterator[None]:
    """Work around Horovod 0.28.1 binding its process-set gloo context to the address the
    machine's *hostname* resolves to (ignoring HOROVOD_GLOO_IFACE). ``ip netns exec NS``
    bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``, so inside each emulated host
    the hostname resolves to that host's NIC address and the context travels over the
    shaped link like every other one. The files are removed afterwards."""
    from syncplane.cluster import emulator

    created = []
    try:
        for host in profile.hosts:
            folder = Path("/etc/netns") / emulator.host_namespace(host)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{host.address(0)} {socket.gethostname()}\n")
            created.append(folder)
        yield
    finally:
        for folder in created:
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def horovod_job(python: Path, profile: Any, world_size: int, log_dir: Path) -> Iterator[list[Any]]:
    """Horovod's gloo rendezvous for ``world_size`` ranks -- in the emulated cluster
    ``profile`` (server in rank 0's host, every rank in its own host), or on loopback when
    ``profile`` is None -- and the ranks to launch (``RankSpec``s with Horovod's variables)."""
    from syncplane.cluster import emulator
    from syncplane.runtime.launcher import RankSpec

    with ExitStack() as stack:
        if profile is None:
            hosts = [("localhost", "127.0.0.1", "lo", None, list(range(world_size)))]
        else:
            stack.enter_context(emulator.in_use(profile))
            stack.enter_context(emulator.background_flows(profile, log_dir))
            stack.enter_context(_hostname_resolves_to_nic(profile))
            hosts = [(h.name, h.address(0), "eth0", emulator.host_namespace(h), list(h.ranks)) for h in profile.hosts]
        server = subprocess.Popen([*emulator.netns_exec(hosts[0][3]), str(python), "-c", HOROVOD_RENDEZVOUS,
                                   ",".join(f"{name}:{len(r)}" for name, _, _, _, r in hosts), str(world_size)],
                                  stdout=subprocess.PIPE, text=True)
        stack.callback(server.kill)
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError("Horovod's rendezvous server did not start")
        ranks = []
        for index, (name, _, iface, namespace, host_ranks) in enumerate(hosts):
            for local, rank in enumerate(host_ranks):
                env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": hosts[0][1], "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
                       "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface,
                       "HOROVOD_HOSTNAME": name, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(world_size),
                       "HOROVOD_LOCAL_RANK": str(local), "HOROVOD_LOCAL_SIZE": str(len(host_ranks)),
                       "HOROVOD_CROSS_RANK": str(index), "HOROVOD_CROSS_SIZE": str(len(hosts)),
                       "HOROVOD_GLOO_TIMEOUT_SECONDS": "300",
                       "HOROVOD_LOG_LEVEL": os.environ.get("HOROVOD_LOG_LEVEL", "warning")}
                ranks.append(RankSpec(rank=rank, local_rank=local, local_world_size=len(host_ranks), node_rank=index,
                                      namespace=namespace, env=env))
        yield ranks
