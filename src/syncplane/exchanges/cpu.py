"""The CPU side of an exchange: encoding, decoding and summing pieces, priced per element.

The α-β model (``syncplane.cluster.cost``) prices the wire only. An exchange that carries a
codec also encodes what it sends and decodes what it receives, and every reducing exchange
sums the pieces it receives; on a small payload or a fast wire that CPU work is the step
(DiLoCo's sparse gather of a 5 MB model on ``wan_two_sites``: 0.011 s per step measured
against 0.001 s of wire). Here it is priced as ``CpuWork`` -- how many fp32 elements one
rank passes through each operation in one round, on the round's critical path -- times
``CpuRates`` -- seconds per element of each operation, **measured on this machine** by
``calibrate`` (a micro-benchmark of the codecs' own kernels, or of a routine's own run where a
``CpuWork`` brings a timer for it, cached per machine and torch version), never written down
for one machine.

Operations: ``ADD`` (``a += b`` of fp32, the unit of a sum, a copy or an optimizer pass)
and, per codec (``codec_key``), ``encode:<codec>@<elements>`` (``compress``) and ``decode:<codec>@<elements>``
(``extract``; the sparse codec's ``decode_add`` into a dense buffer, per dense element).
An exact fp32 codec costs no encode or decode. ``CpuRates.sharing`` is how many ranks run
their CPU work at once per core: on the emulator every rank shares this machine's cores
(world size over cores), on a real cluster a rank has its own (1).

One rate is no CPU work but a capacity, kept here because it is measured and cached the same
way: ``loopback_op`` -- seconds per fp32 element through a host's loopback, all of its ranks'
flows together, while that many ranks all-reduce on it (``CpuRates.loopback_bytes_per_s``:
what the cost model's loopback links carry on this machine).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from syncplane.comm.buckets import DEFAULT_BUCKET_BYTES
from syncplane.comm.codecs import Codec, Fp32

log = logging.getLogger(__name__)

#: fp32 adds are timed on 64 MiB, past the last-level cache as a model's buffers are: on 4 MiB
#: (this 2-core EPYC's L3 holds 32 MiB) an add ran 3x faster than on ResNet-50's 97.5 MB (0.095
#: against 0.31 ns per element, 2026-11-29). The op's name carries the size, so a rate timed on
#: another size is never read for it.
ADD_ELEMENTS = 1 << 24
ADD = f"add@{ADD_ELEMENTS}"
DEFAULT_CACHE = Path.home() / ".cache" / "syncplane" / "cpu_rates.json"
#: a codec's encode and decode are timed on 32 MiB of fp32, past the L3 with their output and
#: the dense buffer beside: Canary's sketch decoded 4x slower on 8 Mi elements than on 1 Mi
#: (2.27 against 0.56 ns per element, 2026-11-29), where a payload's pieces are. Their ops'
#: names carry the size too.
CALIBRATION_ELEMENTS = 1 << 23


#: the loopback is timed on this many fp32 elements per rank: four of DDP's buckets, past the
#: L3 as a payload is
LOOPBACK_ELEMENTS = 4 * DEFAULT_BUCKET_BYTES // 4
#: the largest group a host's loopback is timed with
LOOPBACK_MAX_RANKS = 8


def loopback_op(ranks: int) -> str:
    """The op whose rate is a host's loopback, timed with ``ranks`` ranks on it (module doc)."""
    return f"loopback@{LOOPBACK_ELEMENTS}x{ranks}"


def loopback_ranks(ranks_per_host: int) -> int:
    """The group a host of ``ranks_per_host`` ranks has its loopback timed with."""
    return max(2, min(ranks_per_host, LOOPBACK_MAX_RANKS))


def codec_key(codec: Codec) -> str:
    """The codec with its settings (``ChunkedTopK(density=0.01, bits=2, chunk=4096)``): what
    its rates are measured and cached under (the sparse codec's cost depends on its density)."""
    return repr(codec)


def encode_op(codec: Codec) -> str:
    return f"encode:{codec_key(codec)}@{CALIBRATION_ELEMENTS}"


