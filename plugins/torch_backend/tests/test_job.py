"""The MNIST job on PyTorch workers, end to end: `python -m psdk run backend=torch`, run from a scratch folder."""

from __future__ import annotations

from pathlib import Path

from psdk.testing import assert_every_worker_contributed, run_job


def psdk_run(tmp_path: Path, psdk_mnist_dir: Path, *args: str) -> tuple[dict, str]:
    return run_job(tmp_path / "run", "backend=torch", *args, data_dir=psdk_mnist_dir, cwd=tmp_path)


def test_the_default_job_reaches_the_accuracy_bar(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    summary, stdout = psdk_run(tmp_path, psdk_mnist_dir)
    # The default recipe (cosine lr, 12,000 steps) sits near 0.980; the bar leaves room for async noise.
    assert summary["test_accuracy"] >= 0.975
    assert summary["global_step"] == 12000 and summary["workers"]["1"]["backend"] == "torch"
    assert_every_worker_contributed(summary, tmp_path / "run" / "metrics.jsonl")
    assert stdout.strip().splitlines()[-1].startswith("psdk done: backend=torch model=mlp sync=async")


def test_sync_mode_reaches_the_same(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    summary, _ = psdk_run(tmp_path, psdk_mnist_dir, "sync=sync", "train.steps=3000")
    assert summary["test_accuracy"] >= 0.97
    assert summary["gradients_applied"] == 6000 and summary["gradients_dropped"] == 0


def test_softmax_regression_reaches_its_bar(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    args = ("model=softmax", "topology.num_ps=2", "topology.num_workers=3", "train.steps=3000")
    summary, _ = psdk_run(tmp_path, psdk_mnist_dir, *args)
    assert summary["test_accuracy"] >= 0.91 and summary["num_workers"] == 3
