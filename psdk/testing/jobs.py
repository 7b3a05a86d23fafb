"""A whole psdk job from a test: ``python -m psdk run`` in a subprocess, with its summary back.

Backend plugins test the end-to-end MNIST job with it; a subprocess keeps the
framework (and torch or TensorFlow never both) out of the pytest process.
psdk's own suite starts its jobs from the same command line and heartbeats
(``tests/jobs.py``), so the two cannot drift apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from psdk.report.metrics import read_jsonl

HEARTBEAT_TIMEOUT_S = 5.0
"""How long a test job's task may be silent before its peers call it lost: seconds, not the default 10, so a
test that loses a task ends soon. 5 for jobs whose workers run a framework, the margin plugin jobs have always
had: a worker's heartbeat is a Python thread, sharing its interpreter with the framework's Python-side work
(imports, graph tracing) and a CI host's few cores with the other tasks. psdk's own suite, whose jobs train
numpy workers and whose loss and hang tests wait out a lost task, asks for 2 (:func:`fast_heartbeats`)."""


def fast_heartbeats(timeout_s: float = HEARTBEAT_TIMEOUT_S) -> tuple[str, ...]:
    """The overrides for heartbeats every 0.2 s, a task lost after ``timeout_s`` of silence."""
    return ("transport.heartbeat_interval_s=0.2", f"transport.heartbeat_timeout_s={timeout_s:g}")


FAST_HEARTBEATS = fast_heartbeats()
"""Heartbeats that notice a lost task in seconds, not the default tens of seconds."""


def psdk_command(*args: str, out: Path | None = None) -> list[str]:
    """``python -m psdk ARGS`` with this interpreter, writing into ``out`` (``hydra.run.dir``) when given."""
    return [sys.executable, "-m", "psdk", *args, *([f"hydra.run.dir={out}"] if out is not None else [])]


def run_job(
    out: Path, *overrides: str, data_dir: Path | None = None, timeout_s: float = 240.0, cwd: Path | None = None
) -> tuple[dict[str, Any], str]:
    """Run the job with ``overrides`` into ``out``; its ``summary.json`` and stdout.

    Fails the test (with the end of the job's output) if the job fails;
    ``data_dir`` is where MNIST is (default: ``$PSDK_DATA_DIR`` or the cache).
    """
    env = dict(os.environ)
    if data_dir is not None:
        env["PSDK_DATA_DIR"] = str(data_dir)
    done = subprocess.run(
        psdk_command("run", *overrides, *FAST_HEARTBEATS, out=out),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=cwd,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), done.stdout


def assert_every_worker_contributed(summary: dict[str, Any], *metrics_files: Path) -> None:
    """Each worker applied at least a quarter of the global steps trained once every worker was training.

    Workers start when their own process is ready, not together: a worker
    that imports its framework half a second after the chief finds hundreds
    of steps already done, so its share of the whole run measures start-up,
    not whether the ps serves workers fairly. The window starts at the
    highest global step among the workers' first logged points (each
    worker's ``metrics.jsonl`` records, every ``train.log_every`` local
    steps), so a worker the ps starves, or one that never trains, still fails.
    """
    firsts: dict[str, int] = {}
    for point in (p for path in metrics_files for p in read_jsonl(path)):
        if point["task"].startswith("worker"):
            index = point["task"].removeprefix("worker")
            firsts[index] = min(firsts.get(index, point["global_step"]), point["global_step"])
    workers = summary["workers"]
    assert set(firsts) == set(workers), f"workers with no logged step: {sorted(set(workers) - set(firsts))}"
    together = summary["global_step"] - max(firsts.values())
    for index, state in sorted(workers.items()):
        applied = state["gradients_applied"]
        assert applied >= together / 4, (
            f"worker {index} applied {applied} gradients; {together} global steps were trained after every "
            f"worker's first logged step (firsts: {firsts})"
        )
