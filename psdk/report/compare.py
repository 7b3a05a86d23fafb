"""A comparison of runs (a Hydra sweep's, or any folder of runs): one row each, as Markdown, CSV and a figure.

A row says what the run was (its overrides, backend, sync mode, workers)
and what it achieved (test accuracy, time to ``report.target_accuracy``
validation accuracy, global steps/s, wall time). Runs that failed or did not
finish get a row too, with their status and blanks where figures are
missing: a sweep in which one setting fails should say so, not lose it.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from psdk.ps.consistency import SyncSpec
from psdk.report.runs import Run, find_runs, load_run

log = logging.getLogger(__name__)

COLUMNS = [
    ("run", "run"),
    ("status", "status"),
    ("overrides", "overrides"),
    ("backend", "backend"),
    ("sync", "sync"),
    ("workers", "workers"),
    ("test_accuracy", "test accuracy"),
    ("best_val_accuracy", "best val accuracy"),
    ("time_to_target_s", "time to target (s)"),
    ("step_at_target", "step at target"),
    ("steps_per_s", "global steps/s"),
    ("wall_s", "wall (s)"),
]


def row(run: Run, root: Path, target: float) -> dict[str, Any]:
    """One run's line of the comparison."""
    reached = run.time_to_accuracy(target)
    sync = run.setting("sync") or {}
    mode = sync.get("mode")
    if SyncSpec.mode_waits_for_rounds(mode) and sync.get("replicas_to_aggregate") is not None:
        mode = f"sync({sync['replicas_to_aggregate']})"
    name = run.folder.relative_to(root).as_posix() if run.folder != root else run.folder.name
    return {
        "run": name,
        "status": run.status,
        "overrides": " ".join(o for o in run.overrides if not o.startswith("hydra.")),
        "backend": run.setting("backend"),
        "sync": mode,
        "workers": run.setting("num_workers"),
        "test_accuracy": run.get("test_accuracy"),
        "best_val_accuracy": run.best_val_accuracy(),
        "time_to_target_s": round(reached[0], 3) if reached else None,
        "step_at_target": reached[1] if reached else None,
        "steps_per_s": run.get("global_steps_per_s"),
        "wall_s": run.get("wall_s"),
        "finished": run.finished,
        "error": run.error,
    }


def rows_of(root: Path, target: float) -> list[dict[str, Any]]:
    rows = [row(load_run(folder), root, target) for folder in find_runs(root)]
    # What tells the runs apart (a sweep's swept values), to name them in the figure.
    shared = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
    for r in rows:
        differing = [o for o in r["overrides"].split() if o not in shared]
        r["label"] = f"{r['run']}: {' '.join(differing)}" if differing else r["run"]
    return rows


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "not reached" if key in ("time_to_target_s", "step_at_target") else ""
    if isinstance(value, float):
        return f"{value:.4f}" if "accuracy" in key else f"{value:.1f}"
    return str(value)


def markdown(rows: Sequence[dict[str, Any]], target: float, title: str) -> str:
    """The comparison as a Markdown table (what ``psdk report`` prints too)."""
    lines = [
        f"# {title}",
        "",
        f"Target validation accuracy: {target:g}. Time to target: seconds of training until a worker first "
        "validated at or above it.",
        "",
        "| " + " | ".join(label for _, label in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for r in rows:
        cells = [
            _cell(r[key], key) if r["finished"] or key not in ("time_to_target_s", "step_at_target") else ""
            for key, _ in COLUMNS
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    failures = [r for r in rows if r["error"]]
    if failures:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {r['run']}: {r['error']}" for r in failures]
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([key for key, _ in COLUMNS])
        for r in rows:
            writer.writerow(["" if r[key] is None else r[key] for key, _ in COLUMNS])


def write_comparison(root: Path, target: float, plot: bool = True) -> list[dict[str, Any]]:
    """``comparison.md``, ``comparison.csv`` and ``comparison.png`` in ``root``, from the runs below it."""
    rows = rows_of(root, target)
    root.mkdir(parents=True, exist_ok=True)
    (root / "comparison.md").write_text(markdown(rows, target, f"Comparison of {len(rows)} runs in {root}"))
    write_csv(rows, root / "comparison.csv")
    if plot and rows:
        from psdk.report.plot import plot_comparison

        plot_comparison(rows, root / "comparison.png", target)
    return rows
