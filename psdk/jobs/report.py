"""What a worker tells the ps about itself when it finishes: the chief's ``summary.json`` gathers these.

Its own module so the training loop (:mod:`psdk.jobs.worker`) stays about training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psdk.jobs.summary import test_fields
from psdk.jobs.timesplit import worker_split


@dataclass
class WorkerReport:
    """What a worker tells the ps about itself when it finishes."""

    backend: str
    device: str
    devices: list[str] = field(default_factory=list)
    """Every device it drove (one per tower); ``device`` is the first, where gradients were averaged."""
    local_steps: int = 0
    pushed: int = 0
    last_loss: float | None = None
    last_validation: dict[str, float] = field(default_factory=dict)
    train_time_s: float = 0.0
    shard_passes: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    divergence: dict[str, Any] | None = None
    computed: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    wait_s: float = 0.0
    test_metrics: dict[str, float] = field(default_factory=dict)
    parts_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the training loop (``loop``) and of its parts (:mod:`psdk.jobs.timesplit`)."""

    def time_per_step(self) -> dict[str, float | None]:
        """Where a step's time goes: computing the gradient (wall and this thread's CPU), waiting for the ps.

        A gradient computed between round trips can cost more CPU than the
        same computation back to back (caches the I/O evicted): compare
        ``compute_cpu_ms`` with a single-process run.
        """

        def per_step(seconds: float, count: int) -> float | None:
            return round(1000.0 * seconds / count, 3) if count else None

        return {
            "compute_ms": per_step(self.compute_s, self.computed),
            "compute_cpu_ms": per_step(self.compute_cpu_s, self.computed),
            "wait_ms": per_step(self.wait_s, self.local_steps),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "recoveries": self.recoveries,
            "divergence": self.divergence,
            "backend": self.backend,
            "device": self.device,
            "devices": self.devices or [self.device],
            "local_steps": self.local_steps,
            "gradients_pushed": self.pushed,
            "last_loss": self.last_loss,
            "last_validation": self.last_validation,
            "train_time_s": round(self.train_time_s, 3),
            "shard_passes": self.shard_passes,
            "time_per_step": self.time_per_step(),
            "time_split": worker_split(self.parts_s, self.local_steps),
            **test_fields(self.test_metrics),  # each also as test_<name>: MNIST's "test_accuracy", which scripts read
        }
