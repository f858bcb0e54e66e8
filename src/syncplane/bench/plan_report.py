"""``syncplane plan``'s inputs and outputs: the job's payload and compute from a recipe, the
rich table, the JSON and the PNG of predicted step time per candidate.

The plan itself (candidates, prices, ranking) is ``syncplane.algorithms.plan``: Lightning-free,
so ``strategy=auto`` decides by the same function inside the job.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from syncplane.algorithms.plan import ACCEPT, BASELINE_MARGIN, Candidate, Plan
from syncplane.config import ConfigError

log = logging.getLogger(__name__)


def recipe_payload(recipe: str) -> int:
    """Bytes of the recipe's parameters (fp32) at its default settings: what a sync moves."""
    module, _ = _build(recipe)
    return sum(p.numel() for p in module.parameters() if p.requires_grad) * 4


def _build(recipe: str) -> tuple[Any, Any]:
    from syncplane import recipes

    if recipe not in recipes.names():
        raise ConfigError(f"--recipe: unknown recipe {recipe!r}; allowed values: {', '.join(recipes.names())}")
    entry = recipes.get(recipe)
    return entry.build(entry.settings())


def time_recipe_steps(recipe: str, steps: int = 3) -> float:
    """Median seconds of one training step of the recipe's real model on one batch of its
    real data, on this machine (as ``strategy=auto`` times it)."""
    from syncplane.runtime.autopilot import time_steps

    module, data = _build(recipe)
    return time_steps(module, data, steps)


def command_for(candidate: Candidate, cluster: str, world_size: int) -> str:
    """The ``train.py`` command line that runs ``candidate`` on ``cluster``."""
    return " ".join(["python train.py", *candidate.overrides(), f"cluster={cluster}", f"trainer.devices={world_size}"])


def print_plan(plan: Plan, cluster_arg: str, top: int | None = None) -> None:
    """The ranked table, one block per accuracy class, then the winners and their commands."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    inputs = plan.inputs
    cpu = (f"the CPU work at this machine's rates, {inputs.cpu.sharing:.2g} ranks per core" if inputs.cpu is not None
           else "no CPU work (--cpu none)")
    print(f"priced with TCP {'as measured on the emulator' if inputs.tcp == 'emulated' else 'ideal (the α-β formula)'}"
          f" and {cpu}")
    for accept in ACCEPT:
        rows = [c for c in plan.candidates if c.exact == (accept == "exact")][:top]
        what = "same result as DDP" if accept == "exact" else "gossip, local SGD, compression"
        table = Table(title=f"{accept} ({what}): {plan.cluster}, {plan.world_size} ranks, "
                            f"{inputs.payload_bytes / 2**20:.1f} MB, compute {inputs.compute_s * 1000:.0f} ms/step")
        for col in ("#", "strategy and settings", "period", "sync s", "of it CPU s", "overlap", "hidden s", "step s",
                    "vs best"):
            table.add_column(col, justify="left" if col in ("strategy and settings", "overlap") else "right")
        for i, c in enumerate(rows):
            table.add_row(str(i + 1), c.label, str(c.period), f"{c.sync_s:.3f}", f"{c.cpu_s:.3f}", c.overlap or "-",
                          f"{c.hidden_s:.3f}", f"{c.step_s:.3f}", f"{c.step_s / rows[0].step_s:.2f}x")
        console.print(table)
    for e in plan.excluded:
        print(f"excluded: {e.strategy} {' '.join(f'{k}={v}' for k, v in e.kwargs.items())}: {e.reason}")
    for accept in ACCEPT:
        try:
            best = plan.best(accept)
        except ConfigError as exc:
            print(f"{accept}: {exc}")
            continue
        fastest = plan.ranked(accept)[0]
        kept = "" if best is fastest else (f" (kept: {fastest.label} is predicted only "
                                           f"{(1 - fastest.step_s / best.step_s) * 100:.0f} % faster, within the "
                                           f"{BASELINE_MARGIN * 100:.0f} % the baseline keeps)")
        print(f"best {accept}: {best.label} — predicted {best.step_s:.3f} s/step{kept}\n  "
              f"{command_for(best, cluster_arg, plan.world_size)}")


def chart(plan: Plan, top: int = 30) -> Any:
    """Horizontal bars of predicted step time per candidate (compute, then the exposed sync),
    exact and approximate in two colours, fastest at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.candidates[:top][::-1]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.28 * len(rows)))
    labels = [c.label for c in rows]
    compute = [plan.inputs.compute_s for _ in rows]
    from matplotlib.patches import Patch

    ax.barh(labels, compute, color="lightgrey")
    ax.barh(labels, [c.exposed_s for c in rows], left=compute, color=["C0" if c.exact else "C1" for c in rows])
    ax.set_xlabel("predicted step time (s)")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"{plan.cluster}: {plan.inputs.payload_bytes / 2**20:.0f} MB, {plan.world_size} ranks, "
                 f"compute {plan.inputs.compute_s * 1000:.0f} ms", fontsize=10)
    ax.legend(handles=[Patch(color="lightgrey", label="compute"), Patch(color="C0", label="sync left, exact"),
                       Patch(color="C1", label="sync left, approximate")], loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def write_outputs(plan: Plan, cluster_arg: str, json_path: str | None, png_path: str | None) -> None:
    """The JSON (the plan, plus each class's winner and its command) and the PNG."""
    import json

    if json_path:
        data = plan.to_dict()
        for accept in ACCEPT:
            try:
                best = plan.best(accept)
                data[f"best_{accept}"] = {**best.to_dict(), "command": command_for(best, cluster_arg, plan.world_size)}
            except ConfigError as exc:
                data[f"best_{accept}"] = {"error": str(exc)}
        Path(json_path).write_text(json.dumps(data, indent=2))
    if png_path:
        fig = chart(plan)
        fig.savefig(png_path, dpi=110)
        log.info("plan chart written to %s", png_path)
