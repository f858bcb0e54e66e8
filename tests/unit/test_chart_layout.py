"""The bench's and the comparison's charts, at their typical sizes (2, 5 and 11 strategies):
no text covers another, a bar, a bound marker or the plotted area (issue 38: the bench's
legend hid the tallest bar's value). Measured on the drawn figure, in display coordinates,
as a reader would see it; the PNGs were also checked by eye."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from syncplane.bench import compare, runner

NAMES = ["ddp", "atc", "canary", "awc", "h_atc", "h_awc", "ds_sync", "diloco", "flexreduce", "torch_periodic",
         "flexreduce_levelwise"]


def bench_report(n: int) -> dict[str, Any]:
    """The issue's two_racks shape (atc the tallest, 7.08 s), with bounds above some bars
    and one strategy not measured."""
    rng = random.Random(n)
    rows = []
    for name in NAMES[:n]:
        median = {"ddp": 5.2, "atc": 7.08, "canary": 2.1}.get(name, rng.uniform(0.5, 7.5))
        ok = name != "h_awc"
        rows.append({"strategy": name, "status": "ok" if ok else "not implemented",
                     "sync_s_median": median if ok else None, "bound_s": median * 0.8 if ok else None,
                     "network_bound_s": 3.0 if ok else None})
    return {"cluster": "two_racks", "payload_bytes": 97.5 * 2**20, "world_size": 8, "results": rows}


def comparison_runs(n: int) -> list[dict[str, Any]]:
    """Three seeds per strategy; two strategies reach the target in one seed of three."""
    rng = random.Random(n)
    runs = []
    for name in NAMES[:n]:
        for seed in (1, 2, 3):
            cap = 0.85 if name in ("atc", "flexreduce_levelwise") and seed < 3 else 0.99
            history = [{"epoch_s": rng.uniform(2, 5), "val_acc": min(cap, 0.5 + 0.07 * e)} for e in range(8)]
            runs.append({"summary": {"strategy": name, "seed": seed, "metrics": {"val_acc": history[-1]["val_acc"]},
                                     "throughput": {"samples_per_s": rng.uniform(800, 4000)},
                                     "comm": {"seconds": rng.uniform(1, 30)}, "steps": 100}, "history": history})
    return runs


def drawn(fig: Any) -> Any:
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def assert_apart(boxes: list[Any], what: str) -> None:
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), f"{what} overlap: {a} and {b}"


def inside(box: Any, area: Any) -> bool:
    return area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1


@pytest.mark.parametrize("n", [2, 5, 11])
def test_the_bench_chart_has_no_overlapping_text(n):
    import matplotlib.pyplot as plt

    report = bench_report(n)
    fig = runner.chart(report)
    renderer = drawn(fig)
    ax = fig.axes[0]
    legend = fig.legends[0].get_window_extent(renderer)
    values = [t.get_window_extent(renderer) for t in ax.texts]
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert len(values) == len(bars) == len(ticks) == n
    assert not legend.overlaps(ax.bbox) and not any(legend.overlaps(b) for b in values + bars + ticks)
    assert_apart(values, "bar values")
    names = [t for t in ax.get_xticklabels() if t.get_text()]
    slant = math.radians(names[0].get_rotation())
    if slant:   # parallel slanted lines: apart when the ticks are a line height apart across them
        spacing = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]
        assert spacing * math.sin(slant) >= 1.2 * names[0].get_fontsize() * fig.dpi / 72, "strategy names overlap"
    else:
        assert_apart(ticks, "strategy names")
    for box, row, bar in zip(values, report["results"], bars):
        assert inside(box, ax.bbox), "a value leaves the plotted area (no headroom)"
        top = max(row["sync_s_median"] or 0, row["bound_s"] or 0, row["network_bound_s"] or 0)
        assert box.y0 >= ax.transData.transform((0, top))[1] - 0.5, "a bound marker crosses a value"
        assert box.y0 >= bar.y1 - 0.5
    plt.close(fig)


@pytest.mark.parametrize("n", [2, 5, 11])
def test_the_comparison_chart_has_no_overlapping_text(n):
    import matplotlib.pyplot as plt

    fig = compare.chart(comparison_runs(n), compare.Target("val_acc", 0.9))
    renderer = drawn(fig)
    times, *_, curves = fig.axes
    legend = curves.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(ax.bbox) for ax in fig.axes), "the legend covers a panel"
    notes = [t.get_window_extent(renderer) for t in times.texts]
    assert len(notes) == (1 if n == 2 else 2 if n == 11 else 1)        # "1/3 reached"
    assert all(inside(box, times.bbox) for box in notes)
    for ax in fig.axes[:3]:
        assert_apart([t.get_window_extent(renderer) for t in ax.get_yticklabels() if t.get_text()], "names")
    plt.close(fig)
