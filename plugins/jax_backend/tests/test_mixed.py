"""JAX workers beside torch and TensorFlow ones, and checkpoints that cross between them.

Every job is a subprocess (:func:`psdk.testing.run_job`), so this pytest
process never imports torch or TensorFlow; a job needing a framework that is
not installed is skipped, except where ``PSDK_NO_SKIP`` is set (CI).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from psdk import plugins
from psdk.testing import assert_every_worker_contributed, run_job

pytestmark = pytest.mark.timeout(300)

ADAM = ("optimizer=adam", "train.validate_every=500")


def needs(backend: str) -> None:
    """Skip unless ``backend``'s plugin and framework are installed (checked without importing it)."""
    installed = plugins.installed_backends()
    entry = installed.get(backend)
    if entry is not None and importlib.util.find_spec(entry.record.framework) is not None:
        return
    reason = f"the {backend} backend or its framework is not installed"
    if os.environ.get("PSDK_NO_SKIP"):
        pytest.fail(f"PSDK_NO_SKIP is set but {reason}")
    pytest.skip(reason)


def run(out: Path, psdk_mnist_dir: Path, *args: str) -> tuple[dict, str]:
    return run_job(out, *args, "train.validate_every=500", data_dir=psdk_mnist_dir, timeout_s=300)


@pytest.mark.parametrize("other", ["torch", "tf"])
def test_a_jax_worker_and_another_frameworks_train_one_model(tmp_path: Path, psdk_mnist_dir: Path, other: str) -> None:
    needs(other)
    summary, stdout = run(tmp_path, psdk_mnist_dir, f"topology.worker_backends=[jax,{other}]", "train.steps=1500")
    assert {w["backend"] for w in summary["workers"].values()} == {"jax", other}
    assert_every_worker_contributed(summary, tmp_path / "metrics.jsonl")
    by_backend = summary["test_accuracy_by_backend"]
    assert set(by_backend) == {"jax", other} and min(by_backend.values()) >= 0.96
    assert abs(by_backend["jax"] - by_backend[other]) <= 0.001  # one set of parameters, two evaluations
    assert "by backend" in stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, psdk_mnist_dir: Path) -> dict[str, tuple[Path, dict]]:
    """Checkpoints of 1,000 Adam steps written by a JAX job and, where torch is installed, by a torch job."""
    jobs: dict[str, tuple[Path, dict]] = {}
    for backend in ("jax", "torch"):
        if backend == "torch" and plugins.installed_backends().get("torch") is None:
            continue
        out = tmp_path_factory.mktemp(f"{backend}-first")
        summary, _ = run(out, psdk_mnist_dir, f"backend={backend}", *ADAM, "train.steps=1000")
        jobs[backend] = (out / "checkpoints", summary)
    return jobs


@pytest.mark.parametrize("first, second", [("torch", "jax"), ("jax", "torch"), ("jax", "tf")])
def test_a_checkpoint_of_one_framework_resumes_on_the_other(
    tmp_path: Path, psdk_mnist_dir: Path, trained: dict[str, tuple[Path, dict]], first: str, second: str
) -> None:
    needs(first)
    needs(second)
    folder, before = trained[first]
    after, stdout = run(tmp_path, psdk_mnist_dir, f"backend={second}", *ADAM, "train.steps=2000", f"resume={folder}")
    assert "resumed from" in stdout and after["resumed_from"] == str(folder)
    assert after["backend"] == second and after["global_step"] == 2000 and after["gradients_applied"] == 1000
    # The accuracy carries over (Adam's moments and step came along with the weights).
    assert after["test_accuracy"] >= before["test_accuracy"] - 0.005 and after["test_accuracy"] >= 0.95
