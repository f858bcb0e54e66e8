"""syncplane.cluster: cluster profiles, the network-namespace emulator and the α-β cost model."""

from syncplane.cluster.profile import ClusterProfile, load_profile, parse_profile, shipped_profiles

__all__ = ["ClusterProfile", "load_profile", "parse_profile", "shipped_profiles"]
