"""Cluster profiles (the format: README, "Which strategy is fastest on *my* network?"): racks of hosts, link rates, background flows.

A rack is one switch; racks meet at one core switch through their uplinks. Ranks are
numbered rack by rack, host by host; processes on one host share its network
namespace and talk over loopback. Loaded from a shipped name (``configs/cluster/``)
or a YAML path, validated once with errors that name the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from syncplane.config import ConfigError, parse_dataclass

PROFILE_DIR = Path(__file__).resolve().parents[3] / "configs" / "cluster"


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

    def validate(self) -> None:
        _positive_rates(self, "nic_mbit", "per_flow_mbit")
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
        hosts = {h.name for h in self.hosts}
        for i, flow in enumerate(self.background):
            for end in ("src", "dst"):
                if getattr(flow, end) not in hosts:
                    raise ConfigError(f"background[{i}].{end}: unknown host {getattr(flow, end)!r}; "
                                      f"hosts: {', '.join(sorted(hosts))}")
            if flow.src == flow.dst:
                raise ConfigError(f"background[{i}]: src and dst are the same host {flow.src!r}")

    @property
    def world_size(self) -> int:
        return sum(h.spec.ranks for h in self.hosts)

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping ``parse_profile`` reads back (unset optional fields left out)."""
        def plain(spec: object) -> dict[str, Any]:
            return {k: v for k, v in asdict(spec).items() if v is not None}  # type: ignore[call-overload]

        return {"name": self.name, "racks": [plain(r) for r in self.racks],
                "background": [plain(f) for f in self.background]}

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
    if data:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(data))}; allowed keys: background, name, racks")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
    if not isinstance(racks_raw, list) or not racks_raw:
        raise ConfigError(f"{where}.racks: expected a non-empty list of racks")
    racks = [parse_dataclass(RackSpec, rack, f"{where}.racks[{r}]") for r, rack in enumerate(racks_raw)]
    background = [parse_dataclass(FlowSpec, f, f"{where}.background[{i}]") for i, f in enumerate(background_raw)]
    profile = ClusterProfile(name=name, racks=racks, background=background)
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
    if racks < 1 or hosts_per_rack < 1:
        raise ConfigError(f"scaled profile needs at least 1 rack and 1 host per rack, got {racks} x {hosts_per_rack}")
    rack0, host0 = template.racks[0], template.racks[0].hosts[0]
    uplink = rack0.uplink_mbit if rack0.uplink_mbit is not None else host0.nic_mbit * hosts_per_rack
    new_racks = [
        RackSpec(name=f"r{r}", uplink_mbit=uplink if racks > 1 else None, per_flow_mbit=rack0.per_flow_mbit,
                 hosts=[HostSpec(name=f"r{r}h{h}", nic_mbit=host0.nic_mbit, ranks=host0.ranks, nics=host0.nics,
                                 per_flow_mbit=host0.per_flow_mbit) for h in range(hosts_per_rack)])
        for r in range(racks)
    ]
    return ClusterProfile(name=f"{template.name}_x{racks}x{hosts_per_rack}", racks=new_racks)
