"""Which metrics a run reports: as its summary recorded them, else as its workload declares them.

The reports (last line, curves, TensorBoard, comparisons, progress) read a
run's metrics here, so none of them names a metric: MNIST's accuracy is
whatever the MNIST workload's record says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psdk.plugins.loading import DEFAULT_WORKLOAD
from psdk.plugins.metrics import MetricSpec, specs_from_json
from psdk.plugins.registry import installed_workloads


def workload_metrics(name: str | None) -> tuple[MetricSpec, ...]:
    """The metrics the installed workload ``name`` declares (the default workload's if None); () if not installed."""
    try:
        record = installed_workloads().get(name or DEFAULT_WORKLOAD)
    except Exception:  # a broken plugin: the reports still show what the files hold
        return ()
    return tuple(record.metrics) if record is not None else ()


def run_metrics(summary: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> tuple[MetricSpec, ...]:
    """A run's metrics: as its summary recorded them, else as its config's workload declares them."""
    recorded = specs_from_json((summary or {}).get("metric_specs"))
    if recorded is not None:
        return recorded
    node = (config or {}).get("workload")
    name = node.get("name") if isinstance(node, Mapping) else None
    return workload_metrics(str(name) if name else None)


def report_target(report: Mapping[str, Any] | None, spec: MetricSpec | None, default: bool = True) -> float | None:
    """The value of the primary metric ``spec`` that comparisons time runs to.

    ``report.target`` if set, else ``report.target_<name>`` (``target_accuracy``: MNIST's,
    the name it had before workloads declared metrics), else the spec's own default
    (None with ``default=False``: only what ``report`` sets).
    """
    report = report or {}
    keys = ["target", *([f"target_{spec.name}"] if spec is not None else [])]
    for key in keys:
        value = report.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return spec.target if spec is not None and default else None
