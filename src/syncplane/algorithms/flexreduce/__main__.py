"""Print FlexReduce's plan for a cluster profile: ``python -m syncplane.algorithms.flexreduce
--cluster two_racks --payload-mb 25`` (reduce calls per learner, bytes per link per level,
the ranges owned, and the α-β time of the pipelined and level-by-level schedules)."""

from __future__ import annotations

import argparse

from syncplane.algorithms.flexreduce.cost import ELEMENT_SIZE
from syncplane.algorithms.flexreduce.plan import describe, plan_for
from syncplane.algorithms.flexreduce.tree import from_profile
from syncplane.algorithms import strategy_time
from syncplane.cluster.cost import CostModel
from syncplane.cluster.profile import load_profile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", required=True, help="shipped profile name or YAML path")
    parser.add_argument("--payload-mb", type=float, default=25.0, help="float32 payload, MiB")
    args = parser.parse_args(argv)
    profile = load_profile(args.cluster)
    payload = int(args.payload_mb * 2**20)
    tree = from_profile(profile)
    print(describe(tree, plan_for(tree, payload // ELEMENT_SIZE), ELEMENT_SIZE))
    model = CostModel(profile)
    for name in ("ddp", "flexreduce", "flexreduce_levelwise", "hier_allreduce"):
        predicted, bound = strategy_time(model, name, payload)
        print(f"  {name:>20}: predicted {predicted:.3f} s, bound {bound:.3f} s")


if __name__ == "__main__":
    main()
