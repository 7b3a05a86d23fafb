"""Each framework's ``sines`` trainer computes what the numpy one does: loss, gradients, predictions.

Each framework runs in its own subprocess (torch, TensorFlow and JAX never
share one), through psdk as a job reaches it: the backend loaded by name, the
model built by the ``regressor`` record's builder for it, the trainer named
by the workload's record for its framework, the gradients read by the
bridge. A framework that is missing is skipped, unless ``PSDK_NO_SKIP`` is
set (as CI sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from psdk_example import sines
from psdk_example.regression_numpy import NumpyRegressor
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import SinesOptions

from psdk import plugins

pytestmark = pytest.mark.timeout(120)
FRAMEWORKS = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}
SPEC = {"hidden": (16, 8), "input_dim": 8}
OPTIONS = {"examples": 64, "validation_size": 8, "test_size": 700}
# What the subprocess computes, and the test in numpy: one step's loss and gradients, and the test set's predictions.
STEP = """
import json, numpy as np
from psdk import plugins
from psdk.plugins.models import build_model
from psdk.plugins.registry import load_target
from psdk_example import sines
from psdk_example.regressor import RegressorSpec
def step(backend_name):
    spec = RegressorSpec(**SPEC)
    weights = {k: v + np.float32(0.03) for k, v in spec.init_weights(7).items()}  # non-zero biases too
    train, _, test = sines.generate(sines.SinesOptions(**OPTIONS))
    bridge = plugins.load_backend(backend_name)
    bridge.setup("cpu", threads=1)
    record = plugins.installed_workloads()["sines"]
    trainer = load_target(record.trainer(bridge.record.framework), "trainer")(bridge, OPTIONS)
    model = trainer.build_model(spec, weights)
    loss = trainer.forward_backward(model, train.take(0, 32))
    grads = {name: np.zeros(shape, np.float32) for name, shape in spec.variables()}
    bridge.read_gradients(model, grads)
    predicted = trainer.predictions(model, test, size=500)  # two slices, joined
    variables = list(bridge.variables(model)) == [n for n, _ in spec.variables()]
    return {"loss": loss, "grads": {k: v.tolist() for k, v in grads.items()}, "predictions": predicted.tolist(),
            "dtype": str(predicted.dtype), "variables": variables}
"""


def needs(backend: str) -> None:
    if importlib.util.find_spec(FRAMEWORKS[backend]) is None:
        if os.environ.get("PSDK_NO_SKIP"):
            pytest.fail(f"PSDK_NO_SKIP is set but {FRAMEWORKS[backend]} is not installed")
        pytest.skip(f"{FRAMEWORKS[backend]} not installed")


def run_step(backend: str) -> dict[str, object]:
    code = f"SPEC, OPTIONS = {SPEC!r}, {OPTIONS!r}\n{STEP}\nprint(json.dumps(step({backend!r})))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_numpy_reference_runs_through_the_same_code() -> None:
    """The subprocess's code, here on the numpy backend: what the frameworks are compared with."""
    namespace: dict[str, object] = {"SPEC": SPEC, "OPTIONS": OPTIONS}
    exec(STEP, namespace)  # the same code the subprocesses run
    result = namespace["step"]("numpy")  # type: ignore[operator]
    assert result["variables"] and result["dtype"] == "float32" and len(result["predictions"]) == 700


@pytest.mark.parametrize("backend", sorted(FRAMEWORKS))
def test_each_frameworks_trainer_agrees_with_numpy(backend: str) -> None:
    needs(backend)
    result = run_step(backend)
    spec = RegressorSpec(**SPEC)  # type: ignore[arg-type]
    weights = {k: v + np.float32(0.03) for k, v in spec.init_weights(7).items()}
    train, _, test = sines.generate(SinesOptions(**OPTIONS))
    bridge = plugins.load_backend("numpy")
    reference = NumpyRegressor(bridge, OPTIONS)
    model = reference.build_model(spec, weights)
    loss = reference.forward_backward(model, train.take(0, 32))
    grads = {name: np.zeros(shape, np.float32) for name, shape in spec.variables()}
    bridge.read_gradients(model, grads)
    assert result["variables"] and result["dtype"] == "float32"
    assert result["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    got = result["grads"]
    assert isinstance(got, dict) and list(got) == list(grads)
    for name, expected in grads.items():
        np.testing.assert_allclose(np.array(got[name]), expected, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(
        np.array(result["predictions"]), reference.predictions(model, test), rtol=1e-4, atol=1e-5
    )
