"""Cluster profiles: shipped ones load, bad ones name the field."""

from __future__ import annotations

import copy

import pytest

from syncplane.cluster import load_profile, parse_profile, shipped_profiles
from syncplane.cluster.profile import scaled
from syncplane.config import ConfigError

GOOD = {
    "name": "t",
    "racks": [
        {"name": "r0", "uplink_mbit": 100, "hosts": [{"name": "a", "nic_mbit": 400, "ranks": 2},
                                                    {"name": "b", "nic_mbit": 400}]},
        {"name": "r1", "uplink_mbit": 100, "hosts": [{"name": "c", "nic_mbit": 400, "nics": 2}]},
    ],
    "background": [{"src": "a", "dst": "c"}],
}


def test_shipped_profiles_load():
    names = shipped_profiles()
    for required in ("local", "homogeneous8", "two_racks", "two_racks_contended", "slow_nic", "asymmetric_2_3",
                     "multi_nic", "wan_two_sites"):
        assert required in names
    sizes = {n: load_profile(n).world_size for n in names}
    assert sizes["two_racks"] == 8 and sizes["asymmetric_2_3"] == 5 and sizes["homogeneous8"] == 8


def test_ranks_are_numbered_rack_by_rack_host_by_host():
    profile = parse_profile(GOOD)
    assert profile.world_size == 4
    assert [list(h.ranks) for h in profile.hosts] == [[0, 1], [2], [3]]
    assert profile.host_of_rank(3).name == "c" and profile.host_of_rank(3).rack == 1
    assert profile.hosts[2].address(1) == "198.18.1.3"


def mutate(path, value):
    data = copy.deepcopy(GOOD)
    node = data
    keys = path.split("/")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    last = keys[-1]
    if value is DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return data


DELETE = object()


@pytest.mark.parametrize("path,value,message", [
    ("racks/0/hosts/0/nic_mbit", 0, r"cluster.racks\[0\].hosts\[0\].nic_mbit: must be positive"),
    ("racks/0/uplink_mbit", -5, r"cluster.racks\[0\].uplink_mbit: must be positive"),
    ("racks/0/hosts/0/nic", 400, r"cluster.racks\[0\].hosts\[0\]: unknown key\(s\) nic; allowed keys: compute_speed, name, nic_mbit"),
    ("racks/1/hosts/0/name", "a", r"duplicate name 'a'"),
    ("racks/1/uplink_mbit", DELETE, r"racks\[1\].uplink_mbit: required when there is more than one rack"),
    ("background/0/dst", "zz", r"background\[0\].dst: unknown host 'zz'"),
    ("racks/0/hosts/1/ranks", 0, r"ranks: must be at least 1"),
    ("racks/0/speed", 1, r"cluster.racks\[0\]: unknown key\(s\) speed"),
    ("tcp_congestion", "Cubic; rm", r"cluster.tcp_congestion: a Linux congestion control's name .*'Cubic; rm'"),
    ("tcp_congestion", 3, r"cluster.tcp_congestion: .*got 3"),
    ("tcp", "bbr", r"cluster: unknown key\(s\) tcp; allowed keys: .*tcp_congestion"),
])
def test_bad_profiles_name_the_field(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_profile(mutate(path, value))


def test_hosts_run_cubic_unless_the_profile_names_another_congestion_control():
    """cubic (Linux's default) whatever this machine's own default is; a profile that names
    another keeps it through ``to_dict`` and ``scaled``, one that does not writes nothing."""
    assert parse_profile(GOOD).tcp_congestion == "cubic" and "tcp_congestion" not in parse_profile(GOOD).to_dict()
    assert {load_profile(n).tcp_congestion for n in shipped_profiles()} == {"cubic"}
    bbr = parse_profile({**GOOD, "tcp_congestion": "bbr"})
    assert bbr.tcp_congestion == "bbr" and parse_profile(bbr.to_dict()).tcp_congestion == "bbr"
    assert scaled(bbr, racks=2, hosts_per_rack=2).tcp_congestion == "bbr"


def test_world_size_must_match_devices():
    with pytest.raises(ConfigError, match=r"trainer.devices: 2 processes, but cluster profile 'two_racks' has 8 ranks"):
        load_profile("two_racks").check_world_size(2)


def test_unknown_profile_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match="shipped profiles: asymmetric_2_3"):
        load_profile("nope")
    with pytest.raises(ConfigError, match="no profile file"):
        load_profile(tmp_path / "missing.yaml")


def test_scaled_profile_keeps_the_template_shape():
    big = scaled(load_profile("two_racks"), racks=16, hosts_per_rack=64)
    assert big.world_size == 1024 and len(big.racks) == 16
    assert big.racks[3].uplink_mbit == 100 and big.hosts[-1].spec.nic_mbit == 400


def test_gloo_lists_the_fewest_nics_a_host_has_on_every_rank():
    """gloo pairs its devices across ranks by position: a host's second NIC serves gloo only
    where every host has one (``uneven_uplinks``: one host of seven has two)."""
    from syncplane.cluster.emulator import rank_env

    for name, listed in (("multi_nic", "eth0,eth1"), ("uneven_uplinks", "eth0"), ("two_racks", "eth0")):
        profile = load_profile(name)
        assert {rank_env(profile, r)["GLOO_SOCKET_IFNAME"] for r in range(profile.world_size)} == {listed}
        assert profile.gloo_nics == listed.count("eth") <= profile.max_nics
