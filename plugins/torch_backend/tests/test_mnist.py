"""MNIST's torch trainer: registered for psdk's workload, held to the numpy reference, and learning real MNIST."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend
from psdk_torch.mnist import TorchClassifier

from psdk import plugins
from psdk.data import mnist
from psdk.errors import PluginError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec, init_weights
from psdk.rules import SGD
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier

from .conftest import SPEC, batch


def random_weights(seed: int) -> dict[str, np.ndarray]:
    """Weights no backend starts from: every bias non-zero, so a dropped bias shows."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, shape in SPEC.variables()}


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """What MNIST scores: the share of argmax predictions that are the label."""
    return float(np.mean(logits.argmax(axis=1) == labels))


def test_the_plugin_gives_mnist_its_torch_trainer() -> None:
    target = plugins.installed_workloads()["mnist"].trainer("torch")
    assert target == "psdk_torch.mnist:TorchClassifier"
    assert plugins.load_target(target, "the torch trainer") is TorchClassifier


def test_registering_the_trainer_imports_no_torch() -> None:
    code = "import sys; from psdk import plugins; plugins.installed_workloads(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_it_refuses_a_bridge_of_another_framework() -> None:
    with pytest.raises(PluginError, match=r"TorchClassifier trains on the torch backend .*not on .*NumpyBackend"):
        TorchClassifier(NumpyBackend())


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradients_and_predictions_match_the_numpy_reference(
    backend: TorchBackend, trainer: TorchClassifier, seed: int
) -> None:
    """Same weights, same batch: the same loss, gradients, logits and so the same accuracy."""
    weights, data = random_weights(seed), batch(size=256, seed=seed)
    bridge = NumpyBackend()
    reference, expected = NumpyClassifier(bridge), bridge.build_model(SPEC, weights)
    model = trainer.build_model(SPEC, weights)

    loss = trainer.forward_backward(model, data)
    assert loss == pytest.approx(reference.forward_backward(expected, data), rel=1e-5, abs=1e-6)
    grads = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
    wanted = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, grads)
    bridge.read_gradients(expected, wanted)
    for name, grad in grads.items():
        assert np.abs(wanted[name]).max() > 0, name  # a gradient that could be wrong
        np.testing.assert_allclose(grad, wanted[name], rtol=1e-4, atol=1e-6, err_msg=name)

    logits = trainer.predictions(model, data, size=100)  # three slices, the last one short
    assert logits.dtype == np.float32 and logits.shape == (256, SPEC.num_classes)
    reference_logits = reference.predictions(expected, data)
    np.testing.assert_allclose(logits, reference_logits, rtol=1e-4, atol=1e-5)
    assert accuracy(logits, data.targets) == accuracy(reference_logits, data.targets)


def test_a_second_step_starts_from_zeroed_gradients(backend: TorchBackend, trainer: TorchClassifier) -> None:
    """forward_backward zeroes first: two steps on one batch leave one step's gradients, not twice them."""
    model, data = trainer.build_model(SPEC, random_weights(2)), batch(seed=2)
    once = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    twice = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    trainer.forward_backward(model, data)
    backend.read_gradients(model, once)
    trainer.forward_backward(model, data)
    backend.read_gradients(model, twice)
    for name, grad in twice.items():
        np.testing.assert_allclose(grad, once[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_predicting_records_no_graph(trainer: TorchClassifier) -> None:
    model = trainer.build_model(SPEC, random_weights(3))
    logits = trainer.predict(model, batch(seed=3))
    assert isinstance(logits, np.ndarray) and all(p.grad is None for p in model.parameters())
    assert torch.is_grad_enabled()  # no_grad was for the prediction only


def test_psdks_mlp_learns_mnist_in_a_few_hundred_steps(
    backend: TorchBackend, trainer: TorchClassifier, psdk_mnist_dir: Path
) -> None:
    """Real data, in this process: the bridge's network with its own torch optimizer, 300 steps of 100."""
    data = mnist.split(mnist.load(psdk_mnist_dir), 0, 1)
    spec = ModelSpec(hidden=(100,))
    model = trainer.build_model(spec, init_weights(spec, 0))
    optimizer = backend.make_optimizer(model, SGD(lr=0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = rng.integers(0, len(data.train_x), 100)
        trainer.forward_backward(model, Batch({IMAGE: data.train_x[rows]}, data.train_y[rows]))
        optimizer.step()
    test = Batch({IMAGE: data.test_x}, data.test_y)
    assert accuracy(trainer.predictions(model, test), data.test_y) > 0.9
