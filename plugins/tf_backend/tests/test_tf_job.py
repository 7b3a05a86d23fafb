"""The MNIST job on TensorFlow workers, end to end: `python -m psdk run backend=tf`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import MNIST_DIR, REPO

FAST = ["transport.heartbeat_interval_s=0.2", "transport.heartbeat_timeout_s=5"]


def psdk_run(out: Path, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, PSDK_DATA_DIR=str(MNIST_DIR))
    result = subprocess.run(
        [sys.executable, "-m", "psdk", "run", "backend=tf", *args, *FAST, f"hydra.run.dir={out}"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), result.stdout


def test_the_default_job_reaches_the_accuracy_bar(tmp_path: Path) -> None:
    summary, stdout = psdk_run(tmp_path)
    assert summary["test_accuracy"] >= 0.97
    assert summary["global_step"] == 6000 and summary["workers"]["1"]["backend"] == "tf"
    assert all(w["gradients_applied"] >= 6000 / 4 for w in summary["workers"].values())
    assert stdout.strip().splitlines()[-1].startswith("psdk done: backend=tf model=mlp sync=async")


def test_sync_mode_reaches_the_same(tmp_path: Path) -> None:
    summary, _ = psdk_run(tmp_path, "sync=sync", "train.steps=3000")
    assert summary["test_accuracy"] >= 0.97
    assert summary["gradients_applied"] == 6000 and summary["gradients_dropped"] == 0


def test_softmax_regression_reaches_its_bar(tmp_path: Path) -> None:
    summary, _ = psdk_run(tmp_path, "model=softmax", "topology.num_ps=2", "train.steps=3000")
    assert summary["test_accuracy"] >= 0.91 and summary["num_ps"] == 2
