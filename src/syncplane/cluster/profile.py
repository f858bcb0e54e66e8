"""Cluster profiles (the format: README, "Which strategy is fastest on *my* network?"): racks of hosts, link rates, background flows.

A rack is one switch; racks meet at one core switch through their uplinks. Ranks are
numbered rack by rack, host by host; processes on one host share its network
namespace and talk over loopback. Loaded from a shipped name (``configs/cluster/``)
or a YAML path, validated once with errors that name the field.

A ``bcube: {alpha, beta}`` key makes the profile a BCube(α, β) network (Guo et al.,
SIGCOMM 2009; Canary, paper 004 §4.4) instead: one rack of α^β hosts with β NICs each,
no core switch and no uplink, β levels of α^(β−1) switches with α ports. Host h has
the address digits ``h = Σ_ℓ d_ℓ·α^ℓ``; its NIC ℓ plugs into the level-ℓ switch picked by
its other digits, so two hosts share a switch exactly when their addresses differ in
one digit. BCube is server-centric: the others are reached through relay hosts, each
hop fixing one digit (``bcube_route``), and the emulator makes the hosts forward.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from syncplane.config import ConfigError, parse_dataclass

#: The shipped profiles: configs/cluster in a checkout, the package's copy in an installed wheel.
PROFILE_DIR = next((d for d in (Path(__file__).resolve().parents[3] / "configs" / "cluster",
                                Path(__file__).resolve().parent / "profiles") if d.is_dir()),
                   Path(__file__).resolve().parent / "profiles")
#: the hosts' TCP congestion control unless a profile names one: Linux's own default
DEFAULT_TCP_CONGESTION = "cubic"


def _positive_rates(spec: object, *fields: str) -> None:
    """Every given rate field that is set must be positive (a 0 Mbit link would hang a job)."""
    for name in fields:
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name}: must be positive, got {value}")


@dataclass
class HostSpec:
    name: str
    nic_mbit: float
    ranks: int = 1
    nics: int = 1
    per_flow_mbit: float | None = None
    # the host's compute speed relative to the others (1.0 = nominal; 0.5: a GPU half as fast):
    # its ranks' steps take (fastest speed / this) times as long (``syncplane.runtime.slowdown``)
    compute_speed: float = 1.0

    def validate(self) -> None:
        _positive_rates(self, "nic_mbit", "per_flow_mbit", "compute_speed")
        if self.ranks < 1:
            raise ConfigError(f"ranks: must be at least 1, got {self.ranks}")
        if not 1 <= self.nics <= 8:
            raise ConfigError(f"nics: must be between 1 and 8, got {self.nics}")


@dataclass
class RackSpec:
    name: str
    hosts: list[HostSpec]
    uplink_mbit: float | None = None
    per_flow_mbit: float | None = None

    def validate(self) -> None:
        if not self.hosts:
            raise ConfigError("hosts: a rack needs at least one host")
        _positive_rates(self, "uplink_mbit", "per_flow_mbit")


@dataclass
class FlowSpec:
    src: str
    dst: str
    mbit: float | None = None   # None: greedy

    def validate(self) -> None:
        _positive_rates(self, "mbit")


@dataclass
class BCubeSpec:
    """BCube(α, β): α-port switches, β levels (α^β hosts, β NICs each)."""

    alpha: int
    beta: int

    def validate(self) -> None:
        if self.alpha < 2:
            raise ConfigError(f"alpha: a BCube switch needs at least 2 ports, got {self.alpha}")
        if not 1 <= self.beta <= 8:
            raise ConfigError(f"beta: BCube levels (one NIC each) must be between 1 and 8, got {self.beta}")

    @property
    def hosts(self) -> int:
        return int(self.alpha ** self.beta)

    def digits(self, host: int) -> list[int]:
        """Host ``host``'s address digits, level 0 first."""
        return [(host // self.alpha ** level) % self.alpha for level in range(self.beta)]

    def with_digit(self, host: int, level: int, value: int) -> int:
        """The host whose address is ``host``'s with digit ``level`` set to ``value``."""
        step = self.alpha ** level
        return host + (value - (host // step) % self.alpha) * step

    def switch(self, host: int, level: int) -> int:
        """Index (within its level) of the level-``level`` switch NIC ``level`` of ``host``
        plugs into: the number formed by the host's other digits."""
        digits = self.digits(host)
        del digits[level]
        return sum(d * self.alpha ** i for i, d in enumerate(digits))

    def direct_ring(self) -> list[int]:
        """Every host, in a cyclic order whose neighbours differ in one address digit (the
        modular α-ary Gray code): a ring in this order has no relayed hop. A ring in host
        order has some, and they slow it (measured in docs/design-notes.md, "BCube: a ring in
        rank order runs at half speed through its relays")."""
        order = []
        for i in range(self.alpha ** self.beta):
            d = self.digits(i) + [0]
            order.append(sum(((d[k] - d[k + 1]) % self.alpha) * self.alpha ** k for k in range(self.beta)))
        return order

    def route(self, src: int, dst: int, level: int) -> list[tuple[int, int, int]]:
        """The hops ``(from host, to host, NIC level)`` a packet from ``src`` to ``dst``'s
        NIC ``level`` address takes: every other differing digit is fixed first (highest
        level first), digit ``level`` last, so traffic addressed to NIC ℓ arrives on NIC ℓ
        and two hosts one digit apart talk directly. Every host routes by the same rule,
        so a hop's next hop is the route of the rest (what the emulator installs)."""
        hops, here = [], src
        want = self.digits(dst)
        for lvl in [lv for lv in reversed(range(self.beta)) if lv != level] + [level]:
            if self.digits(here)[lvl] != want[lvl]:
                nxt = self.with_digit(here, lvl, want[lvl])
                hops.append((here, nxt, lvl))
                here = nxt
        return hops


@dataclass
class Host:
    """A host placed in the cluster: its index, rack, ranks and NIC addresses."""

    index: int
    rack: int
    spec: HostSpec
    first_rank: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.spec.ranks)

    def address(self, nic: int = 0) -> str:
        """NIC ``nic``'s IPv4 address, in 198.18.0.0/15 (reserved for benchmarking, RFC 2544)."""
        return f"198.18.{nic}.{self.index + 1}"


@dataclass
class ClusterProfile:
    name: str
    racks: list[RackSpec]
    background: list[FlowSpec] = field(default_factory=list)
    bcube: BCubeSpec | None = None
    #: the hosts' TCP congestion control (``emulator``: every host namespace runs it, whatever
    #: this machine's own default is); cubic is Linux's default
    tcp_congestion: str = DEFAULT_TCP_CONGESTION
    hosts: list[Host] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        rank = 0
        for r, rack in enumerate(self.racks):
            for spec in rack.hosts:
                self.hosts.append(Host(index=len(self.hosts), rack=r, spec=spec, first_rank=rank))
                rank += spec.ranks

    def validate(self) -> None:
        if not self.racks:
            raise ConfigError("racks: a profile needs at least one rack")
        if self.bcube is not None:
            self._validate_bcube(self.bcube)
        seen: set[str] = set()
        for r, rack in enumerate(self.racks):
            for name in [rack.name] + [h.name for h in rack.hosts]:
                if name in seen:
                    raise ConfigError(f"racks[{r}]: duplicate name {name!r} (rack and host names must be unique)")
                seen.add(name)
            if len(self.racks) > 1 and rack.uplink_mbit is None:
                raise ConfigError(f"racks[{r}].uplink_mbit: required when there is more than one rack")
        if len(self.hosts) > 250:
            raise ConfigError(f"racks: at most 250 hosts can be emulated, got {len(self.hosts)}")
        if not isinstance(self.tcp_congestion, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.tcp_congestion):
            raise ConfigError(f"tcp_congestion: a Linux congestion control's name (cubic, bbr, reno, ...), "
                              f"got {self.tcp_congestion!r}")
        hosts = {h.name for h in self.hosts}
        for i, flow in enumerate(self.background):
            for end in ("src", "dst"):
                if getattr(flow, end) not in hosts:
                    raise ConfigError(f"background[{i}].{end}: unknown host {getattr(flow, end)!r}; "
                                      f"hosts: {', '.join(sorted(hosts))}")
            if flow.src == flow.dst:
                raise ConfigError(f"background[{i}]: src and dst are the same host {flow.src!r}")

    def _validate_bcube(self, cube: BCubeSpec) -> None:
        """One rack, α^β hosts, β NICs on every host (NIC ℓ is the level-ℓ port)."""
        where = f"BCube({cube.alpha}, {cube.beta})"
        if len(self.racks) != 1:
            raise ConfigError(f"racks: a {where} profile has one rack (its hosts; BCube has no core switch), "
                              f"got {len(self.racks)}")
        if self.racks[0].uplink_mbit is not None:
            raise ConfigError(f"racks[0].uplink_mbit: a {where} network has no uplink (no core switch); remove it")
        if len(self.hosts) != cube.hosts:
            raise ConfigError(f"racks[0].hosts: {where} has alpha^beta = {cube.hosts} hosts, got {len(self.hosts)}")
        for h, host in enumerate(self.hosts):
            if host.spec.nics != cube.beta:
                raise ConfigError(f"racks[0].hosts[{h}].nics: every host of {where} needs beta = {cube.beta} NICs "
                                  f"(one per level), host {host.name!r} has {host.spec.nics}")

    def is_bcube(self) -> bool:
        return self.bcube is not None

    @property
    def world_size(self) -> int:
        return sum(h.spec.ranks for h in self.hosts)

    @property
    def max_ranks_per_host(self) -> int:
        """The ranks of the largest host."""
        return max(h.spec.ranks for h in self.hosts)

    @property
    def max_nics(self) -> int:
        """The most NICs a host has: the streams of a transport that opens one per NIC."""
        return max(h.spec.nics for h in self.hosts)

    @property
    def gloo_nics(self) -> int:
        """The NICs every rank lists for gloo: the fewest a host has (gloo pairs its devices
        across ranks by position), over which a process group hands out its ops and tags."""
        return min(h.spec.nics for h in self.hosts)

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping ``parse_profile`` reads back (unset optional fields left out)."""
        def plain(spec: object) -> dict[str, Any]:
            return {k: v for k, v in asdict(spec).items() if v is not None}  # type: ignore[call-overload]

        data = {"name": self.name, "racks": [plain(r) for r in self.racks],
                "background": [plain(f) for f in self.background]}
        if self.bcube is not None:
            data["bcube"] = asdict(self.bcube)
        if self.tcp_congestion != DEFAULT_TCP_CONGESTION:
            data["tcp_congestion"] = self.tcp_congestion
        return data

    def compute_speeds(self) -> list[float]:
        """Every rank's ``compute_speed`` (its host's), rank by rank."""
        return [host.spec.compute_speed for host in self.hosts for _ in host.ranks]

    def host_of_rank(self, rank: int) -> Host:
        for host in self.hosts:
            if rank in host.ranks:
                return host
        raise IndexError(f"rank {rank} is outside profile {self.name!r} ({self.world_size} ranks)")

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"profile {self.name!r} has no host {name!r}")

    def check_world_size(self, world_size: int, where: str = "trainer.devices") -> None:
        if world_size != self.world_size:
            raise ConfigError(f"{where}: {world_size} processes, but cluster profile {self.name!r} has "
                              f"{self.world_size} ranks (set {where}={self.world_size})")


def parse_profile(data: Mapping[str, Any], where: str = "cluster") -> ClusterProfile:
    """Validate a profile mapping; errors name the field (``cluster.racks[0].hosts[1].nic_mbit``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    data = dict(data)
    racks_raw = data.pop("racks", None)
    background_raw = data.pop("background", None) or []
    name = data.pop("name", None)
    bcube_raw = data.pop("bcube", None)
    tcp_congestion = data.pop("tcp_congestion", DEFAULT_TCP_CONGESTION)
    if data:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(data))}; allowed keys: background, bcube, name, "
                          "racks, tcp_congestion")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
    if not isinstance(racks_raw, list) or not racks_raw:
        raise ConfigError(f"{where}.racks: expected a non-empty list of racks")
    racks = [parse_dataclass(RackSpec, rack, f"{where}.racks[{r}]") for r, rack in enumerate(racks_raw)]
    background = [parse_dataclass(FlowSpec, f, f"{where}.background[{i}]") for i, f in enumerate(background_raw)]
    bcube = parse_dataclass(BCubeSpec, bcube_raw, f"{where}.bcube") if bcube_raw is not None else None
    profile = ClusterProfile(name=name, racks=racks, background=background, bcube=bcube,
                             tcp_congestion=tcp_congestion)
    try:
        profile.validate()
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from None
    return profile


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> ClusterProfile:
    """A shipped profile by name, or a profile YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise ConfigError(f"cluster: unknown profile {str(name_or_path)!r}; shipped profiles: "
                              f"{', '.join(shipped_profiles())} (or give a path to a YAML file)")
    elif not path.exists():
        raise ConfigError(f"cluster: no profile file at {path}")
    return parse_profile(yaml.safe_load(path.read_text()), where=f"cluster({path.name})")


def scaled(template: ClusterProfile, racks: int, hosts_per_rack: int) -> ClusterProfile:
    """A profile of ``racks × hosts_per_rack`` hosts shaped like the template's first rack
    and host (rates, ranks per host, NICs) -- for predicting scaling past this machine."""
    if template.bcube is not None:
        raise ConfigError(f"cluster {template.name!r} is a BCube network: it scales by alpha and beta (write a "
                          "profile with a larger bcube), not by racks and hosts per rack")
    if racks < 1 or hosts_per_rack < 1:
        raise ConfigError(f"scaled profile needs at least 1 rack and 1 host per rack, got {racks} x {hosts_per_rack}")
    rack0, host0 = template.racks[0], template.racks[0].hosts[0]
    uplink = rack0.uplink_mbit if rack0.uplink_mbit is not None else host0.nic_mbit * hosts_per_rack
    new_racks = [
        RackSpec(name=f"r{r}", uplink_mbit=uplink if racks > 1 else None, per_flow_mbit=rack0.per_flow_mbit,
                 hosts=[HostSpec(name=f"r{r}h{h}", nic_mbit=host0.nic_mbit, ranks=host0.ranks, nics=host0.nics,
                                 per_flow_mbit=host0.per_flow_mbit, compute_speed=host0.compute_speed)
                        for h in range(hosts_per_rack)])
        for r in range(racks)
    ]
    return ClusterProfile(name=f"{template.name}_x{racks}x{hosts_per_rack}", racks=new_racks,
                          tcp_congestion=template.tcp_congestion)
