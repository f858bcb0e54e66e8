"""Build a cluster profile out of Linux network namespaces, with shaped links.

Layout (all inside namespaces this module owns; the root namespace is not touched):

- ``sp-switch``: one bridge per rack (``rack<r>``) and, with several racks, a core
  bridge (``core0``) joined to each rack bridge by a veth pair ``upl<r>r``/``upl<r>c``
  shaped at the rack's uplink rate in each direction;
- ``sp-h-<host>`` per host: NIC ``eth<k>`` (veth to port ``hp<i>n<k>`` on its rack
  bridge) shaped at the NIC rate in each direction, address ``198.18.<k>.<i+1>/24``
  (RFC 2544's benchmarking range); ranks on one host share it and talk over loopback.

A BCube profile has no rack bridges and no core: one bridge per switch (``b<level>s<k>``),
NIC ℓ of each host on its level-ℓ switch, and every host namespace forwards IPv4 (reverse-path
filtering off, since replies may take another relay) with a ``/32`` route to each address
it cannot reach on-link, via the next relay host of the profile's BCube route. Each
relayed hop leaves through the relay's shaped NIC, so relays pay for the traffic they carry.

Every host namespace runs the profile's TCP congestion control (``tcp_congestion``, default
cubic, Linux's own default), not the one it would inherit from this machine's root namespace:
this VM image sets bbr. Where bulk traffic crosses a shaped link both ways, or meets a greedy
flow there, the choice moves a step by 10–40 % either way (``docs/design-notes.md``), so a measurement would otherwise depend on
a setting of the machine that nobody recorded. A namespace may only pick an algorithm the kernel's allowed list holds
(``net.ipv4.tcp_allowed_congestion_control``, global): the profile's is added to it if missing,
the one change this module makes outside its namespaces.

Shaping is ``tbf`` per direction, or ``htb`` with 4,096 per-flow classes selected by
both TCP ports (mod 64 each, through ``u32`` hash tables) when ``per_flow_mbit`` caps
each flow (a WAN path where one stream cannot fill the pipe). ``down`` deletes every namespace whose name
starts with ``sp-`` (killing what runs inside first), so it cleans up after a crash too.
``$SYNCPLANE_EMULATOR_PREFIX`` replaces ``sp-`` in every name (and gives the cluster its own
state and lock file): the test suite builds its clusters under a prefix of its own, so it
never tears down a user's cluster or another suite's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from syncplane.cluster.profile import DEFAULT_TCP_CONGESTION, ClusterProfile, Host

log = logging.getLogger(__name__)

NS_PREFIX = "sp-"
#: the root namespace's TCP settings (read and written by this process, which runs in it)
SYSCTL_TCP = Path("/proc/sys/net/ipv4")
#: Another prefix gives a cluster of its own (namespaces, state and lock), e.g. one per test
#: run: ``down`` then removes only that prefix's namespaces and never a user's ``sp-`` cluster.
PREFIX_ENV = "SYNCPLANE_EMULATOR_PREFIX"
RUN_DIR = Path("/run/syncplane")
FLOW_PORT = 5201


class EmulationError(RuntimeError):
    """The emulator cannot run here, or a command it ran failed (the message says which)."""


def ns_prefix() -> str:
    """The namespace prefix of this process's emulated cluster (``$SYNCPLANE_EMULATOR_PREFIX``,
    default ``sp-``); read at every call, so child processes and tools agree through the env."""
    prefix = os.environ.get(PREFIX_ENV, NS_PREFIX)
    if not re.fullmatch(r"[a-z][a-z0-9]{0,15}-", prefix):
        raise EmulationError(f"{PREFIX_ENV}={prefix!r}: expected a lowercase name of at most 16 letters "
                             "or digits followed by '-' (e.g. 'spt42-')")
    return prefix


def switch_namespace() -> str:
    return f"{ns_prefix()}switch"


def _state_file() -> Path:
    return RUN_DIR / f"emulator-{ns_prefix()[:-1]}.json"


def _lock_file() -> Path:
    return RUN_DIR / f"emulator-{ns_prefix()[:-1]}.lock"


def host_namespace(host: Host | str) -> str:
    return f"{ns_prefix()}h-{host if isinstance(host, str) else host.name}"


def require_support() -> None:
    """Raise EmulationError unless this process can build namespaces and shape links."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationError(f"cluster emulation needs {' and '.join(missing)} (Debian package iproute2)")
    if os.geteuid() != 0:
        raise EmulationError("cluster emulation needs root (network namespaces and tc); run as root")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise EmulationError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _ns(ns: str, *args: str) -> None:
    _run("ip", "netns", "exec", ns, *args)


