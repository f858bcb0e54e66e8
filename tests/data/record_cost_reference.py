"""Records ``cost_reference.json``: every modelled strategy's (predicted, bound) seconds on
every shipped profile and a few scaled ones, as the per-flow Python cost model of commit
f9d8229 computed them (run there, before the vectorized model replaced it).

``tests/unit/test_cost_reference.py`` holds the current model to these numbers. Re-run
only to record a deliberate change of the model's answers, and say why in the commit
(FlexReduce's rows were re-recorded so, with the current model, when its pattern changed;
the test's docstring says how):

    python tests/data/record_cost_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

from syncplane.algorithms import CostOptions, peer_names, strategy_names, strategy_time
from syncplane.cluster import load_profile
from syncplane.cluster.cost import CostModel
from syncplane.cluster.profile import scaled, shipped_profiles

PAYLOADS = {"16MB": 16 * 2**20, "resnet50": 97.49 * 2**20}
OPTIONS = [CostOptions(period=4, streams=1), CostOptions(period=1, streams=4), CostOptions(period=3, streams=2)]
SCALED = [("two_racks", 4, 4), ("two_racks", 3, 5), ("wan_two_sites", 2, 3), ("multi_nic", 2, 3)]


def cases() -> list[tuple[str, object]]:
    profiles = [(name, load_profile(name)) for name in shipped_profiles()]
    profiles += [(f"{n}@{r}x{h}", scaled(load_profile(n), r, h)) for n, r, h in SCALED]
    return profiles


def main() -> None:
    rows = []
    for label, profile in cases():
        model = CostModel(profile)
        for payload_name, payload in PAYLOADS.items():
            for options in OPTIONS:
                for name in [*strategy_names(), *peer_names()]:
                    predicted, bound = strategy_time(model, name, payload, options)
                    rows.append({"profile": label, "payload": payload_name, "period": options.period,
                                 "streams": options.streams, "strategy": name,
                                 "predicted_s": predicted, "bound_s": bound})
    out = Path(__file__).with_name("cost_reference.json")
    out.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")
    print(f"{len(rows)} rows -> {out}")


if __name__ == "__main__":
    main()
