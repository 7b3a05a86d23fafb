"""torch workers beside workers of another backend, on one set of parameters.

Each framework runs in its own process (the job is a subprocess). The torch
and TensorFlow pair, and checkpoints crossing between them, are the tf
plugin's tests (its test_mixed.py); numpy is the partner every install has.
"""

from __future__ import annotations

from pathlib import Path

from psdk.testing import assert_every_worker_contributed, run_job


def test_a_torch_worker_and_a_numpy_worker_train_one_model(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    overrides = ("backend=torch", "topology.worker_backends=[torch,numpy]", "train.steps=1500")
    summary, stdout = run_job(tmp_path / "run", *overrides, data_dir=psdk_mnist_dir, cwd=tmp_path)
    assert {w["backend"] for w in summary["workers"].values()} == {"torch", "numpy"}
    assert_every_worker_contributed(summary, tmp_path / "run" / "metrics.jsonl")
    accuracies = summary["test_accuracy_by_backend"]
    assert set(accuracies) == {"torch", "numpy"} and abs(accuracies["torch"] - accuracies["numpy"]) <= 0.001
    assert "by backend" in stdout


def test_a_checkpoint_written_by_numpy_workers_resumes_on_torch(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """The ps's state is framework-neutral: Adam's moments and step come along, and so does the accuracy."""
    common = ("optimizer=adam", "train.validate_every=500")
    before, _ = run_job(
        tmp_path / "a", "backend=numpy", *common, "train.steps=1500", data_dir=psdk_mnist_dir, cwd=tmp_path
    )
    saved = next((tmp_path / "a" / "checkpoints").glob("ckpt-*-1500.npz"))
    after, stdout = run_job(
        tmp_path / "b",
        "backend=torch",
        *common,
        "train.steps=3000",
        f"resume={saved}",
        data_dir=psdk_mnist_dir,
        cwd=tmp_path,
    )
    assert "resumed from" in stdout and after["global_step"] == 3000 and after["gradients_applied"] == 1500
    assert after["backend"] == "torch" and after["test_accuracy"] >= before["test_accuracy"] - 0.005
