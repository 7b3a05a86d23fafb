"""``curves.png`` drawn while the tasks wind down, so the figure costs the job almost no wall time.

matplotlib takes over half a second to import and a few tenths to draw.
The launcher has nothing to do while the job trains, so a low-priority
thread imports it then; once the chief has written ``summary.json`` every
worker's points are in ``metrics.jsonl`` (each line is one unbuffered
append), and the figure is drawn while the tasks exit. A figure is a
convenience: failing to draw it only warns.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from psdk.launch.placement import lower_thread_priority
from psdk.runtime.disks import WriteError, is_write_failure

log = logging.getLogger(__name__)

IDLE_NICE = 19
"""The import runs while the job trains: it takes only CPU nobody else wants."""


class CurvesInBackground:
    def __init__(self, out: Path):
        self.out = out
        self._draw = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="psdk-curves", daemon=True)
        self.path: Path | None = None
        self.error: Exception | None = None

    def start(self) -> None:
        self._thread.start()

    def draw(self) -> None:
        """The chief's results are written: draw now (returns at once)."""
        self._draw.set()

    def cancel(self) -> None:
        self._cancelled = True
        self._draw.set()

    def _run(self) -> None:
        try:
            lower_thread_priority(IDLE_NICE)
            from psdk.report.plot import plot_curves, warm_up
            from psdk.report.runs import load_run

            warm_up()
            self._draw.wait()
            if not self._cancelled:
                self.path = plot_curves(load_run(self.out), self.out / "curves.png")
        except Exception as exc:  # a figure must never fail the job
            self.error = exc

    def finish(self, timeout_s: float = 60.0) -> None:
        """Draw (if not begun yet), wait for the figure, and say where it is or why there is none."""
        self.draw()
        self._thread.join(timeout_s)
        if self.path is not None:
            log.info("launcher: training curves in %s", self.path)
            return
        why: object = self.error or f"not drawn within {timeout_s:.0f} s"
        if is_write_failure(self.error):  # a full or read-only disk: where, and the fix
            why = WriteError(self.error.filename or self.out / "curves.png", self.error, "hydra.run.dir")
        log.warning("launcher: could not draw the training curves (%s); `python -m psdk report %s` retries",
                    why, self.out)  # fmt: skip
