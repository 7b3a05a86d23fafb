"""Figures of runs as PNG files: a run's training curves, a sweep's comparison.

matplotlib is imported only here and with the Agg backend: a run draws its
figure at the end of the job, often on a machine without a display, and
the tasks themselves never pay for the import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psdk.plugins.metrics import MetricSpec
from psdk.report.runs import Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def prepare() -> None:
    """Import matplotlib with the Agg backend (over half a second): done ahead, drawing later is quick."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its first run's font-cache notes are no news
    matplotlib.use("Agg", force=True)
    import matplotlib.figure


def warm_up() -> None:
    """Draw a tiny figure to nowhere: fonts and the renderer load now, not during the real one (~0.15 s)."""
    import io

    prepare()
    fig = _figure(1, 1, (2, 2), CURVES_MARGINS)
    ax = fig.axes[0]
    ax.plot([1, 2], [1, 2], "o-", label="warm-up")
    ax.set_yscale("log")
    ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("x")
    fig.suptitle("warm-up")
    fig.savefig(io.BytesIO(), format="png", dpi=100)


CURVES_MARGINS = {"left": 0.08, "right": 0.985, "bottom": 0.075, "top": 0.93, "wspace": 0.24, "hspace": 0.26}
"""The run figure's fixed layout: laying it out anew ("constrained") took 0.12 of its 0.34 s at every job's end."""


def _figure(rows: int, cols: int, size: tuple[float, float], margins: dict[str, float] | None = None) -> Figure:
    """A figure of ``rows`` x ``cols`` axes: laid out by matplotlib, or with fixed ``margins`` (fractions)."""
    prepare()
    from matplotlib.figure import Figure

    # "none" (in matplotlib's docs, not its type stubs): no layout engine, whatever a matplotlibrc says.
    fig = Figure(figsize=size, layout="none" if margins else "constrained")  # type: ignore[arg-type]
    fig.subplots(rows, cols, squeeze=False)
    if margins:
        fig.subplots_adjust(**margins)
    return fig


def plot_curves(run: Run, path: Path, title: str | None = None) -> Path:
    """Each metric the workload logs, per worker, against the global step and against seconds of training
    (MNIST: its training loss and its validation accuracy)."""
    specs = run.metrics or (MetricSpec("loss", higher_is_better=False, held_out=False),)
    fig = _figure(len(specs), 2, (11, 3.75 * len(specs)), CURVES_MARGINS)
    axes = fig.axes
    start = run.start_time or 0.0
    for row, spec in enumerate(specs):
        left, right = axes[2 * row], axes[2 * row + 1]
        values: list[float] = []
        for task, points in run.by_task().items():
            logged = [p for p in points if isinstance(p.get(spec.name), (int, float))]
            values += [p[spec.name] for p in logged]
            style = "o-" if spec.held_out else "-"
            left.plot([p["global_step"] for p in logged], [p[spec.name] for p in logged], style, label=task)
            right.plot([p["time"] - start for p in logged], [p[spec.name] for p in logged], style, label=task)
        for ax, xlabel in ((left, "global step"), (right, "seconds of training")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(spec.logged_words)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(loc="best", fontsize="small")
                if not spec.higher_is_better and all(v > 0 for v in values):  # a loss spans decades
                    ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "no points logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title or run.title())
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_comparison(rows: Sequence[dict[str, Any]], path: Path, target: float | None, spec: MetricSpec) -> Path:
    """The primary metric ``spec`` on test data, the time to ``target`` on validation data, and the
    throughput of each run, side by side."""
    fig = _figure(1, 3, (max(11.0, 1.2 * len(rows) + 6), 4.5))
    names = [str(row.get("label", row["run"])) for row in rows]
    reach = f"{target:g} {spec.logged_words}" if target is not None else f"a target {spec.logged_words} (none set)"
    panels = [
        (f"test_{spec.name}", f"test {spec.words}", None),
        ("time_to_target_s", f"seconds to {reach}", "not reached"),
        ("steps_per_s", "global steps/s", None),
    ]
    for ax, (key, label, missing) in zip(fig.axes, panels, strict=True):
        values = [row.get(key) for row in rows]
        heights = [v if isinstance(v, (int, float)) else 0.0 for v in values]
        bars = ax.bar(range(len(rows)), heights, color=["C0" if row["finished"] else "C3" for row in rows])
        for bar, value, row in zip(bars, values, rows, strict=True):
            text = f"{value:.4g}" if isinstance(value, (int, float)) else (missing or "n/a")
            if not row["finished"]:
                text = str(row["status"])
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize="small")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
        # A fraction where higher is better (an accuracy, an AUC): zoomed in on the runs' differences.
        if key == f"test_{spec.name}" and spec.higher_is_better and any(heights) and max(heights) <= 1.0:
            low = min(h for h in heights if h) - 0.02
            ax.set_ylim(max(0.0, low), min(1.0, max(heights) + 0.01))
    fig.suptitle(f"{len(rows)} runs (red: failed or unfinished)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