def decode_op(codec: Codec) -> str:
    return f"decode:{codec_key(codec)}@{CALIBRATION_ELEMENTS}"


#: times an operation that is not a codec's on ``numel`` elements; returns seconds per element
Timer = Callable[[int], float]


@dataclass(frozen=True)
class CpuWork:
    """One rank's CPU work in one round: op name -> fp32 elements through it (``elements``),
    the codecs those ops name (``codecs``, by ``codec_key``: what ``calibrate`` measures), and
    for ops that are no codec's -- a whole library routine, such as torch's DDP with a comm
    hook -- how to time them (``timers``, by op name)."""

    elements: Counter[str] = field(default_factory=Counter)
    codecs: Mapping[str, Codec] = field(default_factory=dict)
    timers: Mapping[str, Timer] = field(default_factory=dict)

    def __add__(self, other: CpuWork) -> CpuWork:
        return CpuWork(self.elements + other.elements, {**self.codecs, **other.codecs},
                       {**self.timers, **other.timers})

    @staticmethod
    def adds(elements: float) -> CpuWork:
        """``elements`` fp32 adds (or copies: the same pass over memory)."""
        return CpuWork(Counter({ADD: elements}))


def coded(codec: Codec, encoded: float = 0.0, decoded: float = 0.0) -> CpuWork:
    """``encoded`` elements through ``codec``'s encoder and ``decoded`` through its decoder
    (nothing for exact fp32, whose pieces travel as they are)."""
    if isinstance(codec, Fp32):
        return CpuWork()
    return CpuWork(Counter({encode_op(codec): encoded, decode_op(codec): decoded}), {codec_key(codec): codec})


def feedback_encoded(codec: Codec, elements: float) -> CpuWork:
    """``ErrorFeedback.compress`` of ``elements`` in a runner's round: the residuals saved (the
    round's ``Undo``), the residual added, encoded, what was sent decoded and subtracted (three
    adds, one encode, one decode)."""
    if isinstance(codec, Fp32):
        return CpuWork()
    return coded(codec, elements, elements) + CpuWork.adds(3 * elements)


@dataclass(frozen=True)
class CpuRates:
    """Seconds per element of each operation (``per_element``), and how many ranks share a
    core while they run it (``sharing``, module doc)."""

    per_element: Mapping[str, float] = field(default_factory=dict)
    sharing: float = 1.0

    def seconds(self, work: CpuWork) -> float:
        """One rank's time for ``work``; an operation without a rate is a KeyError naming it."""
        elements = work.elements
        missing = sorted(op for op, n in elements.items() if n and op not in self.per_element)
        if missing:
            raise KeyError(f"no CPU rate for {', '.join(missing)}; measured: {', '.join(sorted(self.per_element))} "
                           "(calibrate with the codecs the strategy carries)")
        return max(1.0, self.sharing) * sum(n * self.per_element[op] for op, n in elements.items() if n)

    def shared(self, sharing: float) -> CpuRates:
        return CpuRates(dict(self.per_element), sharing)

    def loopback_bytes_per_s(self, ranks_per_host: int) -> float | None:
        """A host's loopback capacity with ``ranks_per_host`` ranks on it (``loopback_op``), or
        None where it was not measured."""
        seconds = self.per_element.get(loopback_op(loopback_ranks(ranks_per_host)))
        return 4.0 / seconds if seconds else None


