"""Running real psdk jobs as subprocesses, and reading what they leave behind.

The command line and the heartbeats come from the shipped helper (:mod:`psdk.testing.jobs`, which plugin
tests use): this module adds what only psdk's own suite needs (jobs in the background, killing a task at
measured progress, reading the files a job leaves).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from psdk.testing.jobs import fast_heartbeats, psdk_command

from .conftest import MNIST_DIR, REPO

FAST_FLAGS = [
    # 2 s, not the shipped 5 s: every job here trains numpy workers, whose heartbeat thread no framework
    # holds off, and the loss and hang tests wait out a lost task (test_hangs' stall timeouts of 3.5 s
    # must stay above it).
    *fast_heartbeats(timeout_s=2),
    "train.log_every=20",
    "train.final_wait_s=30",
]


def env() -> dict[str, str]:
    return dict(os.environ, PSDK_DATA_DIR=str(MNIST_DIR), PYTHONUNBUFFERED="1")


def psdk(*args: str, out: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        psdk_command(*args, out=out),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=REPO,
    )


def _interruptible() -> None:
    """Ctrl-C reaches a job as it does from a terminal, even when the tests run in a background job of a
    non-interactive shell, which starts with SIGINT ignored (and Python keeps an inherited SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str, out: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        psdk_command(*args, out=out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env(), **(extra_env or {})),
        cwd=REPO,
        preexec_fn=_interruptible,
    )


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[str], timeout: float = 60) -> None:
    """Poll ``condition``, failing fast if the job ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(
                f"the job ended before the condition held:\n{process.stdout.read() if process.stdout else ''}"
            )
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold in time")
        time.sleep(0.02)


def kill_task_when(
    job: subprocess.Popen[str], out: Path, victim: str, ready: Callable[[], bool], timeout: float
) -> str:
    """SIGKILL task ``victim`` (``worker1``, ``ps0``...) of ``job`` once ``ready()`` holds; the job's output.

    Kills are injected at measured progress, never after a sleep; the job is
    killed whatever happens, so a failing test leaves no cluster behind.
    """
    try:
        wait_for(ready, job)
        os.kill(pid_of(out, victim), signal.SIGKILL)
        return job.communicate(timeout=timeout)[0]
    finally:
        job.kill()


def progress_of(out: Path, task: str) -> int:
    return max((r["local_step"] for r in records(out) if r["task"] == task), default=0)


def pid_of(out: Path, name: str) -> int:
    return int((out / "tasks" / f"{name}.pid").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


def all_tasks_gone(out: Path, timeout: float = 15) -> bool:
    pids = [int(p.read_text()) for p in (out / "tasks").glob("*.pid")]
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGKILL)
            return False
        time.sleep(0.05)
    return True


def test_accuracy(params_file: Path) -> float:
    """Accuracy of saved parameters on the MNIST test set, computed here in plain numpy."""
    raw_x = gzip.decompress((MNIST_DIR / "t10k-images-idx3-ubyte.gz").read_bytes())
    raw_y = gzip.decompress((MNIST_DIR / "t10k-labels-idx1-ubyte.gz").read_bytes())
    x = np.frombuffer(raw_x, np.uint8, offset=16).reshape(-1, 784).astype(np.float32) / 255.0
    y = np.frombuffer(raw_y, np.uint8, offset=8)
    params = np.load(params_file)
    layers = sorted({k.split("/")[0] for k in params.files if k != "logits/kernel" and k.startswith("hidden")})
    h = x
    for name in layers:
        h = np.maximum(h @ params[f"{name}/kernel"] + params[f"{name}/bias"], 0)
    logits = h @ params["logits/kernel"] + params["logits/bias"]
    return float(np.mean(np.argmax(logits, axis=1) == y))


test_accuracy.__test__ = False  # type: ignore[attr-defined]
