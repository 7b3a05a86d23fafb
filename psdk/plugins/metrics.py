"""The metrics a workload declares, and how the reports find a run's.

A workload names its metrics in its record (``WorkloadRecord(metrics=...)``)
so that progress lines, ``summary.json``, the job's last line, curves,
TensorBoard, sweep comparisons and ``report.target`` show what that workload
measures (accuracy for MNIST, AUC and log loss for a click-through model)
without any of them naming a metric. A metric's ``name`` is its key twice
over: in the points of ``metrics.jsonl`` (measured while training) and in the
``metrics`` mapping of ``summary.json`` (the final evaluation).

A finished run records its specs in ``summary.json`` (``metric_specs``), so
its reports read the same even where its workload's plugin is not installed
(:mod:`psdk.report.declared`). This module imports nothing of the registry:
the records import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MetricSpec:
    """One metric a workload reports.

    ``name``: the key in logged points and in ``summary.json``'s ``metrics``;
    ``label``: its words in reports (default: the name, ``_`` as spaces);
    ``short``: its words in a progress line (default: the label);
    ``higher_is_better``: the direction of a target and of "best";
    ``format``: how a value is shown (``format(value, spec.format)``);
    ``primary``: the metric ``report.target`` and comparisons judge a run by
    (one per workload; the first declared if none says so);
    ``held_out``: the logged points measure it on held-out data (a
    validation accuracy, "val acc") rather than on the training batch (a loss);
    ``target``: the primary metric's default ``report.target``, what
    comparisons time the runs to (None: no target unless one is given).
    """

    name: str
    label: str = ""
    short: str = ""
    higher_is_better: bool = True
    format: str = ".4f"
    primary: bool = False
    held_out: bool = True
    target: float | None = None

    @property
    def words(self) -> str:
        return self.label or self.name.replace("_", " ")

    @property
    def logged_words(self) -> str:
        """What a logged point's value is: "validation accuracy", or "training loss" (of the training batch)."""
        return f"validation {self.words}" if self.held_out else f"training {self.words}"

    def show(self, value: Any) -> str:
        """``value`` as the spec formats it, ``n/a`` when missing."""
        return format(float(value), self.format) if isinstance(value, (int, float)) else "n/a"

    def reached(self, value: float, target: float) -> bool:
        """``value`` is at ``target`` or beyond it, in the metric's direction."""
        return value >= target if self.higher_is_better else value <= target

    def best(self, values: Iterable[float]) -> float | None:
        values = list(values)
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)


def primary(specs: Sequence[MetricSpec]) -> MetricSpec | None:
    """The metric a workload is judged by: the one marked ``primary``, else the first declared."""
    return next((s for s in specs if s.primary), specs[0] if specs else None)


def specs_json(specs: Sequence[MetricSpec]) -> list[dict[str, Any]]:
    """The specs as ``summary.json`` records them."""
    return [asdict(s) for s in specs]


def specs_from_json(data: Any) -> tuple[MetricSpec, ...] | None:
    """Specs recorded in a summary; None if there are none or they cannot be read."""
    if not isinstance(data, list):
        return None
    with contextlib.suppress(TypeError):
        return tuple(MetricSpec(**item) for item in data if isinstance(item, dict))
    return None
