"""Log records that say which task wrote them, and a limiter for log floods."""

from __future__ import annotations

import logging
import time

_task_label = "psdk"


def set_task_label(label: str) -> None:
    global _task_label
    _task_label = label


def task_label() -> str:
    """Which task this process runs (``ps 0``, ``worker 1``), or ``psdk`` before it knows."""
    return _task_label


class TaskFilter(logging.Filter):
    """Adds ``%(task)s`` to every record; referenced from conf/hydra/job_logging/psdk.yaml."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.task = _task_label
        return True


class RateLimitedLog:
    """At most ``burst`` lines per ``period_s``; the rest are counted and summed up later.

    A ps that is sent garbage by the thousand must say so without drowning
    its log (or its CPU) in lines.
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, period_s: float = 60.0):
        self.logger, self.burst, self.period_s = logger, burst, period_s
        self._window_start = time.monotonic()
        self._logged = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        self._emit(logging.WARNING, message, args, with_traceback=False)

    def info(self, message: str, *args: object) -> None:
        self._emit(logging.INFO, message, args, with_traceback=False)

    def exception(self, message: str, *args: object) -> None:
        """An error with the traceback being handled, as ``Logger.exception`` but within the same limit."""
        self._emit(logging.ERROR, message, args, with_traceback=True)

    def _emit(self, level: int, message: str, args: tuple[object, ...], with_traceback: bool) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.period_s:
            if self._suppressed:
                self.logger.warning("… and %d more like these in the last %.0f s", self._suppressed, self.period_s)
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            self.logger.log(level, message, *args, exc_info=with_traceback)
        else:
            self._suppressed += 1