def _burst_bytes(mbit: float) -> int:
    return max(64 * 1024, int(mbit * 1e6 / 8 / 100))


PORT_BUCKETS = 64      # a capped link's flows are told apart by port mod 64, on both ends


def per_flow_commands(dev: str, mbit: float, per_flow_mbit: float) -> list[str]:
    """``tc -batch`` lines for a link capped at ``mbit`` whose TCP flows are each capped at
    ``per_flow_mbit``: htb with one class per (source port mod 64, destination port mod 64)
    -- 4,096 classes -- and u32 filters that find it, a hash table per source-port bucket
    linking into one keyed on the destination port.
    Why both ports: an accepting socket sends from its listening port, so gloo's accepted
    connections (and any server's) all share a source port; hashing that alone put them in
    one class, capping several flows as one. Why a class per pair of buckets, not 64 classes
    picked by ``src XOR dst``: flows that share a class share one cap, and a few dozen flows
    in 64 classes collide often, so a round waits on flows at a fraction of the cap -- a cap
    no WAN imposes (``docs/design-notes.md``).
    (u32 is the classifier this kernel has: ``cls_flow``, which hashes the 5-tuple directly,
    is not built, nor is ``fq``'s per-flow ``maxrate``.) Offsets assume a 20-byte IP header:
    the ports are the word at 20."""
    tc = f"dev {dev} parent 1: prio 1 protocol ip"
    lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {mbit}mbit ceil {mbit}mbit",
             f"class add dev {dev} parent 1:1 classid 1:2 htb rate {per_flow_mbit}mbit ceil {mbit}mbit"]  # non-TCP
    lines += [f"class add dev {dev} parent 1:1 classid 1:{_flow_class(i, j):x} htb rate {per_flow_mbit}mbit "
              f"ceil {per_flow_mbit}mbit" for i in range(PORT_BUCKETS) for j in range(PORT_BUCKETS)]
    lines.append(f"filter add {tc} handle 2: u32 divisor {PORT_BUCKETS}")
    for i in range(PORT_BUCKETS):            # one table per source-port bucket: 3:, 4:, ...
        lines.append(f"filter add {tc} handle {3 + i:x}: u32 divisor {PORT_BUCKETS}")
        lines += [f"filter add {tc} u32 ht {3 + i:x}:{j:x}: match ip protocol 6 0xff flowid 1:{_flow_class(i, j):x}"
                  for j in range(PORT_BUCKETS)]
        lines.append(f"filter add {tc} u32 ht 2:{i:x}: match ip protocol 6 0xff "
                     f"hashkey mask 0x0000003f at 20 link {3 + i:x}:")          # destination port
    lines.append(f"filter add {tc} u32 ht 800:: match ip protocol 6 0xff hashkey mask 0x003f0000 at 20 link 2:")
    return lines


def _flow_class(src_bucket: int, dst_bucket: int) -> int:
    """htb minor id of the flows whose ports fall in these buckets (0x1000..0x1fff)."""
    return 0x1000 + src_bucket * PORT_BUCKETS + dst_bucket


