"""The plugin's rule and model through ``python -m psdk run``, on every backend that is installed.

Each job is a subprocess (torch, TensorFlow and JAX never share one process).
A backend whose framework is missing is skipped, unless ``PSDK_NO_SKIP`` is
set (as CI sets it): there it is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psdk.testing import run_job

FRAMEWORKS = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}
RECIPE = ("model=resmlp", "optimizer=lion", "optimizer.lr=3e-4", "report.plot=false")


def needs(*backends: str) -> None:
    missing = [b for b in backends if importlib.util.find_spec(FRAMEWORKS[b]) is None]
    if missing and os.environ.get("PSDK_NO_SKIP"):
        pytest.fail(f"PSDK_NO_SKIP is set but {', '.join(missing)} is not installed")
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")


@pytest.mark.parametrize("backend", sorted(FRAMEWORKS))
def test_the_builder_computes_the_specs_network(backend: str, tmp_path: Path) -> None:
    """Built through MNIST's trainer for ``backend``, the model's loss and weights are the spec's numpy network's."""
    needs(backend)
    code = f"""
import json, numpy as np
from psdk import Batch
from psdk.plugins import installed_workloads, load_backend
from psdk.plugins.registry import load_target
from psdk_example.resmlp import ResMlpSpec
spec = ResMlpSpec(width=24, blocks=2, input_dim=20)
backend = load_backend({backend!r}); backend.setup("cpu", threads=1)
trainer = load_target(installed_workloads()["mnist"].trainer(backend.record.framework), "trainer")(backend)
weights = {{k: v + np.float32(0.01) for k, v in spec.init_weights(5).items()}}  # non-zero biases too
model = trainer.build_model(spec, weights)
rng = np.random.default_rng(0)
x, y = rng.random((32, 20), dtype=np.float32), rng.integers(0, 10, 32)
loss = trainer.forward_backward(model, Batch({{"image": x}}, y))
logits = spec.forward(weights, x).astype(np.float64)
shifted = logits - logits.max(axis=1, keepdims=True)
expected = float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(32), y]))
read = backend.read_weights(model)
same = list(read) == [n for n, _ in spec.variables()]
same = same and all(np.allclose(read[n], weights[n], rtol=1e-5, atol=1e-7) for n in read)
print(json.dumps({{"loss": loss, "expected": expected, "same": same}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] and result["loss"] == pytest.approx(result["expected"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("backend", sorted(FRAMEWORKS))
def test_it_trains_mnist_on_each_backend(backend: str, tmp_path: Path, psdk_mnist_dir: Path) -> None:
    needs(backend)
    summary, stdout = run_job(tmp_path, f"backend={backend}", *RECIPE, "train.steps=1500", data_dir=psdk_mnist_dir)
    assert summary["test_accuracy"] >= 0.95, summary["test_accuracy"]
    assert f"backend={backend} model=resmlp" in stdout.strip().splitlines()[-1]


def test_a_mixed_job_resumes_with_the_rules_slot_on_other_backends(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """torch+tf write a checkpoint holding Lion's slot; jax+torch resume from it (or torch alone, without jax)."""
    needs("torch", "tf")
    first = tmp_path / "first"
    run_job(first, *RECIPE, "topology.worker_backends=[torch,tf]", "train.steps=600", data_dir=psdk_mnist_dir)
    checkpoint = next((first / "checkpoints").glob("ckpt-*-600.npz"))
    with np.load(checkpoint) as saved:
        slots = sorted(k for k in saved.files if k.startswith("slots/m/"))
    assert slots == sorted(
        f"slots/m/{name}/{part}" for name in ("stem", "block1", "logits") for part in ("kernel", "bias")
    )
    second = tmp_path / "second"
    backends = "[jax,torch]" if importlib.util.find_spec("jax") is not None else "[torch]"
    summary, _ = run_job(
        second, *RECIPE, f"topology.worker_backends={backends}", "train.steps=900", f"resume={checkpoint}",
        data_dir=psdk_mnist_dir,
    )  # fmt: skip
    assert summary["global_step"] == 900 and summary["test_accuracy"] >= 0.93
    assert "resumed from" in (second / "tasks" / "worker0" / "worker0.log").read_text()