def _min_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs after one warm-up (others' load only slows a run down)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(codecs: Iterable[Codec], numel: int = CALIBRATION_ELEMENTS, repeats: int = 5,
            add: bool = True) -> dict[str, float]:
    """Seconds per element of ``ADD`` (on ``ADD_ELEMENTS``, unless ``add`` is False) and of
    each lossy codec's encode and decode (on ``numel``), on one thread (a bench worker's and a
    training rank's setting), on Gaussian values."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        rates: dict[str, float] = {}
        if add:
            big, big_acc = torch.randn(ADD_ELEMENTS, generator=generator), torch.zeros(ADD_ELEMENTS)
            rates[ADD] = _min_seconds(lambda: big_acc.add_(big), repeats) / ADD_ELEMENTS
            del big, big_acc
        x = torch.randn(numel, generator=generator)
        acc = torch.zeros(numel)
        for codec in codecs:
            if isinstance(codec, Fp32):
                continue
            data = codec.compress(x)     # into a buffer kept between runs, as the exchanges encode
            rates[encode_op(codec)] = _min_seconds(lambda: codec.compress(x, out=data), repeats) / numel
            decode_add = getattr(codec, "decode_add", None)     # what the gather runs: into a dense buffer
            if decode_add is not None:
                decode: Callable[[], object] = lambda: decode_add([data], acc)
            else:
                decode = lambda: codec.extract(data, numel)  # noqa: E731
            rates[decode_op(codec)] = _min_seconds(decode, repeats) / numel
        return rates
    finally:
        torch.set_num_threads(threads)


def cpu_model() -> str:
    """This machine's processor as the kernel names it (``/proc/cpuinfo``), else Python's guess."""
    cpuinfo = Path("/proc/cpuinfo")
    names = (line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")) if cpuinfo.exists() else iter(())
    return next(names, None) or platform.processor() or platform.machine()


def machine_key() -> str:
    """What a cached rate belongs to: this host, its processor and core count, the torch build
    and the build of our kernels (named after a hash of their sources: an edited codec is
    measured again). The processor by name: two machines with one host name (a VM's image)
    once shared a cache whose rates differed by 1.5x."""
    from syncplane import ext

    return (f"{platform.node()}|{platform.machine()}|{cpu_model()}|{len(os.sched_getaffinity(0))} cores"
            f"|torch {torch.__version__}|{ext.cpu_build_name() if ext.cannot_compile('cpu') is None else 'reference'}")


def calibrate(work: CpuWork = CpuWork(), cache: Path | None = DEFAULT_CACHE, sharing: float = 1.0,
              numel: int = CALIBRATION_ELEMENTS) -> CpuRates:
    """``CpuRates`` for ``add``, the codecs ``work`` names and its timed ops, on this machine:
    read from ``cache`` (a JSON file, one entry per ``machine_key``) where measured before,
    else measured now (about a second per codec or timer) and written back. ``cache=None`` measures
    without keeping. Codecs are measured on ``numel`` elements; a timed op on the elements
    ``work`` passes through it (``numel`` where none: a routine's cost per element may depend
    on its size, so its op's name should carry the size it stands for)."""
    codecs = list(work.codecs.values())
    wanted = {ADD, *(op for c in codecs if not isinstance(c, Fp32) for op in (encode_op(c), decode_op(c))),
              *work.timers}
    stored: dict[str, dict[str, float]] = {}
    if cache is not None and cache.exists():
        try:
            stored = json.loads(cache.read_text())
        except (OSError, ValueError) as exc:       # a broken cache is measured again, never fatal
            log.warning("cpu rates: ignoring unreadable cache %s (%s)", cache, exc)
    mine = dict(stored.get(machine_key(), {}))
    todo = [c for c in codecs if not isinstance(c, Fp32) and encode_op(c) not in mine]
    timed = [op for op in work.timers if op not in mine]
    if ADD not in mine or todo or timed:
        measured = measure(todo, numel, add=ADD not in mine)
        measured.update({op: work.timers[op](int(work.elements[op]) or numel) for op in timed})
        log.info("cpu rates: measured %s", ", ".join(f"{op} {s * 1e9:.2f} ns/elem" for op, s in measured.items()))
        mine.update(measured)
        if cache is not None:
            stored[machine_key()] = mine
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(stored, indent=1, sort_keys=True))
    return CpuRates({op: mine[op] for op in sorted(wanted)}, sharing)


def runner_work(elements: float) -> CpuWork:
    """What ``StreamRunner.allreduce_mean_`` adds around an exchange that returns its mean as
    values (the gather's, the tree's): the copy of the result. The mesh and digit exchanges
    decode into the caller's buffer once committed (``streams.Result``): no copy. The
    residuals saved to undo a discarded round are the exchange's: ``feedback_encoded``."""
    return CpuWork.adds(elements)