def shape(ns: str, dev: str, mbit: float, per_flow_mbit: float | None = None) -> None:
    """Egress of ``dev`` in ``ns`` at ``mbit``; with ``per_flow_mbit`` each TCP flow is capped too."""
    if per_flow_mbit is None or per_flow_mbit >= mbit:
        _ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
            "burst", str(_burst_bytes(mbit)), "latency", "100ms")
        return
    batch = subprocess.run(["ip", "netns", "exec", ns, "tc", "-batch", "-"], capture_output=True, text=True,
                           input="\n".join(per_flow_commands(dev, mbit, per_flow_mbit)) + "\n")
    if batch.returncode != 0:
        raise EmulationError(f"shaping {dev} in {ns} with per-flow caps failed: "
                             f"{batch.stderr.strip() or batch.stdout.strip()}")


def namespaces() -> list[str]:
    listed = _run("ip", "netns", "list").stdout.split("\n")
    prefix = ns_prefix()
    return sorted(line.split()[0] for line in listed if line.strip().startswith(prefix))


@contextmanager
def _exclusive() -> Iterator[None]:
    """Changing the cluster while a job runs on it would kill the job: refuse instead."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(_lock_file(), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EmulationError("the emulated cluster is in use by a running job (train.py or syncplane bench); "
                                 "wait for it to finish, or stop it first") from None
        yield


@contextmanager
def in_use(profile: ClusterProfile) -> Iterator[None]:
    """Bring ``profile`` up if needed and hold it (shared) while a job runs on it."""
    require_support()
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(_lock_file(), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not is_up(profile):
                _up(profile)
            fcntl.flock(lock, fcntl.LOCK_SH)          # let other jobs share it, keep up/down out
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_SH)          # another job holds it: share if it is ours
            if not is_up(profile):
                raise EmulationError(f"another job is running on a different emulated cluster; cannot bring "
                                     f"{profile.name!r} up now") from None
        yield


def down() -> list[str]:
    """Remove every namespace this module owns (and what runs in them). Idempotent."""
    require_support()
    with _exclusive():
        return _down()


def _down() -> list[str]:
    removed = []
    for ns in namespaces():
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    _state_file().unlink(missing_ok=True)
    return removed


def status() -> dict[str, Any]:
    """What is up: the profile recorded at ``up`` (its name, and its TCP congestion control)
    and the namespaces that exist now."""
    state = _state()
    spec = state.get("spec")         # None: nothing up, or built before the spec was kept
    return {"profile": state.get("profile"),
            "tcp_congestion": spec.get("tcp_congestion", DEFAULT_TCP_CONGESTION) if spec is not None else None,
            "namespaces": namespaces() if os.geteuid() == 0 else []}


def _state() -> dict[str, Any]:
    """What ``up`` recorded (``{}``: nothing)."""
    state_file = _state_file()
    return json.loads(state_file.read_text()) if state_file.exists() else {}


def left_up() -> dict[str, Any] | None:
    """The emulated cluster a command leaves behind, or None: it stays up after ``train.py
    cluster=...``, ``bench``, ``compare`` and ``chaos`` on purpose (the next run on the same
    profile reuses it instead of rebuilding it), and those commands say so at their end with
    this (``docs/cluster-profiles.md``): its profile, its namespaces, and the command that
    removes it (under a prefix of its own, with that prefix)."""
    try:
        found = namespaces()
    except (EmulationError, OSError):
        return None
    if not found:
        return None
    profile = _state().get("profile")
    prefix = ns_prefix()
    remove = ("" if prefix == NS_PREFIX else f"{PREFIX_ENV}={prefix} ") + "syncplane emulate down"
    return {"profile": profile, "namespaces": len(found), "prefix": prefix, "remove_with": remove}


def left_up_line(state: dict[str, Any]) -> str:
    """``left_up()`` in one line, for the end of a command's output."""
    name = f" {state['profile']!r}" if state["profile"] else ""
    return (f"syncplane: the emulated cluster{name} is still up ({state['namespaces']} network namespaces "
            f"{state['prefix']}*), kept for the next run on it; remove it with: {state['remove_with']}")


