"""Telling a job that diverged from one that trains, and saying why, while it runs.

An async job whose recipe overshoots does not fail: its loss goes NaN, or
it settles at or above where it started (dead ReLUs, a constant guess) and
the job reports chance accuracy as if all were well. A worker watches its
own loss: non-finite at any step, or, once the job is 10% through its
steps, a recent mean that has not fallen 2% below the mean of its first
steps (unless those first steps came late, from a partly trained model: a
resumed job, a restarted worker, or a worker that started after the others
on a busy host). Either
is reported once, in the log and in the worker's report (the summary's
``divergence``), with the likely cause and the settings to change.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

START_STEPS = 20
"""Losses averaged into the starting level."""
RECENT_STEPS = 50
"""Losses averaged into the recent level."""
CHECK_AFTER = 0.10
"""The fraction of the job's global steps after which a loss above its start means divergence."""
JOINED_LATE = CHECK_AFTER / 2
"""A worker whose first step comes past this fraction of the job starts from a partly trained model.

Its starting level is then too close to the loss at :data:`CHECK_AFTER` to
tell a stalled job by: measured, one of 8 async workers on 2 ps whose
processes started late on a loaded 2-core host was reported diverged at
test accuracy 0.975, as the others had trained the model through most of
its fast early fall before its first 20 steps."""
FALLEN = 0.98
"""A loss that has not fallen below this fraction of its starting level has not moved (a constant guess)."""


@dataclass
class DivergenceWatch:
    """One worker's losses, checked as they come; :attr:`verdict` once it diverged."""

    target_steps: int
    num_workers: int
    lr: float
    momentum: float
    mode: str
    start: list[float] = field(default_factory=list)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    verdict: dict[str, Any] | None = None
    joined_late: bool = False
    """Its first loss came past :data:`JOINED_LATE` of the job (a resumed job, a restarted worker, a late
    starter): only a non-finite loss counts, as its starting level is already a partly trained model's."""

    def observe(self, loss: float, global_step: int) -> dict[str, Any] | None:
        """Take one step's loss; the verdict the first time the job is seen to diverge, else ``None``."""
        if self.verdict is not None:
            return None
        if not math.isfinite(loss):
            return self._diverged(global_step, f"the loss became {loss}")
        if len(self.start) < START_STEPS:
            if not self.start and global_step >= JOINED_LATE * self.target_steps:
                self.joined_late = True
            self.start.append(loss)
            return None
        if self.joined_late:  # its first losses are a trained model's: they need not fall by 2% any more
            return None
        self.recent.append(loss)
        if global_step < CHECK_AFTER * self.target_steps or len(self.recent) < RECENT_STEPS:
            return None
        started, now = sum(self.start) / len(self.start), sum(self.recent) / len(self.recent)
        if now < FALLEN * started:
            return None
        return self._diverged(
            global_step,
            f"the loss (mean {now:.4f} over the last {RECENT_STEPS} steps) is still at or above its starting level "
            f"({started:.4f}) {global_step / self.target_steps:.0%} of the way through the job",
        )

    def _diverged(self, global_step: int, what: str) -> dict[str, Any]:
        self.verdict = {"global_step": global_step, "what": what, "cause": self.likely_cause()}
        return self.verdict

    def likely_cause(self) -> str:
        """What most likely made it diverge, and the settings to change."""
        if self.mode != "sync" and self.num_workers > 2:
            implicit = 1.0 - 1.0 / self.num_workers
            return (
                f"the step is too large for {self.num_workers} async workers: asynchrony adds momentum of about "
                f"1 - 1/{self.num_workers} = {implicit:.2f} to optimizer.momentum={self.momentum:g} (Mitliagkas et "
                f"al. 2016). Lower optimizer.lr (now {self.lr:g}) or optimizer.momentum, keep "
                "sync.scale_momentum=true, or use sync=sync"
            )
        return (
            f"the step is too large: lower optimizer.lr (now {self.lr:g}) or optimizer.momentum (now {self.momentum:g})"
        )

    def message(self) -> str:
        assert self.verdict is not None
        return (
            f"training diverged at global step {self.verdict['global_step']}: {self.verdict['what']}. "
            f"Likely cause: {self.verdict['cause']}"
        )
