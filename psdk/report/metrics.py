"""The run's records: ``metrics.jsonl`` (one object a logged point) and ``summary.json``."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from psdk.plugins.metrics import MetricSpec, primary
from psdk.ps.consistency import SyncSpec
from psdk.report.declared import run_metrics
from psdk.runtime.disks import WriteError, is_write_failure, naming

log = logging.getLogger(__name__)


class RecordSink(Protocol):
    """Somewhere else a logged point goes (TensorBoard event files, ...)."""

    def write(self, point: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Appends JSON lines; several tasks may share one file.

    Each line goes out in one ``write`` on an ``O_APPEND`` descriptor, so
    lines from different processes never interleave. Each point also goes to
    ``sinks``.

    A disk that refuses a point (full, read-only) does not stop training:
    the first refusal is a warning naming the file and the fix (``key``, the
    setting that placed it), later points are tried and counted, and the
    count is logged once the disk takes them again or the log closes. The
    results at the job's end decide whether the run failed.
    """

    def __init__(self, path: Path | str, sinks: Sequence[RecordSink] = (), key: str = "hydra.run.dir"):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.key = key
        self.sinks = list(sinks)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.dropped = 0  # points the disk refused since it last took one
        self._torn = False  # the last line was cut short: the next starts on a line of its own

    def write(self, record: Mapping[str, Any]) -> None:
        line = ("\n" if self._torn else "") + json.dumps(record, separators=(",", ":")) + "\n"
        try:
            written = os.write(self._fd, line.encode())
            self._torn = written < len(line.encode())
            if self._torn:  # a full disk took part of it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            for sink in self.sinks:
                sink.write(record)
        except OSError as exc:
            if not is_write_failure(exc):
                raise
            self._refused(naming(exc.filename or self.path, exc))
            return
        if self.dropped:
            log.warning("%s is written again; %d point(s) were not", self.path, self.dropped)
            self.dropped = 0

    def _refused(self, exc: OSError) -> None:
        if not self.dropped:
            log.warning("points not written (training goes on): %s", WriteError(exc.filename, exc, self.key))
        self.dropped += 1

    def close(self) -> None:
        if self.dropped:
            log.warning("%d point(s) were not written to %s: the disk refused them", self.dropped, self.path)
            self.dropped = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` so a reader never sees half a file; a failed write leaves none behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise naming(path, exc) from None


def percentile(histogram: Mapping[str, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a {value: count} histogram."""
    items = sorted((int(k), v) for k, v in histogram.items())
    total = sum(v for _, v in items)
    if not total:
        return None
    rank, seen = q * (total - 1), 0
    for value, count in items:
        seen += count
        if seen > rank:
            return float(value)
    return float(items[-1][0])


def final_metrics(summary: Mapping[str, Any], specs: Sequence[MetricSpec]) -> dict[str, Any]:
    """A summary's final evaluation by metric name: its ``metrics``, else (a summary from before they were
    recorded) each declared metric's ``test_<name>`` figure."""
    recorded = summary.get("metrics")
    if isinstance(recorded, Mapping):
        return dict(recorded)
    return {s.name: summary[f"test_{s.name}"] for s in specs if summary.get(f"test_{s.name}") is not None}


def _evaluated(summary: Mapping[str, Any]) -> str:
    """The final metrics as the last line shows them: ``test accuracy 0.9731``, the primary's per backend."""
    specs = run_metrics(summary, None)
    values = final_metrics(summary, specs)
    shown = [s for s in specs if s.name in values]
    head = primary(specs)
    if not shown:
        return f"test {head.words if head is not None else 'metrics'} n/a"
    parts = []
    for spec in shown:
        part = f"test {spec.words} {spec.show(values[spec.name])}"
        if spec is head:
            part += _by_backend(summary, spec)
        parts.append(part)
    return ", ".join(parts)


def _by_backend(summary: Mapping[str, Any], spec: MetricSpec) -> str:
    by_backend = summary.get(f"test_{spec.name}_by_backend") or {}
    if len(by_backend) < 2:
        return ""
    return " (" + ", ".join(f"{name} {spec.show(value)}" for name, value in sorted(by_backend.items())) + ")"


def _training(summary: Mapping[str, Any]) -> str:
    training = summary.get("training_s")
    return f" (training {float(training):.1f} s)" if training is not None else ""


def summary_line(summary: Mapping[str, Any]) -> str:
    """The one line a run ends with."""
    sync = summary.get("sync", {})
    mode = str(sync.get("mode", "?"))
    if SyncSpec.mode_waits_for_rounds(mode):
        mode += f"(replicas_to_aggregate={sync.get('replicas_to_aggregate')})"
    rate = summary.get("global_steps_per_s")
    parts = [
        f"psdk done: backend={summary.get('backend')} model={summary.get('model')} sync={mode} "
        f"ps={summary.get('num_ps')} workers={summary.get('num_workers')}",
        f"global step {summary.get('global_step')}",
        _evaluated(summary),
        f"{rate:.0f} global steps/s" if rate else "global steps/s n/a",
        f"wall {float(summary.get('wall_s') or 0):.1f} s" + _training(summary),
        f"gradients applied {summary.get('gradients_applied')}, dropped {summary.get('gradients_dropped')}",
    ]
    for name, table in sorted((summary.get("tables") or {}).items()):
        parts.append(
            f"table {name}: {table.get('rows')} rows held, {table.get('created')} created, "
            f"{table.get('evicted')} evicted, {table.get('bytes_per_row')} bytes/row"
        )
    divergence = summary.get("divergence")
    if divergence:
        parts.append(f"DIVERGED at global step {divergence.get('global_step')} (the log says why)")
    recoveries = summary.get("recoveries") or []
    if recoveries:
        parts.append(f"a lost ps restored {len(recoveries)}x, {summary.get('global_steps_lost', 0)} global steps lost")
    return " | ".join(parts)
