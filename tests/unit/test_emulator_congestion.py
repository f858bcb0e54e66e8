"""The emulated hosts' TCP congestion control: the profile's, allowed by the kernel before
anything is built, and a cluster built under another one is not reused. The sysctl files and
the namespaces are faked here; ``tests/cluster/test_emulator.py`` checks real namespaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncplane.cluster import emulator, load_profile, parse_profile


@pytest.fixture
def sysctl(tmp_path: Path) -> Path:
    """A root namespace that offers three algorithms and allows two (this VM image's)."""
    (tmp_path / "tcp_available_congestion_control").write_text("reno bbr cubic\n")
    (tmp_path / "tcp_allowed_congestion_control").write_text("reno bbr\n")
    return tmp_path


def allowed(sysctl: Path) -> list[str]:
    return (sysctl / "tcp_allowed_congestion_control").read_text().split()


def test_the_profiles_algorithm_is_added_to_the_allowed_list_once(sysctl):
    emulator.allow_congestion("cubic", sysctl)
    assert allowed(sysctl) == ["reno", "bbr", "cubic"]
    emulator.allow_congestion("cubic", sysctl)        # already there: nothing written twice
    emulator.allow_congestion("reno", sysctl)
    assert allowed(sysctl) == ["reno", "bbr", "cubic"]


def test_an_algorithm_the_kernel_lacks_is_refused_before_anything_changes(sysctl):
    with pytest.raises(emulator.EmulationError, match=r"tcp_congestion: this kernel offers reno, bbr, cubic, "
                                                      r"not 'dctcp' \(load its module, tcp_dctcp"):
        emulator.allow_congestion("dctcp", sysctl)
    assert allowed(sysctl) == ["reno", "bbr"]


def test_a_cluster_up_under_another_congestion_control_or_an_older_state_is_not_reused(monkeypatch, tmp_path):
    profile = load_profile("two_racks")
    state = tmp_path / "state.json"
    monkeypatch.setattr(emulator, "_state_file", lambda: state)
    monkeypatch.setattr(emulator, "namespaces", lambda: sorted(
        [emulator.switch_namespace(), *(emulator.host_namespace(h) for h in profile.hosts)]))
    state.write_text(json.dumps({"profile": "two_racks", "spec": profile.to_dict()}))
    assert emulator.is_up(profile) and emulator.status()["tcp_congestion"] == "cubic"
    bbr = parse_profile({**profile.to_dict(), "tcp_congestion": "bbr"})
    assert not emulator.is_up(bbr)
    state.write_text(json.dumps({"profile": "two_racks"}))        # built before the spec was kept
    assert not emulator.is_up(profile) and emulator.status()["tcp_congestion"] is None
