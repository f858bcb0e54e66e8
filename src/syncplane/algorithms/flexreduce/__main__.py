"""Print FlexReduce's plan for a cluster profile: ``python -m syncplane.algorithms.flexreduce
--cluster two_racks --payload-mb 25`` (reduce calls per learner, bytes per link per level,
the ranges owned, and the α-β time of the pipelined and level-by-level schedules)."""

from __future__ import annotations

import argparse

from syncplane.exchanges.tree.cost import ELEMENT_SIZE
from syncplane.exchanges.tree.plan import describe, plan_for
from syncplane.exchanges.tree.tree import from_profile
from syncplane.algorithms.flexreduce.cost import hierarchical_allreduce_steps
from syncplane.algorithms.spec import CostOptions
from syncplane.cluster.cost import CostModel, ring_allreduce
from syncplane.exchanges.tree.cost import flexreduce_phases
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
    patterns = {"ddp": ring_allreduce(profile.world_size, payload),
                "flexreduce": flexreduce_phases(tree, payload),
                "flexreduce_levelwise": flexreduce_phases(tree, payload, chunk_bytes=0),
                "hier_allreduce": hierarchical_allreduce_steps("hier_allreduce", profile, payload, CostOptions())[0]}
    for name, phases in patterns.items():
        print(f"  {name:>20}: predicted {model.time(phases):.3f} s, bound {model.bound(phases):.3f} s")


if __name__ == "__main__":
    main()
