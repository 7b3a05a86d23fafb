"""Scalar summaries from your own training loop: ``tf.summary.FileWriter`` and ``tf.summary.scalar``, psdk's way.

::

    with psdk.SummaryWriter("logs", task_index=session.task_index) as writer:
        while not session.should_stop():
            ...
            writer.scalar("loss", loss, session.global_step)
        session.finish()
        if session.is_chief:
            writer.write_summary(session, test_accuracy=accuracy)   # summary.json and curves.png

A writer leaves in ``logdir`` what the built-in job leaves in its run folder,
so the same tools read both: TensorBoard event files
(``tensorboard/worker<i>/``), every point in ``metrics.jsonl``, and at the end
``summary.json`` and ``curves.png`` (``python -m psdk report logdir`` draws
it again). The workers of one job may share ``logdir``: each line of
``metrics.jsonl`` is one append, and each worker has its own event folder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from psdk.errors import PsdkError
from psdk.plugins.metrics import MetricSpec
from psdk.report.metrics import MetricsLog, write_json_atomic
from psdk.report.tensorboard import EventWriter

if TYPE_CHECKING:
    from psdk.api import WorkerSession

log = logging.getLogger(__name__)


class SummaryWriter:
    """Scalars of one worker into ``logdir``: TensorBoard events and ``metrics.jsonl``; the run's summary at the end."""

    def __init__(self, logdir: Path | str, task_index: int = 0):
        self.logdir = Path(logdir)
        self.task_index = int(task_index)
        self.task = f"worker{self.task_index}"
        self.started = time.time()
        self.events = EventWriter(self.logdir / "tensorboard" / self.task)
        self.metrics = MetricsLog(self.logdir / "metrics.jsonl")
        self._closed = False

    def scalar(self, name: str, value: float, step: int) -> None:
        """One scalar at global step ``step``, as ``tf.summary.scalar`` + ``FileWriter.add_summary``."""
        self.scalars({name: value}, step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Several scalars at global step ``step``: one event, one line of ``metrics.jsonl``."""
        if self._closed:
            raise PsdkError(f"SummaryWriter({self.logdir}) is closed")
        numbers = {name: _number(name, value) for name, value in values.items()}
        if not numbers:
            return
        now = time.time()
        self.events.scalars(int(step), numbers, now)
        point: dict[str, Any] = {"task": self.task, "global_step": int(step), "time": round(now, 3)}
        point["wall_s"] = round(now - self.started, 3)
        point.update(numbers)
        self.metrics.write(point)

    def flush(self) -> None:
        """Nothing to do: every event and line is written as it comes (kept for ``FileWriter``'s users)."""

    def write_summary(
        self,
        session: WorkerSession | None = None,
        *,
        test_accuracy: float | None = None,
        metrics: Mapping[str, float] | None = None,
        metric_specs: Sequence[MetricSpec] = (),
        plot: bool = True,
        **extra: Any,
    ) -> dict[str, Any]:
        """The chief, after ``session.finish()``: write ``summary.json`` and ``curves.png`` into ``logdir``.

        With the ``session`` (still open: the ps tasks serve until it
        closes), ``summary.json`` holds what the built-in job's does of the
        ps's figures: global step, gradients applied and dropped, global
        steps/s, training time, sync mode, each worker's state and staleness.
        ``test_accuracy`` (MNIST's name) and ``extra`` (``model="softmax"``,
        ...) are added. ``metrics``: the final evaluation by name, as a
        workload's summary has it, with ``metric_specs`` saying what each is
        (undeclared names: higher is better, the first primary).
        ``curves.png`` draws each worker's scalars of the declared metrics
        (none declared: the default workload's, ``loss`` and ``accuracy``;
        ``plot=False``: no figure); a figure that cannot be drawn only warns.
        Returns the summary.
        """
        from psdk.jobs.summary import metric_fields, ps_summary

        summary: dict[str, Any] = {"wall_s": time.time() - self.started}
        if session is not None:
            client = session.client
            stats = client.wrapping_up(client.stats, "reading the ps statistics")
            summary = ps_summary(stats, stats[0]["workers"], summary["wall_s"], None)
            summary["run_id"] = session.run_id
            summary["rule_applied"] = dict(client.rule_json)
            summary["recoveries"] = list(client.recoveries)
        summary["test_accuracy"] = test_accuracy
        if metrics is not None or metric_specs:
            declared = {s.name for s in metric_specs}
            undeclared = tuple(MetricSpec(name) for name in metrics or {} if name not in declared)
            summary.update(metric_fields(metrics or {}, (*metric_specs, *undeclared)))
        summary.update(extra)
        self.logdir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.logdir / "summary.json", summary)
        log.info("%s: summary.json written to %s", self.task, self.logdir)
        if plot:
            self.plot()
        return summary

    def plot(self) -> Path | None:
        """``curves.png`` in ``logdir`` from every worker's points so far; None (with a warning) if not drawn."""
        try:
            from psdk.report.plot import plot_curves
            from psdk.report.runs import load_run

            path = plot_curves(load_run(self.logdir), self.logdir / "curves.png")
        except Exception as exc:  # a figure must never fail the job
            log.warning("%s: could not draw curves.png in %s (%s)", self.task, self.logdir, exc)
            return None
        log.info("%s: training curves in %s", self.task, path)
        return path

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.events.close()
            self.metrics.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _number(name: object, value: Any) -> float:
    """A scalar as a float: a Python or numpy number, or a one-element tensor (``.item()``)."""
    if not isinstance(name, str) or not name:
        raise PsdkError(f"a summary needs a name (a non-empty string), got {name!r}")
    item = getattr(value, "item", None)
    try:
        number = float(item() if callable(item) else value)
    except (TypeError, ValueError):
        raise PsdkError(f"summary {name!r}: {value!r} is no scalar number") from None
    return number
