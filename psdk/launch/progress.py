"""What ``python -m psdk run`` shows while the job trains: a line per worker and per ps.

The launcher knows nothing of training by itself, and asking the tasks over
the transport would need keys and compete with the workers. So it reads what
the tasks write anyway: the workers' points in ``metrics.jsonl`` (appended
as they log) and each ps's counters in ``tasks/ps<i>.progress.json``
(rewritten atomically a few times a second, see :mod:`psdk.ps.progress`).
Both are read defensively: a file that is not there yet, a line a worker is
half-way through writing, or a file replaced by a restarted task must never
stop the job.

On a terminal the lines are redrawn in place (ANSI cursor moves); the tasks'
console output is then passed through above them, so the block stays whole.
Anywhere else (a file, a CI log) the same lines are printed every
``progress.every_s`` seconds, as plain text a log can keep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from psdk.plugins.metrics import MetricSpec
from psdk.report.declared import workload_metrics

MODES = ("auto", "live", "plain", "off")
LIVE_REFRESH_S = 0.25


def resolve_mode(mode: str, stream: IO[str]) -> str:
    """``auto`` is ``live`` on a terminal that understands cursor moves, ``plain`` elsewhere."""
    if mode not in MODES:
        from psdk.errors import ConfigError

        raise ConfigError("progress.mode", f"got {mode!r}", list(MODES))
    if mode != "auto":
        return mode
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    return "live" if is_tty and os.environ.get("TERM", "") not in ("", "dumb") else "plain"


def ps_progress_path(out: Path, index: int) -> Path:
    """Where the launcher asks ps ``index`` to keep its counters."""
    return out / "tasks" / f"ps{index}.progress.json"


class JsonlTail:
    """The JSON objects appended to a file since the last read.

    A line without its newline yet is kept for the next read; a line that is
    not JSON (a task killed mid-write) is skipped; a file that shrank was
    replaced, and is read again from its start.
    """

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not written yet, or gone: nothing new
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        points = []
        for line in lines:
            with contextlib.suppress(ValueError):
                point = json.loads(line)
                if isinstance(point, dict):
                    points.append(point)
        return points


def read_json(path: Path) -> dict[str, Any] | None:
    """A small JSON file another process rewrites, or None while it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class JobProgress:
    """The latest of every worker and ps, from the files the tasks write."""

    out: Path
    num_workers: int
    num_ps: int
    target: int
    metrics: tuple[MetricSpec, ...] | None = None  # the workload's (None: the default workload's)
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    held_out: dict[int, dict[str, float]] = field(default_factory=dict)  # each worker's last validated values
    ps: dict[int, dict[str, Any]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    first_step: float | None = None

    def __post_init__(self) -> None:
        self._tail = JsonlTail(self.out / "metrics.jsonl")
        if self.metrics is None:
            self.metrics = workload_metrics(None)

    def update(self) -> None:
        for point in self._tail.read():
            task = str(point.get("task", ""))
            if not task.startswith("worker") or not task[6:].isdigit():
                continue
            index = int(task[6:])
            self.workers[index] = point
            for spec in self.metrics or ():  # a validation comes every few points: the last one is kept
                if spec.held_out and isinstance(point.get(spec.name), (int, float)):
                    self.held_out.setdefault(index, {})[spec.name] = float(point[spec.name])
        for index in range(self.num_ps):
            counters = read_json(ps_progress_path(self.out, index))
            if counters is not None:
                self.ps[index] = counters

    def worker_line(self, index: int) -> str:
        point = self.workers.get(index)
        if point is None:
            return f"worker {index}: starting"
        validated = self.held_out.get(index, {})
        parts = [
            f"worker {index}: step {_int(point.get('local_step')):>6}",
            f"global step {_int(point.get('global_step')):>6}/{self.target}",
            *(
                f"val {spec.short or spec.words} {_num(validated.get(spec.name), spec.format)}"
                if spec.held_out
                else f"{spec.short or spec.words} {_num(point.get(spec.name), spec.format)}"
                for spec in self.metrics or ()
            ),
            f"{_num(point.get('steps_per_s'), '.0f')} steps/s",
        ]
        return " | ".join(parts)

    def ps_line(self, index: int) -> str:
        counters = self.ps.get(index)
        if counters is None:
            return f"ps {index}: starting"
        return " | ".join(
            [
                f"ps {index}: global step {_int(counters.get('version')):>6}/{counters.get('target') or self.target}",
                f"gradients applied {_int(counters.get('applied'))}",
                f"dropped {_int(counters.get('dropped'))}",
            ]
        )

    def ps_bar(self, index: int, width: int) -> str:
        """The ps line as a tqdm bar: global step against the target, with rate and time left."""
        counters = self.ps.get(index)
        if counters is None:
            return f"ps {index}: starting"
        step, target = _int(counters.get("version")), int(counters.get("target") or self.target)
        if step and self.first_step is None:
            self.first_step = time.time()  # the rate and time left count from training, not from startup
        extra = f" applied {_int(counters.get('applied'))} dropped {_int(counters.get('dropped'))}"
        meter = tqdm.format_meter(
            min(step, target),
            target,
            time.time() - (self.first_step or time.time()),
            ncols=max(40, width - len(extra)),
            prefix=f"ps {index}",
            unit="step",
        )
        return meter + extra

    def lines(self, bars: bool = False, width: int = 120) -> list[str]:
        ps = [self.ps_bar(i, width) if bars else self.ps_line(i) for i in range(self.num_ps)]
        return [*(self.worker_line(i) for i in range(self.num_workers)), *ps]


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


class PlainDisplay:
    """Progress lines printed every ``every_s`` seconds, for logs that keep every line."""

    refresh_s: float

    def __init__(self, progress: JobProgress, stream: IO[str], every_s: float):
        self.progress, self.stream = progress, stream
        self.refresh_s = max(0.05, float(every_s))

    def render(self, final: bool = False) -> None:
        elapsed = time.time() - self.progress.started
        for line in self.progress.lines():
            self.stream.write(f"progress {elapsed:6.1f}s {line}\n")
        self.stream.flush()

    def emit(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        pass


class LiveDisplay:
    """The progress lines kept at the bottom of a terminal and rewritten in place.

    Anything else written to the terminal while the display is up must go
    through :meth:`emit`, which clears the block, writes the text and draws
    the block again below it; a line wider than the terminal is cut, since
    a wrapped line would throw the cursor arithmetic off.
    """

    refresh_s = LIVE_REFRESH_S

    def __init__(self, progress: JobProgress, stream: IO[str]):
        self.progress, self.stream = progress, stream
        self.drawn = 0
        self.lock = threading.Lock()

    def _clear(self) -> str:
        return f"\x1b[{self.drawn}F\x1b[J" if self.drawn else ""

    def _block(self) -> str:
        width = shutil.get_terminal_size((120, 24)).columns - 1
        lines = [line[:width] for line in self.progress.lines(bars=True, width=width)]
        self.drawn = len(lines)
        return "".join(f"{line}\n" for line in lines)

    def render(self, final: bool = False) -> None:
        with self.lock:
            self.stream.write(self._clear() + self._block())
            self.stream.flush()

    def emit(self, text: str) -> None:
        with self.lock:
            self.stream.write(self._clear() + text + ("" if text.endswith("\n") else "\n") + self._block())
            self.stream.flush()

    def close(self) -> None:
        pass


Display = PlainDisplay | LiveDisplay


class _Through:
    """A stream for logging handlers: each whole line goes out through the display."""

    def __init__(self, display: Display):
        self.display, self.buffer = display, ""

    def write(self, text: str) -> int:
        self.buffer += text
        if "\n" in self.buffer:
            whole, self.buffer = self.buffer.rsplit("\n", 1)
            self.display.emit(whole + "\n")
        return len(text)

    def flush(self) -> None:
        pass


class ProgressMonitor:
    """A thread that refreshes the display until :meth:`stop`, and draws it a last time then.

    In live mode the launcher's own console log lines and its tasks' output
    (see :meth:`pump`) are routed through the display for as long as it runs.
    """

    def __init__(self, display: Display):
        self.display = display
        self.live = isinstance(display, LiveDisplay)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="psdk-progress", daemon=True)
        self._pumps: list[threading.Thread] = []
        self._rerouted: list[tuple[logging.StreamHandler[Any], IO[str]]] = []

    def start(self) -> ProgressMonitor:
        if self.live:
            for handler in logging.getLogger().handlers:
                if type(handler) is logging.StreamHandler and handler.stream in (sys.stdout, sys.stderr):
                    self._rerouted.append((handler, handler.setStream(_Through(self.display))))  # type: ignore[arg-type]
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.display.refresh_s):
            self._refresh()

    def _refresh(self, final: bool = False) -> None:
        try:
            self.display.progress.update()
            self.display.render(final)
        except Exception as exc:  # the display is a convenience: it never takes the job down
            logging.getLogger(__name__).debug("progress display: %s", exc)

    def pump(self, stream: IO[str]) -> None:
        """Pass a task's output through the display, line by line, until it closes."""

        def loop() -> None:
            with contextlib.suppress(OSError, ValueError):
                for line in stream:
                    self.display.emit(line)

        thread = threading.Thread(target=loop, name="psdk-progress-pump", daemon=True)
        thread.start()
        self._pumps.append(thread)

    def stop(self) -> None:
        """Stop refreshing; draw the final state (the job's last figures) once more."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for thread in self._pumps:
            thread.join(timeout=2)
        self._refresh(final=True)
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []
        self.display.close()


def make_monitor(
    mode: str,
    every_s: float,
    out: Path,
    num_workers: int,
    num_ps: int,
    target: int,
    stream: IO[str] | None = None,
    metrics: Sequence[MetricSpec] | None = None,
) -> ProgressMonitor | None:
    """A monitor for ``progress.mode`` (not started), or None when it is ``off``; ``metrics``: the workload's."""
    stream = stream or sys.stdout
    resolved = resolve_mode(mode, stream)
    if resolved == "off":
        return None
    progress = JobProgress(out, num_workers, num_ps, target, metrics=tuple(metrics) if metrics is not None else None)
    display: Display = LiveDisplay(progress, stream) if resolved == "live" else PlainDisplay(progress, stream, every_s)
    return ProgressMonitor(display)
