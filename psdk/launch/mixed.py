"""Scoring a mixed job's other frameworks: each evaluates the final parameters itself.

A job whose workers run different backends trains one model; the chief scores it
with its own framework, and the launcher then asks every other framework for its
score of the same final parameters (``python -m psdk evaluate``), so a summary
shows that they agree. A model with embedding tables is scored from the run's
final checkpoint, as ``params.npz`` holds none of their rows.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from psdk.errors import JobFailedError
from psdk.launch import LAUNCHED_ENV
from psdk.launch.tasks import _die_with_parent
from psdk.report.runs import forget_failure, recorded_failure

log = logging.getLogger(__name__)


def final_weights(out: Path) -> Path:
    """What holds the run's final parameters: ``params.npz``, or the checkpoints where the job had embedding
    tables (the chief's summary lists them), whose rows only a checkpoint holds (``checkpoint.final``)."""
    summary = out / "summary.json"
    tables = json.loads(summary.read_text()).get("tables") if summary.exists() else None
    checkpoints = out / "checkpoints"
    return checkpoints if tables and checkpoints.is_dir() else out / "params.npz"


def evaluate(backend: str, out: Path, common: list[str]) -> float | None:
    """The workload's primary test metric of the final parameters computed by ``backend`` (mixed jobs).

    A model with embedding tables is scored from the run's final checkpoint: ``params.npz`` holds no rows.
    """
    folder = out / "tasks" / f"evaluate-{backend}"
    command = [
        sys.executable,
        "-m",
        "psdk",
        "evaluate",
        *(a for a in common if not a.startswith("output_dir=")),
        f"output_dir={folder}",
        f"backend={backend}",
        f"weights={final_weights(out)}",
        f"hydra.run.dir={folder}",
        "hydra.job.name=evaluate",
    ]
    log.info("launcher: evaluating the final parameters with the %s backend", backend)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHED_ENV: "1"}
    forget_failure(folder)
    done = subprocess.run(command, env=env, timeout=600, preexec_fn=_die_with_parent, check=False)
    if done.returncode != 0:
        reason = recorded_failure(folder)
        raise JobFailedError(
            f"evaluating the final parameters with the {backend} backend failed" + (f": {reason}" if reason else "")
        )
    evaluation = json.loads((folder / "evaluation.json").read_text())
    head = evaluation.get("primary_metric")
    value = evaluation.get("metrics", {}).get(head) if head else None
    return float(value) if value is not None else None
