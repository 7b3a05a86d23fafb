"""What the chief writes when the job ends: ``summary.json``, ``params.npz``, the last line."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from omegaconf import DictConfig

from psdk.config import build
from psdk.jobs.timesplit import job_split
from psdk.plugins.loading import workload_of
from psdk.plugins.metrics import MetricSpec, primary, specs_json
from psdk.report.metrics import percentile
from psdk.runtime.disks import naming


def save_params(path: Path, params: Mapping[str, np.ndarray]) -> None:
    """The final parameters by canonical name, loadable with ``np.load`` (no pickle).

    Written to a temporary file and renamed: a full disk leaves no half
    ``params.npz`` that ``evaluate`` would later choke on.
    """
    arrays: dict[str, Any] = {name: np.array(value) for name, value in params.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            cast(Any, np.savez)(f, **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise naming(path, exc) from None


def _worker_entry(
    index: str, state: Mapping[str, str], counters: Mapping[str, Any], report: Mapping[str, Any]
) -> dict[str, Any]:
    hist = counters.get("staleness", {})
    entry: dict[str, Any] = {
        "status": state["status"],
        "reason": state["reason"],
        "gradients_pushed": counters.get("pushed", 0),
    }
    entry.update(report)
    entry.update(
        {
            "gradients_applied": counters.get("applied", 0),
            "gradients_dropped": counters.get("dropped", 0),
            "gradients_refused": counters.get("refused", 0),
            "staleness_p50": percentile(hist, 0.5),
            "staleness_p99": percentile(hist, 0.99),
            "staleness_histogram": hist,
        }
    )
    return entry


def build_summary(
    cfg: DictConfig,
    shards: list[dict[str, Any]],
    workers: Mapping[str, Mapping[str, str]],
    metrics: Mapping[str, float | None],
    wall_s: float,
    backend: str,
) -> dict[str, Any]:
    """The run's figures, from shard 0's statistics (it keeps the global step), and what the config says.

    ``metrics``: the workload's final evaluation by metric name, as its
    record declares them (:func:`metric_fields`). The primary one is also
    ``test_<name>``, and by backend ``test_<name>_by_backend`` (which the
    launcher fills for each backend of a mixed job): MNIST's ``test_accuracy``
    and ``test_accuracy_by_backend``, the names scripts and benchmarks read.
    """
    summary = ps_summary(shards, workers, wall_s, backend)
    summary.update(metric_fields(metrics, workload_of(cfg).metrics))
    head = summary["primary_metric"]
    if head is not None:
        value = metrics.get(head)
        summary[f"test_{head}"] = value
        summary[f"test_{head}_by_backend"] = {backend: value} if value is not None else {}
    summary.update(
        {
            "model": str(cfg.model.name),
            "optimizer": build.plain(cfg.optimizer),
            "steps": int(cfg.train.steps),
            "train_epochs": cfg.train.get("epochs"),  # the epochs asked for (null: train.steps was), psdk.jobs.epochs
            "batch_size": int(cfg.train.batch_size),
            "resumed_from": str(cfg.resume) if cfg.resume else None,
        }
    )
    return summary


def test_fields(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Test metrics as a report or evaluation carries them: whole, and each as ``test_<name>`` (``test_accuracy``)."""
    return {"test_metrics": dict(metrics), **{f"test_{name}": value for name, value in metrics.items()}}


def metric_fields(metrics: Mapping[str, float | None], specs: Sequence[MetricSpec]) -> dict[str, Any]:
    """``summary.json``'s metrics: the values by name, the primary's name, and the specs the reports read."""
    head = primary(specs)
    return {
        "metrics": {name: None if value is None else float(value) for name, value in metrics.items()},
        "primary_metric": head.name if head is not None else None,
        "metric_specs": specs_json(specs),
    }


def ps_summary(
    shards: list[dict[str, Any]],
    workers: Mapping[str, Mapping[str, str]],
    wall_s: float,
    backend: str | None,
) -> dict[str, Any]:
    """The figures of ``summary.json`` the ps statistics hold: the built-in job's and a script's alike.

    A workload's final metrics are added by the caller (:func:`metric_fields`).

    ``shards``: every ps's statistics (:meth:`ParameterClient.stats`);
    ``workers``: each worker's state, as the chief's ``finish()`` returns it.
    """
    head = shards[0]
    stats = head["stats"]
    first, last = stats.get("first_update"), stats.get("last_update")
    # Updates applied in this run (a resumed job starts at the checkpoint's step).
    rate = stats["updates"] / (last - first) if first is not None and last is not None and last > first else None
    per_worker = {
        index: _worker_entry(index, state, stats["workers"].get(index, {}), head["reports"].get(index, {}))
        for index, state in sorted(workers.items(), key=lambda kv: int(kv[0]))
    }
    named = {backend} if backend else set()
    backends = sorted({str(w.get("backend")) for w in per_worker.values() if w.get("backend")} | named)
    job = head["job"] or {}
    return {
        "backend": backend if len(backends) <= 1 else "+".join(backends),
        "backends": backends,
        "sync": job.get("sync", {}),
        "num_ps": len(shards),
        "num_workers": len(workers),
        "steps": job.get("steps"),
        "global_step": int(head["version"]),
        "gradients_applied": stats["applied"],
        "gradients_dropped": stats["dropped"],
        "gradients_refused": stats.get("refused", 0),
        "global_steps_per_s": rate,
        # Training time as the ps saw it: its first applied update to its last (start-up and wrap-up excluded).
        "training_s": last - first if first is not None and last is not None else None,
        "training_began": first,  # wall-clock time of that first update
        "wall_s": wall_s,
        "workers": per_worker,
        "recoveries": per_worker.get("0", {}).get("recoveries", []),
        "ps": [
            {
                "task": s["task"],
                "version": s["version"],
                "size": s["size"],
                "variables": s["variables"],
                "applied": s["stats"]["applied"],
                "dropped": s["stats"]["dropped"],
                "rejected": s["stats"]["rejected"],
                "max_rss_mb": s.get("process", {}).get("max_rss_mb"),
                "tables": s.get("tables") or {},
                "time_per_push": s.get("time_per_push") or {},
            }
            for s in shards
        ],
        "tables": table_totals(shards),
        "time_split": job_split(per_worker, shards),
    }


def table_totals(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each embedding table over every ps: rows held, created, evicted and dropped, summed; bytes per row
    (rows and slots) as the ps counts it."""
    totals: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for name, stats in (shard.get("tables") or {}).items():
            entry = totals.setdefault(name, {"rows": 0, "created": 0, "evicted": 0, "dropped_rows": 0})
            for key in ("rows", "created", "evicted", "dropped_rows"):
                entry[key] += int(stats.get(key) or 0)
            entry["bytes_per_row"] = stats.get("bytes_per_row")
    return totals
