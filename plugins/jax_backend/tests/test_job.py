"""The MNIST job on JAX workers, end to end: `python -m psdk run backend=jax` in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from psdk.testing import assert_every_worker_contributed, run_job

pytestmark = pytest.mark.timeout(300)


def test_the_default_job_reaches_the_accuracy_bar(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    # The default recipe (Nesterov momentum, cosine lr, L2) over half its steps, to keep CI short.
    summary, stdout = run_job(tmp_path, "backend=jax", "train.steps=6000", data_dir=psdk_mnist_dir)
    assert summary["test_accuracy"] >= 0.97
    assert summary["backend"] == "jax" and summary["global_step"] == 6000
    assert {w["backend"] for w in summary["workers"].values()} == {"jax"}
    assert {w["device"] for w in summary["workers"].values()} == {"cpu"}
    assert_every_worker_contributed(summary, tmp_path / "metrics.jsonl")
    assert stdout.strip().splitlines()[-1].startswith("psdk done: backend=jax model=mlp sync=async")


def test_softmax_regression_in_sync_mode_reaches_its_bar(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    summary, _ = run_job(
        tmp_path,
        "backend=jax",
        "model=softmax",
        "sync=sync",
        "optimizer=adam",
        "train.steps=1000",
        data_dir=psdk_mnist_dir,
    )
    assert summary["test_accuracy"] >= 0.9
    assert summary["gradients_applied"] == 2000 and summary["gradients_dropped"] == 0
