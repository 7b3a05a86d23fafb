"""Which workers a ps believes alive, from the heartbeats and requests it sees.

A worker is *alive* while it has been heard from within the heartbeat
timeout, *finished* once it said so, and *dead* when it went silent (or never
showed up within the start-up timeout). Deaths are reported once, with the
reason, so the ps can log them and re-check whether a sync round can still
fill.

A finished worker leaves a small report for the chief's summary. The chief
collects the reports as it waits for the workers, and a finished worker that
says it stays (``finish`` with ``stays``) waits until it has seen its report
collected; the chief waits for that too, so no worker leaves while it is the
only one who could tell a restarted ps that it finished. A ps lost after
that is told again who finished, and what they reported, by the chief's
restore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_REPORT_CHARS = 16_384
"""A worker's report at the end, as the ps keeps it for the chief's summary (a real one is ~2 KB)."""

ALIVE, FINISHED, DEAD, UNSEEN = "alive", "finished", "dead", "unseen"


@dataclass
class WorkerState:
    status: str = UNSEEN
    last_seen: float | None = None
    reason: str = ""
    report: dict[str, Any] | None = None
    collected: bool = False
    """The chief has this worker's report (it asked for the reports after the worker finished)."""
    stays: bool = False
    """The worker said it waits until it has seen its report collected."""
    acknowledged: bool = False
    """... and it has seen it: it may go."""


class Membership:
    def __init__(self, heartbeat_timeout_s: float, startup_timeout_s: float, now: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.started = now
        self.workers: dict[int, WorkerState] = {}
        self.expected: int = 0
        self._live_key: tuple[tuple[int, str], ...] = ()
        self._live: frozenset[int] = frozenset()

    def expect(self, num_workers: int) -> None:
        """The job has ``num_workers`` workers; unseen ones are waited for until start-up times out."""
        self.expected = num_workers
        for index in range(num_workers):
            self.workers.setdefault(index, WorkerState())

    def seen(self, worker: int, now: float) -> None:
        state = self.workers.get(worker)
        if state is None:
            state = self.workers[worker] = WorkerState()
        state.last_seen = now
        if state.status in (UNSEEN, DEAD):  # the dead may come back (a restarted worker)
            state.status, state.reason = ALIVE, ""

    def forget(self, worker: int) -> None:
        """Drop a worker id that turned out not to be in the job."""
        self.workers.pop(worker, None)

    def finish(
        self, worker: int, reason: str = "", report: Any = None, collected: bool = False, stays: bool = False
    ) -> None:
        state = self.workers.setdefault(worker, WorkerState())
        state.status, state.reason, state.stays = FINISHED, reason, state.stays or stays
        if isinstance(report, dict):  # one small report per worker
            size = len(json.dumps(report))
            state.report = report if size <= MAX_REPORT_CHARS else {"report_too_large": size}
        state.collected = state.collected or collected

    def reports(self) -> dict[int, dict[str, Any]]:
        return {i: s.report for i, s in self.workers.items() if s.report is not None}

    def collect(self) -> dict[int, dict[str, Any]]:
        """The finished workers and their reports, now the chief's: each is marked collected."""
        finished = {i: s for i, s in self.workers.items() if s.status == FINISHED}
        for state in finished.values():
            state.collected = True
        return {i: s.report or {} for i, s in finished.items()}

    def collected(self) -> list[int]:
        return sorted(i for i, s in self.workers.items() if s.collected)

    def acknowledge(self, worker: int) -> None:
        """``worker`` asked after its report was collected: the answer tells it so, and it may go."""
        state = self.workers.get(worker)
        if state is not None and state.collected:
            state.acknowledged = True

    def leaving(self, now: float) -> list[int]:
        """Finished workers that stay until they have seen their report collected, and have not yet.

        One whose process is gone (silent for a heartbeat timeout) is not waited for.
        """
        return sorted(
            i
            for i, s in self.workers.items()
            if s.status == FINISHED and s.stays and not s.acknowledged and not self.gone(i, now)
        )

    def unseen_are_dead_after(self, now: float, limit_s: float) -> None:
        """A restored shard: a worker of the job that does not show up within ``limit_s`` is dead.

        A live worker's heartbeats reach a restarted ps within an interval; the
        start-up timeout is for a job's first start, and a worker that ended
        while the ps was down must not be waited for that long.
        """
        self.started, self.startup_timeout_s = now, limit_s

    def rejoin(self, worker: int) -> None:
        """A new process of a worker that finished (early) trains again: it is alive, not finished."""
        state = self.workers.get(worker)
        if state is not None and state.status == FINISHED:
            state.status, state.reason, state.report = ALIVE, "", None
            state.collected = state.stays = state.acknowledged = False

    def departed(self) -> str:
        """The workers that will push no more, and why, for an error that must name them."""
        gone = [
            f"worker {i} {'finished' if s.status == FINISHED else 'is dead'}{f' ({s.reason})' if s.reason else ''}"
            for i, s in sorted(self.workers.items())
            if s.status in (FINISHED, DEAD)
        ]
        return "; ".join(gone) or "no worker has left"

    def check(self, now: float) -> list[tuple[int, str]]:
        """Newly dead workers with the reason, each reported once."""
        newly_dead = []
        for index, state in sorted(self.workers.items()):
            if state.status == ALIVE and state.last_seen is not None:
                silent = now - state.last_seen
                if silent > self.heartbeat_timeout_s:
                    state.status, state.reason = DEAD, f"no heartbeat for {silent:.1f} s"
                    newly_dead.append((index, state.reason))
            elif state.status == UNSEEN and now - self.started > self.startup_timeout_s:
                state.status = DEAD
                state.reason = f"never connected within {self.startup_timeout_s:.0f} s"
                newly_dead.append((index, state.reason))
        return newly_dead

    def silent_for(self, worker: int, now: float) -> float | None:
        """Seconds since ``worker`` was last heard from, whatever its status; ``None`` if never."""
        state = self.workers.get(worker)
        return None if state is None or state.last_seen is None else now - state.last_seen

    def gone(self, worker: int, now: float) -> bool:
        """Whether a new process may take ``worker``'s place: it is dead, or it finished and then went silent.

        A finished worker is no longer watched for deaths, but one silent for a
        whole heartbeat timeout has no process behind it any more; a chief
        lost between its training and its results must be able to come back.
        """
        state = self.workers.get(worker)
        if state is None or state.status == DEAD:
            return state is not None
        silent = self.silent_for(worker, now)
        return state.status == FINISHED and silent is not None and silent > self.heartbeat_timeout_s

    def live(self) -> frozenset[int]:
        """Workers that may still push: alive, or not yet seen but still expected."""
        statuses = tuple((i, s.status) for i, s in self.workers.items())
        if statuses != self._live_key:  # asked on every push: rebuilt only when a status changed
            self._live_key = statuses
            self._live = frozenset(i for i, status in statuses if status in (ALIVE, UNSEEN))
        return self._live

    def status(self, worker: int) -> str:
        state = self.workers.get(worker)
        return state.status if state else UNSEEN

    def summary(self) -> dict[str, dict[str, str]]:
        return {str(i): {"status": s.status, "reason": s.reason} for i, s in self.workers.items()}
