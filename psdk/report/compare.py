"""A comparison of runs (a Hydra sweep's, or any folder of runs): one row each, as Markdown, CSV and a figure.

A row says what the run was (its overrides, backend, sync mode, workers)
and what it achieved in its workload's primary metric (for MNIST: test
accuracy, best validation accuracy, time to ``report.target`` validation
accuracy), global steps/s, wall time. Runs that failed or did not
finish get a row too, with their status and blanks where figures are
missing: a sweep in which one setting fails should say so, not lose it.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from psdk.plugins.metrics import MetricSpec
from psdk.ps.consistency import SyncSpec
from psdk.report.declared import report_target
from psdk.report.runs import Run, find_runs, is_run, load_run

log = logging.getLogger(__name__)

UNDECLARED = MetricSpec("metric", primary=True)
"""What judges runs when none records or declares a metric (no workload installed at all): blanks, not an error."""


def columns(spec: MetricSpec) -> list[tuple[str, str]]:
    """The comparison's columns (key, heading), with the primary metric's (``test_auc``, "test auc")."""
    return [
        ("run", "run"),
        ("status", "status"),
        ("overrides", "overrides"),
        ("backend", "backend"),
        ("sync", "sync"),
        ("workers", "workers"),
        (f"test_{spec.name}", f"test {spec.words}"),
        (f"best_val_{spec.name}", f"best val {spec.words}"),
        ("time_to_target_s", "time to target (s)"),
        ("step_at_target", "step at target"),
        ("steps_per_s", "global steps/s"),
        ("wall_s", "wall (s)"),
    ]


def primary_of(runs: Sequence[Run]) -> MetricSpec:
    """The metric a comparison judges its runs by: the first run's primary that has one."""
    return next((run.primary for run in runs if run.primary is not None), UNDECLARED)


def target_for(root: Path, given: Mapping[str, Any] | None) -> float | None:
    """The target runs below ``root`` are timed to: from ``given`` (``report.target``, or MNIST's
    ``report.target_accuracy``), else the first run's config, else its primary metric's default."""
    runs = [load_run(folder) for folder in ([root] if is_run(root) else find_runs(root)[:1])]
    spec = primary_of(runs)
    for report in [given, *(run.config.get("report") for run in runs)]:
        chosen = report_target(report, spec, default=False)
        if chosen is not None:
            return chosen
    return spec.target


def row(run: Run, root: Path, target: float | None, spec: MetricSpec | None = None) -> dict[str, Any]:
    """One run's line of the comparison, judged by ``spec`` (default: the run's primary metric)."""
    spec = spec or run.primary or UNDECLARED
    reached = run.time_to_target(target) if target is not None and spec == run.primary else None
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
        f"test_{spec.name}": run.final(spec.name),
        f"best_val_{spec.name}": run.best_logged(spec),
        "time_to_target_s": round(reached[0], 3) if reached else None,
        "step_at_target": reached[1] if reached else None,
        "steps_per_s": run.get("global_steps_per_s"),
        "wall_s": run.get("wall_s"),
        "finished": run.finished,
        "error": run.error,
        "metric": spec,
    }


def rows_of(root: Path, target: float | None) -> list[dict[str, Any]]:
    runs = [load_run(folder) for folder in find_runs(root)]
    spec = primary_of(runs)
    rows = [row(run, root, target, spec) for run in runs]
    # What tells the runs apart (a sweep's swept values), to name them in the figure.
    shared = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
    for r in rows:
        differing = [o for o in r["overrides"].split() if o not in shared]
        r["label"] = f"{r['run']}: {' '.join(differing)}" if differing else r["run"]
    return rows


def _spec(rows: Sequence[dict[str, Any]]) -> MetricSpec:
    return rows[0]["metric"] if rows else UNDECLARED


def _cell(value: Any, key: str, spec: MetricSpec) -> str:
    if value is None:
        return "not reached" if key in ("time_to_target_s", "step_at_target") else ""
    if isinstance(value, float):
        return spec.show(value) if key.endswith(f"_{spec.name}") else f"{value:.1f}"
    return str(value)


def markdown(rows: Sequence[dict[str, Any]], target: float | None, title: str) -> str:
    """The comparison as a Markdown table (what ``psdk report`` prints too)."""
    spec = _spec(rows)
    keys = columns(spec)
    beyond = "at or above" if spec.higher_is_better else "at or below"
    lines = [
        f"# {title}",
        "",
        (
            f"Target {spec.logged_words}: {target:g}. Time to target: seconds of training until a worker first "
            f"validated {beyond} it."
            if target is not None
            else f"No target {spec.logged_words} (report.target): no time to target."
        ),
        "",
        "| " + " | ".join(label for _, label in keys) + " |",
        "|" + "|".join("---" for _ in keys) + "|",
    ]
    for r in rows:
        cells = [
            _cell(r[key], key, spec) if r["finished"] or key not in ("time_to_target_s", "step_at_target") else ""
            for key, _ in keys
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
        keys = [key for key, _ in columns(_spec(rows))]
        writer.writerow(keys)
        for r in rows:
            writer.writerow(["" if r[key] is None else r[key] for key in keys])


def write_comparison(root: Path, target: float | None, plot: bool = True) -> list[dict[str, Any]]:
    """``comparison.md``, ``comparison.csv`` and ``comparison.png`` in ``root``, from the runs below it."""
    rows = rows_of(root, target)
    root.mkdir(parents=True, exist_ok=True)
    (root / "comparison.md").write_text(markdown(rows, target, f"Comparison of {len(rows)} runs in {root}"))
    write_csv(rows, root / "comparison.csv")
    if plot and rows:
        from psdk.report.plot import plot_comparison

        plot_comparison(rows, root / "comparison.png", target, _spec(rows))
    return rows
