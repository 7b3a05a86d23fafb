"""``workload=sines`` through ``python -m psdk run``: it trains on each framework, and mixed.

Each job is a subprocess (torch, TensorFlow and JAX never share one
process). The bound, a test mean squared error under 0.1, is a tenth of the
variance of y (about 1.01: predicting 0) and well under a linear fit's 0.68;
these jobs reach about 0.03-0.05 (0.02 with 3000 steps, the plugin's README).
A framework that is missing is skipped, unless ``PSDK_NO_SKIP`` is set.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from psdk.testing import run_job

FRAMEWORKS = {"numpy": None, "torch": "torch", "tf": "tensorflow", "jax": "jax"}
RECIPE = ("workload=sines", "model=regressor", "optimizer.lr=0.02", "report.plot=false", "progress.mode=off")
BOUND = 0.1


def needs(*backends: str) -> None:
    missing = [
        FRAMEWORKS[b] for b in backends if FRAMEWORKS[b] and importlib.util.find_spec(str(FRAMEWORKS[b])) is None
    ]
    if missing and os.environ.get("PSDK_NO_SKIP"):
        pytest.fail(f"PSDK_NO_SKIP is set but {', '.join(map(str, missing))} is not installed")
    if missing:
        pytest.skip(f"{', '.join(map(str, missing))} not installed")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", sorted(FRAMEWORKS))
def test_it_trains_on_each_framework(backend: str, tmp_path: Path) -> None:
    needs(backend)
    summary, stdout = run_job(tmp_path, f"backend={backend}", *RECIPE, "train.steps=1000", timeout_s=140)
    assert summary["primary_metric"] == "mse" and summary["global_step"] == 1000
    assert summary["metrics"]["mse"] < BOUND and summary["metrics"]["r2"] > 0.9, summary["metrics"]
    assert summary["test_mse"] == summary["metrics"]["mse"]
    last = stdout.strip().splitlines()[-1]
    assert f"backend={backend} model=regressor" in last and "test MSE" in last and "test R²" in last


@pytest.mark.timeout(200)
def test_a_mixed_job_trains_one_model_on_every_framework(tmp_path: Path) -> None:
    """torch, TensorFlow and JAX workers push to one ps; each framework's predictions of the result score alike.

    In sync mode, so that each global step holds a gradient of every framework
    however long each takes to start (TensorFlow's import is the slowest).
    """
    needs("torch", "tf", "jax")
    summary, _ = run_job(
        tmp_path, *RECIPE, "sync=sync", "topology.num_workers=3", "topology.worker_backends=[torch,tf,jax]",
        "train.steps=800", timeout_s=190,
    )  # fmt: skip
    assert summary["metrics"]["mse"] < BOUND, summary["metrics"]
    by_backend = summary["test_mse_by_backend"]
    assert sorted(by_backend) == ["jax", "tf", "torch"]
    assert max(by_backend.values()) - min(by_backend.values()) < 1e-4, by_backend  # the same final parameters
    assert {w["backend"] for w in summary["workers"].values()} == {"torch", "tf", "jax"}
    assert all(w["gradients_applied"] >= 700 for w in summary["workers"].values()), summary["workers"]
