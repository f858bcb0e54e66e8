"""Cost model vs measurement on the emulator: prediction error for every modelled strategy.

    python scripts/validate_cost_model.py [--payload-mb 8] [--steps 3] [--out cost_validation.md]

Runs ``syncplane bench`` for each profile (4-16 ranks, including a generated 16-rank
two-rack profile) and prints a markdown table of measured vs predicted sync time.
Needs root (the emulator).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


from syncplane.bench.runner import run_bench
from syncplane.cluster import load_profile
from syncplane.cluster import emulator
from syncplane.cluster.profile import scaled

PROFILES = ["multi_nic", "wan_two_sites", "asymmetric_2_3", "homogeneous8", "two_racks", "two_racks_contended",
            "slow_nic", "two_racks_16"]


def profile_by_name(name: str):
    if name == "two_racks_16":
        return scaled(load_profile("two_racks"), racks=2, hosts_per_rack=8)
    return load_profile(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--payload-mb", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profiles", nargs="+", default=PROFILES)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    strategies = ["ddp", "torch_periodic", "diloco"]   # the patterns that need no rack layout
    lines = ["| profile | ranks | strategy | measured s | predicted s | error | bound ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.profiles:
            profile = profile_by_name(name)
            report = run_bench(profile, strategies, int(args.payload_mb * 2**20), steps=args.steps, warmup=1,
                               out_dir=Path(tmp) / name)
            for row in report["results"]:
                error = row["predicted_s"] / row["sync_s_median"] - 1
                lines.append(f"| {name} | {profile.world_size} | {row['strategy']} | {row['sync_s_median']:.3f} | "
                             f"{row['predicted_s']:.3f} | {error:+.0%} | {row['bound_ratio']:.2f} |")
                print(lines[-1], flush=True)
    emulator.down()
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
