"""MNIST's JAX trainer: registered for the workload, computing what the numpy reference computes, compiled once."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest
from psdk_jax.mnist import JaxClassifier, cross_entropy
from psdk_jax.models import DenseStack

from psdk import plugins
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec, init_weights
from psdk.plugins.registry import installed_workloads
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier, softmax_cross_entropy

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec(hidden=(32, 16), input_dim=50, num_classes=10)


def batch(seed: int = 0, size: int = 64) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch({IMAGE: rng.random((size, 50), dtype=np.float32)}, rng.integers(0, 10, size))


def gradients(backend: Any, model: Any, spec: Any = SPEC) -> dict[str, np.ndarray]:
    """What the bridge reads after a step: the gradients, into fresh buffers."""
    out = {name: np.full(shape, np.nan, np.float32) for name, shape in spec.variables()}
    backend.read_gradients(model, out)
    return out


def test_the_plugin_gives_mnist_its_jax_trainer_without_importing_jax() -> None:
    assert installed_workloads()["mnist"].trainer("jax") == "psdk_jax.mnist:JaxClassifier"
    code = (
        "import json, sys\n"
        "from psdk.plugins.registry import installed_workloads\n"
        "target = installed_workloads()['mnist'].trainer('jax')\n"
        "print(json.dumps({'target': target, 'loaded': [m for m in ('jax', 'optax') if m in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"target": "psdk_jax.mnist:JaxClassifier", "loaded": []}


def test_loss_gradients_and_logits_match_the_numpy_reference() -> None:
    """Same weights, same batch: JaxClassifier on the JAX bridge against NumpyClassifier on the numpy bridge."""
    jax_bridge, numpy_bridge = plugins.load_backend("jax"), plugins.load_backend("numpy")
    weights, data = init_weights(SPEC, 3), batch(3)
    ours, reference = JaxClassifier(jax_bridge), NumpyClassifier(numpy_bridge)
    model, expected = ours.build_model(SPEC, weights), reference.build_model(SPEC, weights)
    assert isinstance(model, DenseStack)

    loss = ours.forward_backward(model, data)
    assert isinstance(loss, float)
    assert loss == pytest.approx(reference.forward_backward(expected, data), rel=1e-5, abs=1e-6)
    wanted = gradients(numpy_bridge, expected)
    for name, value in gradients(jax_bridge, model).items():
        np.testing.assert_allclose(value, wanted[name], rtol=1e-4, atol=1e-6, err_msg=name)

    logits = ours.predict(model, data)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (64, 10)
    np.testing.assert_allclose(logits, reference.predict(expected, data), rtol=1e-5, atol=1e-5)


def test_a_step_trains_on_the_weights_just_written_and_predict_sees_them_too() -> None:
    """The ps writes the weights before each step: the compiled step and predict use them, not the old ones."""
    jax_bridge, numpy_bridge = plugins.load_backend("jax"), plugins.load_backend("numpy")
    ours, reference = JaxClassifier(jax_bridge), NumpyClassifier(numpy_bridge)
    model, expected = ours.build_model(SPEC, init_weights(SPEC, 0)), reference.build_model(SPEC, init_weights(SPEC, 0))
    for step in range(3):
        pulled = init_weights(SPEC, 10 + step)
        jax_bridge.write_weights(model, pulled)
        numpy_bridge.write_weights(expected, pulled)
        data = batch(20 + step, 32)
        assert ours.forward_backward(model, data) == pytest.approx(
            reference.forward_backward(expected, data), rel=1e-5, abs=1e-6
        )
        np.testing.assert_allclose(
            gradients(jax_bridge, model)["hidden1/kernel"],
            gradients(numpy_bridge, expected)["hidden1/kernel"],
            rtol=1e-4,
            atol=1e-6,
        )
    jax_bridge.write_weights(model, init_weights(SPEC, 7))
    numpy_bridge.write_weights(expected, init_weights(SPEC, 7))
    np.testing.assert_allclose(ours.predict(model, batch(8)), reference.predict(expected, batch(8)), atol=1e-5)


def test_predictions_of_a_whole_set_come_in_slices_and_match_one_pass() -> None:
    trainer = JaxClassifier(plugins.load_backend("jax"))
    model, data = trainer.build_model(SPEC, init_weights(SPEC, 1)), batch(1, 130)
    whole = trainer.predictions(model, data, size=50)  # slices of 50, 50 and 30
    assert whole.shape == (130, 10)
    np.testing.assert_allclose(whole, trainer.predict(model, data), rtol=1e-6, atol=1e-6)


def test_the_loss_is_compiled_once_per_model_however_many_steps() -> None:
    """The per-step cost of the backend's old forward_backward: one cached jitted call, traced twice at most."""
    traces: list[int] = []

    def counted(model: DenseStack, params: Any, x: Any, y: Any) -> Any:
        traces.append(1)  # runs while jax traces, not when the compiled step runs
        return cross_entropy(model, params, x, y)

    bridge = plugins.load_backend("jax")
    model = bridge.build_model(SPEC, init_weights(SPEC, 0))
    for step in range(6):
        if step % 2:
            bridge.write_weights(model, init_weights(SPEC, step))  # a pending write: the step that loads it
        x, y = np.asarray(batch(step).inputs[IMAGE]), np.asarray(batch(step).targets, np.int32)
        model.value_and_grad(counted, x, y)
    assert len(traces) == 2  # the step from the params, and the one that loads a pending write first


def test_without_jit_it_computes_the_same_op_by_op() -> None:
    jitted, eager = plugins.load_backend("jax"), plugins.load_backend("jax", options={"jit": False})
    weights, data = init_weights(SPEC, 1), batch(1)
    a, b = JaxClassifier(jitted), JaxClassifier(eager)
    ma, mb = a.build_model(SPEC, weights), b.build_model(SPEC, weights)
    assert a.forward_backward(ma, data) == pytest.approx(b.forward_backward(mb, data), rel=1e-6, abs=1e-6)
    for name, value in gradients(jitted, ma).items():
        np.testing.assert_allclose(value, gradients(eager, mb)[name], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(a.predict(ma, data), b.predict(mb, data), rtol=1e-6, atol=1e-6)


def test_a_model_plugins_jax_builder_trains_through_the_trainer() -> None:
    """The example plugin's resmlp: another network (its own ``apply``), MNIST's loss from the trainer."""
    jax_model = pytest.importorskip("psdk_example.jax_model")
    from psdk_example.resmlp import ResMlpSpec

    spec = ResMlpSpec(width=24, blocks=2, input_dim=50, num_classes=10)
    bridge = plugins.load_backend("jax")
    weights, data = spec.init_weights(4), batch(4)
    trainer = JaxClassifier(bridge)
    model = jax_model.build(bridge, spec, weights)
    logits = spec.forward(weights, data.inputs[IMAGE])
    assert trainer.forward_backward(model, data) == pytest.approx(
        softmax_cross_entropy(logits, data.targets)[0], rel=1e-5, abs=1e-6
    )
    np.testing.assert_allclose(trainer.predict(model, data), logits, rtol=1e-5, atol=1e-5)
    labels = np.asarray(data.targets, np.int32)
    wanted = jax.grad(lambda p: cross_entropy(model, p, data.inputs[IMAGE], labels))(model.params)
    for name, value in gradients(bridge, model, spec).items():
        np.testing.assert_allclose(value, np.asarray(wanted[name]), rtol=1e-5, atol=1e-7, err_msg=name)
