"""DS-Sync: divide-and-shuffle group averaging (Wang et al., arXiv:2007.03298).

Files: ``pattern.py`` (intra-rack groups, rotating representatives, slow-member splits:
the group pattern and its candidates), ``engine.py`` (``DSSync``: schedule position, process
groups, the contention adjustment), ``pair_streams.py`` (how many TCP connections a pair
swaps over, chosen by a trial), ``runtime.py`` (the runtime for a detected topology),
``config.py`` (the validated settings), ``cost.py``, ``bench.py``. Glue: ``strategies/ds_sync.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from syncplane.algorithms.ds_sync.bench import DSSyncStep
from syncplane.algorithms.ds_sync.cost import CLIQUE, ds_sync_steps
from syncplane.algorithms.ds_sync.pair_streams import MAX_PAIR_STREAMS, check_pair_streams, choose_pair_streams, connections
from syncplane.algorithms.spec import AlgorithmSpec
from syncplane.cluster.probe import from_profile
from syncplane.cluster.profile import load_profile
from syncplane.config import ConfigError
from syncplane.job import JobContext


def _check_job(name: str, kwargs: Mapping[str, Any], job: JobContext) -> None:
    """A profile the job names (``topology``) must load and have the job's ranks."""
    topology = kwargs.get("topology", "auto")
    if topology not in ("auto", "probe"):
        try:
            from_profile(load_profile(topology), job.world_size)
        except ConfigError as exc:
            raise ConfigError(f"topology={topology!r}: {exc}") from None


def _pattern(options: Mapping[str, Any]) -> str:
    """``clique`` with ``max_staleness`` (the late-peer exchange), else the group all-reduce."""
    return CLIQUE if int(options.get("max_staleness") or 0) > 0 else "auto"


def _streams(options: Mapping[str, Any]) -> int:
    """A pair's connections: one under ``max_staleness``, else ``pair_streams``'s (``auto``:
    the most; ``_trial`` prices what its trial settles on)."""
    return 1 if _pattern(options) == CLIQUE else connections(options.get("pair_streams", "auto"))


def _trial(options: Mapping[str, Any], price: Callable[[Mapping[str, Any]], list[float]]) -> Mapping[str, Any]:
    """``pair_streams: auto`` settles on one stream or ``MAX_PAIR_STREAMS`` by the trial's own
    rule (``choose_pair_streams``: the speed-up of the timed syncs in all) applied to the prices of
    the steps it times, those with a pair -- the steps whose price the stream count changes:
    on a link of its own one stream is the faster, next to foreign traffic several take a
    larger share."""
    if _pattern(options) == CLIQUE or check_pair_streams(options.get("pair_streams", "auto")) != "auto":
        return options
    one, many = ({**options, "pair_streams": n} for n in (1, MAX_PAIR_STREAMS))
    timed = [(a, b) for a, b in zip(price(one), price(many)) if a != b]
    kept = choose_pair_streams([a for a, _ in timed], [b for _, b in timed], MAX_PAIR_STREAMS)
    return many if kept > 1 else one


def _step(name: str, options: Mapping[str, Any], job: JobContext) -> DSSyncStep:
    return DSSyncStep(options, job)


SPEC = AlgorithmSpec(
    family="ds_sync",
    strategies={"ds_sync": "DS-Sync: concurrent topology-aware group averaging, groups reshuffled every step"},
    bench_step=_step,
    cost=ds_sync_steps,
    streams=_streams,
    pattern=_pattern,
    check_job=_check_job,
    trial=_trial,
    variants={"ds_sync": tuple({"pair_streams": s} for s in (1, 2, MAX_PAIR_STREAMS))},
)