@contextmanager
def say_if_left_up(used: bool, file: Any = None) -> Iterator[None]:
    """Around a command that ran on an emulated cluster (``used``): at its end, finished or
    failed, print ``left_up_line`` when the cluster is still up (a ``netdown`` chaos run
    takes it down itself: then nothing is said)."""
    try:
        yield
    finally:
        state = left_up() if used else None
        if state is not None:
            print(left_up_line(state), file=file or sys.stdout, flush=True)


def up(profile: ClusterProfile) -> None:
    """Build ``profile`` (tearing down whatever emulated cluster was up before)."""
    require_support()
    with _exclusive():
        _up(profile)


def _up(profile: ClusterProfile) -> None:
    _down()
    allow_congestion(profile.tcp_congestion)
    try:
        _build(profile)
    except Exception:
        _down()
        raise
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    _state_file().write_text(json.dumps({"profile": profile.name, "hosts": [h.name for h in profile.hosts],
                                         "spec": profile.to_dict()}))


def allow_congestion(name: str, sysctl: Path = SYSCTL_TCP) -> None:
    """Let a host namespace pick the congestion control ``name``: add it to the kernel's
    allowed list if missing (the module docstring); an algorithm this kernel does not offer
    is a clear error, before anything is built."""
    available = (sysctl / "tcp_available_congestion_control").read_text().split()
    if name not in available:
        raise EmulationError(f"tcp_congestion: this kernel offers {', '.join(available)}, not {name!r} "
                             f"(load its module, tcp_{name}, or name one of those in the profile)")
    allowed_file = sysctl / "tcp_allowed_congestion_control"
    allowed = allowed_file.read_text().split()
    if name not in allowed:
        allowed_file.write_text(" ".join([*allowed, name]) + "\n")
        log.info("added %s to net.ipv4.tcp_allowed_congestion_control (was: %s) so the emulated hosts may run it",
                 name, " ".join(allowed))


def _build(profile: ClusterProfile) -> None:
    switch = switch_namespace()
    _run("ip", "netns", "add", switch)
    _ns(switch, "ip", "link", "set", "lo", "up")
    if profile.bcube is not None:
        _build_bcube(profile, switch)
        return
    multi_rack = len(profile.racks) > 1
    if multi_rack:
        _ns(switch, "ip", "link", "add", "core0", "type", "bridge")
        _ns(switch, "ip", "link", "set", "core0", "up")
    for r, rack in enumerate(profile.racks):
        bridge = f"rack{r}"
        _ns(switch, "ip", "link", "add", bridge, "type", "bridge")
        _ns(switch, "ip", "link", "set", bridge, "up")
        if multi_rack:
            rack_end, core_end = f"upl{r}r", f"upl{r}c"
            _ns(switch, "ip", "link", "add", rack_end, "type", "veth", "peer", "name", core_end)
            _ns(switch, "ip", "link", "set", rack_end, "master", bridge, "up")
            _ns(switch, "ip", "link", "set", core_end, "master", "core0", "up")
            assert rack.uplink_mbit is not None
            shape(switch, rack_end, rack.uplink_mbit, rack.per_flow_mbit)   # rack -> core
            shape(switch, core_end, rack.uplink_mbit, rack.per_flow_mbit)   # core -> rack
    for host in profile.hosts:
        _add_host(host, switch, [f"rack{host.rack}"] * host.spec.nics, profile.tcp_congestion)


