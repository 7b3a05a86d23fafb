"""TensorFlow and PyTorch workers on one set of parameters, and checkpoints that cross frameworks.

Every framework runs in its own process (the jobs are subprocesses); this
pytest process imports neither. They need the torch plugin too, and are
skipped where it is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import pytest

from psdk.testing import assert_every_worker_contributed, run_job

pytestmark = pytest.mark.skipif(
    find_spec("torch") is None or find_spec("psdk_torch") is None, reason="needs torch and the psdk-torch plugin"
)


@pytest.fixture
def run(tmp_path: Path, psdk_mnist_dir: Path) -> Callable[..., tuple[dict, str]]:
    """A job into ``tmp_path / out``, run from ``tmp_path`` with MNIST from psdk's fixture."""

    def job(out: str, *args: str) -> tuple[dict, str]:
        overrides = (*args, "train.validate_every=500")
        return run_job(tmp_path / out, *overrides, data_dir=psdk_mnist_dir, timeout_s=300, cwd=tmp_path)

    return job


def test_a_torch_worker_and_a_tf_worker_train_one_model(tmp_path: Path, run: Callable[..., tuple[dict, str]]) -> None:
    summary, stdout = run("run", "topology.worker_backends=[torch,tf]")
    assert {w["backend"] for w in summary["workers"].values()} == {"torch", "tf"}
    assert_every_worker_contributed(summary, tmp_path / "run" / "metrics.jsonl")
    by_backend = summary["test_accuracy_by_backend"]
    assert set(by_backend) == {"torch", "tf"} and min(by_backend.values()) >= 0.97
    assert abs(by_backend["torch"] - by_backend["tf"]) <= 0.001
    assert "(tf 0." in stdout.strip().splitlines()[-1] and "by backend" in stdout


@pytest.mark.parametrize("first, second", [("torch", "tf"), ("tf", "torch")])
def test_a_checkpoint_written_by_one_framework_resumes_on_the_other(
    tmp_path: Path, run: Callable[..., tuple[dict, str]], first: str, second: str
) -> None:
    before, _ = run("a", f"backend={first}", "optimizer=adam", "train.steps=1500")
    saved = next((tmp_path / "a" / "checkpoints").glob("ckpt-*-1500.npz"))
    after, stdout = run(
        "b",
        f"backend={second}",
        "optimizer=adam",
        "train.steps=3000",
        "topology.num_ps=2",
        f"resume={saved}",
    )
    assert "resumed from" in stdout and after["global_step"] == 3000 and after["gradients_applied"] == 1500
    assert after["backend"] == second and after["resumed_from"] == str(saved)
    # The accuracy carries over (the optimizer's moments and step came along too).
    assert after["test_accuracy"] >= before["test_accuracy"] - 0.005 and after["test_accuracy"] >= 0.96


@pytest.mark.timeout(300)
def test_torch_and_tf_workers_train_one_click_model(tmp_path: Path) -> None:
    """``workload=ctr`` with a torch and a TensorFlow worker, in sync mode so that both train every round
    (TensorFlow starts seconds later); each framework scores the final parameters, rows from the checkpoint."""
    summary, stdout = run_job(
        tmp_path, "workload=ctr", "backend=torch", "topology.worker_backends=[torch,tf]", "sync=sync",
        "train.steps=100", "train.batch_size=256", "model.capacity=100000", "workload.vocab=10000",
        "workload.test_size=5000", "workload.validation_size=0", "train.validate_every=0", timeout_s=280,
    )  # fmt: skip
    assert {w["backend"]: w["local_steps"] for w in summary["workers"].values()} == {"torch": 100, "tf": 100}
    by_backend = summary["test_auc_by_backend"]
    assert set(by_backend) == {"torch", "tf"} and min(by_backend.values()) > 0.6, by_backend
    assert abs(by_backend["torch"] - by_backend["tf"]) <= 1e-4  # one set of parameters, scored twice
    assert summary["tables"]["emb"]["created"] > 1000
    assert "(tf 0." in stdout.strip().splitlines()[-1]
