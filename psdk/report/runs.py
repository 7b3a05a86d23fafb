"""Finished runs read back from their folders: summary, logged points, overrides, figures.

A run folder is what ``python -m psdk run`` (or the chief of a per-task job)
leaves: ``summary.json``, ``metrics.jsonl``, ``config.yaml``,
``.hydra/overrides.yaml``. A run that failed has no summary; it is still
listed, so that a comparison shows which runs of a sweep did not finish:
``failed`` when the launcher recorded why (``failed.json``), ``unfinished``
when it did not (still running, or killed).
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psdk.plugins.metrics import MetricSpec, primary
from psdk.report.declared import run_metrics
from psdk.report.metrics import final_metrics, write_json_atomic

# Folders inside a run that hold no run of their own.
INNER = {"tasks", "checkpoints", "tensorboard", ".hydra", "keys"}


FAILED_FILE = "failed.json"


def is_run(folder: Path) -> bool:
    """A launcher's run, finished or not (``tasks/``, or Hydra's record of it), or a chief's folder."""
    return any((folder / name).exists() for name in ("summary.json", "tasks", FAILED_FILE, ".hydra/config.yaml"))


def record_failure(folder: Path, error: str) -> None:
    """Say in a run's (or a task's) folder why it failed: for comparisons, ``psdk report`` and the launcher."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / FAILED_FILE, {"error": error})  # a task killed while writing leaves no half file


def forget_failure(folder: Path) -> None:
    """A run or task starts (again) in ``folder``: an earlier start's failure must not explain this one's."""
    (folder / FAILED_FILE).unlink(missing_ok=True)


def recorded_failure(folder: Path) -> str | None:
    """Why the run or task of ``folder`` failed, as :func:`record_failure` wrote it; None if it wrote nothing."""
    path = folder / FAILED_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text()).get("error") or "failed")
    except (OSError, ValueError, AttributeError):
        return "failed"


def find_runs(root: Path) -> list[Path]:
    """Every run at or below ``root``, in a stable order (a sweep's job numbers sort numerically)."""

    def walk(folder: Path) -> Iterator[Path]:
        if is_run(folder):
            yield folder
            return
        for child in sorted(p for p in folder.iterdir() if p.is_dir() and p.name not in INNER):
            yield from walk(child)

    def order(path: Path) -> tuple[Any, ...]:
        return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.relative_to(root).parts)

    return sorted(walk(root), key=order) if root.is_dir() else []


def _overrides(folder: Path) -> list[str]:
    """The command line's overrides, from Hydra's record of the run (plain YAML list of strings)."""
    path = folder / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    try:
        return [str(o) for o in OmegaConf.load(path)]
    except Exception:  # a hand-edited or truncated file: the run is still worth showing
        return []


@dataclass
class Run:
    """One run's records, and the figures a comparison shows."""

    folder: Path
    summary: dict[str, Any] | None
    points: list[dict[str, Any]]
    overrides: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def status(self) -> str:
        return "finished" if self.finished else "failed" if self.error is not None else "unfinished"

    def setting(self, key: str) -> Any:
        """A figure of the run's setup: from its summary, else from its config (a run that did not finish)."""
        if self.summary is not None and self.summary.get(key) is not None:
            return self.summary[key]
        cfg = self.config
        topology, sync = cfg.get("topology") or {}, cfg.get("sync") or {}
        fallback = {
            "backend": cfg.get("backend"),
            "sync": {"mode": sync.get("mode"), "replicas_to_aggregate": sync.get("replicas_to_aggregate")},
            "num_workers": topology.get("num_workers"),
            "num_ps": topology.get("num_ps"),
            "model": (cfg.get("model") or {}).get("name"),
            "steps": (cfg.get("train") or {}).get("steps"),
        }
        return fallback.get(key)

    def title(self) -> str:
        sync = self.setting("sync") or {}
        return (
            f"{self.folder.name}: backend={self.setting('backend')} sync={sync.get('mode')} "
            f"workers={self.setting('num_workers')} ps={self.setting('num_ps')} ({self.status})"
        )

    @property
    def start_time(self) -> float | None:
        """When the first worker started training (a logged point's time minus its elapsed time)."""
        starts = [p["time"] - p.get("wall_s", 0.0) for p in self.points if "time" in p]
        return min(starts) if starts else None

    def by_task(self) -> dict[str, list[dict[str, Any]]]:
        """Each worker's points in the order they were logged."""
        series: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for point in sorted(self.points, key=lambda p: p.get("time", 0.0)):
            series[str(point.get("task", "?"))].append(point)
        return dict(sorted(series.items(), key=lambda kv: (len(kv[0]), kv[0])))

    @property
    def metrics(self) -> tuple[MetricSpec, ...]:
        """The metrics the run reports (its summary's record, else its workload's declaration)."""
        return run_metrics(self.summary, self.config)

    @property
    def primary(self) -> MetricSpec | None:
        return primary(self.metrics)

    def time_to_target(self, target: float) -> tuple[float, int] | None:
        """Seconds of training and the global step when any worker first validated the primary metric at
        ``target`` or beyond it (above for a metric where higher is better, below otherwise)."""
        spec, start = self.primary, self.start_time
        if spec is None or start is None:
            return None
        for point in sorted(self.points, key=lambda p: p.get("time", 0.0)):
            value = point.get(spec.name)
            if isinstance(value, (int, float)) and spec.reached(value, target):
                return point["time"] - start, int(point["global_step"])
        return None

    def best_logged(self, spec: MetricSpec) -> float | None:
        """The best value of ``spec`` any worker logged (validated, for a held-out metric)."""
        return spec.best(p[spec.name] for p in self.points if isinstance(p.get(spec.name), (int, float)))

    def final(self, name: str) -> Any:
        """The final evaluation's value of metric ``name`` (None if the run has none)."""
        return final_metrics(self.summary or {}, self.metrics).get(name)

    # MNIST's names for the primary metric's figures, kept for the scripts that call them.
    def time_to_accuracy(self, target: float) -> tuple[float, int] | None:
        return self.time_to_target(target)

    def best_val_accuracy(self) -> float | None:
        spec = self.primary
        return self.best_logged(spec) if spec is not None else None

    def get(self, key: str) -> Any:
        return (self.summary or {}).get(key)


def load_run(folder: Path) -> Run:
    summary_path = folder / "summary.json"
    metrics_path = folder / "metrics.jsonl"
    summary = None
    with contextlib.suppress(OSError, ValueError):  # missing or cut short: the run did not finish
        loaded = json.loads(summary_path.read_text())
        summary = loaded if isinstance(loaded, dict) else None
    points: list[dict[str, Any]] = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a task killed mid-line: keep the whole lines
                point = json.loads(line)
                if isinstance(point, dict) and isinstance(point.get("time"), (int, float)):
                    points.append(point)
    return Run(folder, summary, points, _overrides(folder), _config(folder), recorded_failure(folder))


def _config(folder: Path) -> dict[str, Any]:
    """The run's resolved config (``config.yaml``), or Hydra's unresolved one, or nothing."""
    from omegaconf import OmegaConf

    for path in (folder / "config.yaml", folder / ".hydra" / "config.yaml"):
        if path.is_file():
            try:
                loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception:  # unreadable: the run is still listed, with what its summary says
                continue
            if isinstance(loaded, dict):
                return {str(k): v for k, v in loaded.items()}
    return {}
