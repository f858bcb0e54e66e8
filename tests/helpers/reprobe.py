"""A re-probe for the re-planning tests: the real collective one over the control group
(loopback), then the network changed as the test says (``edit`` on each host's profile entry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def changed_reprobe(declared: Any, edit: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
    """A ``Replanner`` probe: ``Reprobe`` of ``declared``, then ``edit`` applied to every host."""
    from syncplane.cluster import parse_profile
    from syncplane.comm.process_groups import control_group
    from syncplane.runtime.replan import Reprobe

    reprobe = Reprobe(declared, control_group)

    def probe() -> Any:
        data = reprobe().to_dict()
        for rack in data["racks"]:
            for host in rack["hosts"]:
                edit(host)
        return parse_profile(data)
    return probe
