"""What a ps shard counts: gradients by outcome and worker, and every request it answered or dropped.

The request counters are the ps's half of an invariant the stateful fuzzer
checks after every step: each request received is answered exactly once,
waits (parked) to be answered, or is dropped and counted, so
``requests == sum(replies) + unanswerable + parked``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

STALENESS_CAP = 256
"""Staleness counted exactly below this; at or above it, in one bucket (so a worker cannot grow the histogram)."""


@dataclass
class WorkerCounters:
    pushed: int = 0
    applied: int = 0
    dropped: int = 0
    refused: int = 0
    """Gradients refused because applying them would have made the store NaN or Inf."""
    staleness: Counter[int] = field(default_factory=Counter)
    last_seq: int = -1

    def record_staleness(self, staleness: int) -> None:
        self.staleness[min(staleness, STALENESS_CAP)] += 1


@dataclass
class ShardStats:
    applied: int = 0
    dropped: int = 0
    rejected: int = 0
    """Requests refused with an error reply (malformed, not allowed, or refused by a check)."""
    refused: int = 0
    """Gradients (or sync rounds) refused because they would have made the store non-finite."""
    updates: int = 0
    first_update: float | None = None
    last_update: float | None = None
    requests: int = 0
    """Every request taken in: messages, and knocks standing for one."""
    handled: int = 0
    """Requests whose handling is over (equal to ``requests`` whenever the ps waits for the next one)."""
    replies: Counter[str] = field(default_factory=Counter)
    """Replies by their op (a reply through a doorbell counts as ``params``)."""
    unanswerable: int = 0
    """Requests dropped without a reply: too malformed to carry a request id."""
    workers: dict[int, WorkerCounters] = field(default_factory=dict)
    timed_pushes: int = 0
    """Pushes handed to the update (``index_s`` and ``apply_s`` are theirs)."""
    index_s: float = 0.0
    """Wall seconds of the pushes' id checks and of the rows their replies pulled (lookup, creation)."""
    apply_s: float = 0.0
    """Wall seconds of the updates: the rule, and finding the pushed rows (:meth:`time_per_push` splits it)."""

    def time_per_push(self, find_s: float) -> dict[str, float | int]:
        """ms per push of the index (checks, lookups, creation) and of the rule; ``find_s``: the index's part
        of ``apply_s`` (the tables' ``find_s``)."""
        count = self.timed_pushes

        def per(seconds: float) -> float:
            return round(1000.0 * seconds / count, 4) if count else 0.0

        return {
            "pushes": count,
            "index_ms": per(self.index_s + find_s),
            "rule_ms": per(max(self.apply_s - find_s, 0.0)),
        }

    def worker(self, index: int) -> WorkerCounters:
        counters = self.workers.get(index)
        if counters is None:
            counters = self.workers[index] = WorkerCounters()
        return counters

    def to_json(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "refused": self.refused,
            "updates": self.updates,
            "first_update": self.first_update,
            "last_update": self.last_update,
            "requests": self.requests,
            "handled": self.handled,
            "replies": dict(sorted(self.replies.items())),
            "unanswerable": self.unanswerable,
            "workers": {
                str(i): {
                    "pushed": c.pushed,
                    "applied": c.applied,
                    "dropped": c.dropped,
                    "refused": c.refused,
                    "staleness": {str(k): v for k, v in sorted(c.staleness.items())},
                }
                for i, c in sorted(self.workers.items())
            },
        }