def _add_host(host: Host, switch: str, bridges: list[str], congestion: str) -> str:
    """The host's namespace with NIC k on ``bridges[k]``, both directions shaped, its TCP
    under the ``congestion`` control."""
    ns = host_namespace(host)
    _run("ip", "netns", "add", ns)
    _ns(ns, "ip", "link", "set", "lo", "up")
    _ns(ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={congestion}")
    if len(bridges) > 1:
        # Linux answers ARP for any of its addresses on every interface ("ARP flux"): with two
        # NICs on one switch, a peer learns one NIC's MAC for both addresses and all inbound
        # traffic squeezes through that NIC's shaped port -- each of two streams then gets
        # half a NIC. Answer only for the address of the NIC asked, and announce from it.
        _ns(ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1", "net.ipv4.conf.all.arp_announce=2")
    for k, bridge in enumerate(bridges):
        port = f"hp{host.index}n{k}"
        _run("ip", "link", "add", f"eth{k}", "netns", ns, "type", "veth", "peer", "name", port,
             "netns", switch)
        _ns(switch, "ip", "link", "set", port, "master", bridge, "up")
        _ns(ns, "ip", "addr", "add", f"{host.address(k)}/24", "dev", f"eth{k}")
        _ns(ns, "ip", "link", "set", f"eth{k}", "up")
        shape(ns, f"eth{k}", host.spec.nic_mbit, host.spec.per_flow_mbit)          # host -> switch
        shape(switch, port, host.spec.nic_mbit, host.spec.per_flow_mbit)       # switch -> host
    return ns


def bcube_routes(profile: ClusterProfile, host: Host) -> list[tuple[str, str, str]]:
    """``(destination address, gateway address, device)`` for every address ``host`` reaches
    through a relay: the first hop of the profile's BCube route to it (the relay's address
    on the NIC of that hop's level)."""
    cube = profile.bcube
    assert cube is not None
    routes = []
    for other in profile.hosts:
        if other.index == host.index:
            continue
        for level in range(cube.beta):
            first = cube.route(host.index, other.index, level)[0]
            if first[1] == other.index and first[2] == level:
                continue                                        # on-link: same level-ℓ switch
            relay = profile.hosts[first[1]]
            routes.append((other.address(level), relay.address(first[2]), f"eth{first[2]}"))
    return routes


def _build_bcube(profile: ClusterProfile, switch: str) -> None:
    cube = profile.bcube
    assert cube is not None
    for level in range(cube.beta):
        for k in range(cube.hosts // cube.alpha):
            _ns(switch, "ip", "link", "add", f"b{level}s{k}", "type", "bridge")
            _ns(switch, "ip", "link", "set", f"b{level}s{k}", "up")
    for host in profile.hosts:
        ns = _add_host(host, switch, [f"b{level}s{cube.switch(host.index, level)}" for level in range(cube.beta)],
                       profile.tcp_congestion)
        # a relay forwards; replies may come back through another relay than the request went
        _ns(ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        for dev in ("all", "default", *(f"eth{k}" for k in range(cube.beta))):
            _ns(ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.rp_filter=0")
        batch = "".join(f"route add {dst}/32 via {gateway} dev {dev} onlink\n"
                        for dst, gateway, dev in bcube_routes(profile, host))
        result = subprocess.run(["ip", "netns", "exec", ns, "ip", "-batch", "-"], capture_output=True, text=True,
                                input=batch)
        if result.returncode != 0:
            raise EmulationError(f"routing {host.name} through its BCube relays failed: "
                                 f"{result.stderr.strip() or result.stdout.strip()}")


def is_up(profile: ClusterProfile) -> bool:
    """Whether ``profile`` as it is now is up: the same name is not enough, a profile edited
    since (a rate, its congestion control) is built again."""
    current = status()
    wanted = {switch_namespace(), *(host_namespace(h) for h in profile.hosts)}
    same = _state().get("spec") == json.loads(json.dumps(profile.to_dict()))
    return current["profile"] == profile.name and same and wanted <= set(current["namespaces"])


def parse_root_drops(tc_stats: str) -> dict[str, int]:
    """Packets each shaped device's root qdisc (``tbf`` or ``htb``: what ``shape`` adds)
    dropped, from ``tc -s qdisc show`` output (a root ``htb`` counts its classes' drops, so
    child qdiscs are skipped: no double count)."""
    drops: dict[str, int] = {}
    device = None
    for line in tc_stats.splitlines():
        head = re.match(r"qdisc (\S+) \S+ dev (\S+) (root|parent)", line)
        if head:
            device = head.group(2) if head.group(3) == "root" and head.group(1) in ("tbf", "htb") else None
            continue
        sent = re.search(r"\(dropped (\d+),", line)
        if sent and device is not None:
            drops[device] = drops.get(device, 0) + int(sent.group(1))
            device = None
    return drops


def switch_drops(namespace: str) -> dict[str, int]:
    """Packets dropped so far by each shaped port of the switch namespace ``namespace``
    (``upl<r>r``/``upl<r>c``: a rack's uplink, each direction; ``hp<i>n<k>``: towards a
    host's NIC), from the kernel's qdisc counters (``tc -s``). Given the namespace as an
    argument so that a process inside a host's namespace can ask too (the bench's rank 0)."""
    return parse_root_drops(_run("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show").stdout)


def uplink_drops(drops: dict[str, int]) -> int | None:
    """The rack uplinks' share of ``switch_drops`` (None: the profile has no uplinks)."""
    uplinks = [n for dev, n in drops.items() if dev.startswith("upl")]
    return sum(uplinks) if uplinks else None


# --------------------------------------------------------------------------- ranks


def netns_exec(namespace: str | None) -> list[str]:
    """Command prefix that runs a process inside ``namespace`` (none: on this host)."""
    return ["ip", "netns", "exec", namespace] if namespace else []


def rank_namespace(profile: ClusterProfile, rank: int) -> str:
    """The network namespace of ``rank``'s host."""
    return host_namespace(profile.host_of_rank(rank))


def rank_prefix(profile: ClusterProfile, rank: int) -> list[str]:
    """Command prefix that runs a process inside ``rank``'s host."""
    return netns_exec(rank_namespace(profile, rank))


def rank_env(profile: ClusterProfile, rank: int) -> dict[str, str]:
    """gloo (and RPC) bound to the host's NICs.

    gloo pairs its devices across ranks by position, so every rank must list the same
    number: the fewest NICs any host has. (Groups bound to one particular NIC are built
    explicitly by the strategies that stripe traffic over NICs.)
    """
    return {"GLOO_SOCKET_IFNAME": ",".join(f"eth{k}" for k in range(profile.gloo_nics)), "TP_SOCKET_IFNAME": "eth0"}


def master_addr(profile: ClusterProfile) -> str:
    return profile.hosts[0].address(0)


# --------------------------------------------------------------------------- background traffic


@contextmanager
def background_flows(profile: ClusterProfile, log_dir: Path | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run the profile's background TCP flows for the duration of the block."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    if log_dir is not None and profile.background:
        log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for i, flow in enumerate(profile.background):
            src, dst = profile.host(flow.src), profile.host(flow.dst)
            port = str(FLOW_PORT + i)
            out: Any = subprocess.DEVNULL
            if log_dir is not None:
                out = open(log_dir / f"background{i}.log", "wb")
                logs.append(out)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", host_namespace(dst), sys.executable, "-m", "syncplane.cluster.flows",
                 "serve", dst.address(0), port], stdout=out, stderr=subprocess.STDOUT))
            cmd = ["ip", "netns", "exec", host_namespace(src), sys.executable, "-m", "syncplane.cluster.flows",
                   "send", dst.address(0), port]
            if flow.mbit is not None:
                cmd += ["--mbit", str(flow.mbit)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        if procs:
            time.sleep(1.0)   # let the flows reach their steady rate before the job measures anything
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise EmulationError(f"a background flow exited at start (code {dead[0].returncode})")
        yield procs
    finally:
        for p in procs:           # SIGTERM first: each flow then logs the bytes it moved
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
