"""MNIST's tf trainer: registered for psdk's workload, held to the numpy reference, compiled once, learning MNIST.

TfClassifier is compared with :class:`~psdk.workloads.mnist.trainers.NumpyClassifier`
on the numpy bridge: the same weights and batch give the same loss, gradients
(read through each bridge) and logits, on psdk's network and on a Keras
model a user brings.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from psdk_tf import mnist as tf_mnist
from psdk_tf.backend import TfBackend
from psdk_tf.mnist import TfClassifier
from psdk_tf.models import DenseStack, binding

from psdk import plugins
from psdk.data import mnist
from psdk.errors import PluginError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec, init_weights
from psdk.rules import SGD
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier

from .conftest import SPEC, batch, keras_mlp, zeros


def mnist_batch(size: int = 64, seed: int = 0) -> Batch:
    """A random batch as MNIST's trainers take it."""
    x, y = batch(size, seed)
    return Batch({IMAGE: x}, y)


@pytest.fixture
def trainer(backend: TfBackend) -> TfClassifier:
    return TfClassifier(backend)


@pytest.fixture
def reference() -> NumpyClassifier:
    """MNIST's reference trainer, on the numpy bridge."""
    return NumpyClassifier(plugins.load_backend("numpy"))


def assert_same_step(
    trainer: TfClassifier, model: object, reference: NumpyClassifier, ref: object, data: Batch
) -> None:
    """One forward-backward pass of each gives the same loss and the same gradients, read through each bridge."""
    expected_loss = reference.forward_backward(ref, data)
    assert trainer.forward_backward(model, data) == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    grads, expected = zeros(), zeros()
    trainer.bridge.read_gradients(model, grads)
    reference.bridge.read_gradients(ref, expected)
    for name in expected:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-4, atol=1e-6, err_msg=name)


# ------------------------------------------------------------ registration
def test_mnist_trains_on_tensorflow_with_this_plugins_trainer_and_registering_it_imports_none() -> None:
    code = (
        "import sys\n"
        "from psdk import plugins\n"
        "print(plugins.installed_workloads()['mnist'].trainer('tensorflow'))\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["psdk_tf.mnist:TfClassifier", "[]"]


def test_it_refuses_a_bridge_of_another_framework() -> None:
    with pytest.raises(PluginError, match=r"TfClassifier trains on the tf backend .*not on .*NumpyBackend"):
        TfClassifier(NumpyBackend())


# ------------------------------------------------------- MNIST's trainer
def test_the_trainer_matches_the_numpy_reference_on_psdks_network(
    trainer: TfClassifier, reference: NumpyClassifier
) -> None:
    """Loss and gradients as NumpyClassifier's, on the same weights and batch, before and after a staged write."""
    weights = init_weights(SPEC, 2)
    model, ref = trainer.build_model(SPEC, weights), reference.build_model(SPEC, weights)
    assert isinstance(model, DenseStack)
    assert_same_step(trainer, model, reference, ref, mnist_batch(64, 0))
    written = {
        name: np.random.default_rng(3).normal(0, 0.3, shape).astype(np.float32) for name, shape in SPEC.variables()
    }
    trainer.bridge.write_weights(model, written)  # staged: assigned inside the next step
    reference.bridge.write_weights(ref, written)
    assert_same_step(trainer, model, reference, ref, mnist_batch(64, 1))


def test_predictions_are_the_references_logits_as_float32(trainer: TfClassifier, reference: NumpyClassifier) -> None:
    weights = init_weights(SPEC, 4)
    model, ref = trainer.build_model(SPEC, weights), reference.build_model(SPEC, weights)
    data = mnist_batch(130, 5)
    trainer.bridge.write_weights(model, init_weights(SPEC, 6))  # a staged write reaches predictions too
    reference.bridge.write_weights(ref, init_weights(SPEC, 6))
    predicted = trainer.predictions(model, data, size=50)  # three slices, the last one short
    assert predicted.dtype == np.float32 and predicted.shape == (130, 10)
    np.testing.assert_allclose(predicted, reference.predictions(ref, data), rtol=1e-5, atol=1e-5)


def test_a_keras_model_matches_the_numpy_reference(trainer: TfClassifier, reference: NumpyClassifier) -> None:
    """Keras Dense kernels are (in, out) already: psdk's weights go in unchanged, and the trainer takes the model."""
    weights = init_weights(SPEC, 3)
    model, ref = keras_mlp(), reference.build_model(SPEC, weights)
    trainer.bridge.write_weights(model, weights)
    assert list(trainer.bridge.variables(model).items()) == SPEC.variables()
    data = mnist_batch()
    assert_same_step(trainer, model, reference, ref, data)
    np.testing.assert_allclose(trainer.predict(model, data), reference.predict(ref, data), rtol=1e-5, atol=1e-5)


def test_batches_of_other_sizes_and_label_dtypes_do_not_retrace(trainer: TfClassifier) -> None:
    model = keras_mlp("retrace")
    for size, dtype in ((64, np.int64), (100, np.int32), (7, np.uint8), (64, np.int64)):
        x, y = batch(size)
        trainer.forward_backward(model, Batch({IMAGE: x}, y.astype(dtype)))
    assert 1 <= binding(model).traces(tf_mnist.cross_entropy) <= 2  # reduce_retracing generalises
    stack = trainer.build_model(SPEC, init_weights(SPEC, 0))
    assert isinstance(stack, DenseStack)
    # Traced as it is built, with a staged write assigned inside the step and without: no timed step traces.
    assert stack.traces(tf_mnist.cross_entropy) == 2
    for size in (64, 100, 7, 64):
        trainer.forward_backward(stack, mnist_batch(size))
        trainer.bridge.write_weights(stack, init_weights(SPEC, size))
        trainer.predict(stack, mnist_batch(size))
    assert stack.traces(tf_mnist.cross_entropy) == 2  # and never again, whatever the batch size
    assert binding(stack).train_step(tf_mnist.cross_entropy) is binding(stack).train_step(tf_mnist.cross_entropy)


def test_binding_a_keras_model_does_not_keep_it_alive(trainer: TfClassifier) -> None:
    model = keras_mlp("transient")
    trainer.forward_backward(model, mnist_batch(4))
    trainer.predict(model, mnist_batch(4))
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None


def test_psdks_mlp_learns_mnist_in_a_few_hundred_steps(trainer: TfClassifier, psdk_mnist_dir: Path) -> None:
    """Real data, in this process: the trainer on the bridge's MLP with its own Keras optimizer, 300 steps of 100."""
    data = mnist.split(mnist.load(psdk_mnist_dir), 0, 1)
    spec = ModelSpec(hidden=(100,))
    model = trainer.build_model(spec, init_weights(spec, 0))
    optimizer = trainer.bridge.make_optimizer(model, SGD(lr=0.1, momentum=0.9))
    grads = {name: np.zeros(shape, np.float32) for name, shape in spec.variables()}
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = rng.integers(0, len(data.train_x), 100)
        trainer.forward_backward(model, Batch({IMAGE: data.train_x[rows]}, data.train_y[rows]))
        trainer.bridge.read_gradients(model, grads)
        optimizer.apply_gradients(zip(map(tf.constant, grads.values()), model.trainable_variables, strict=True))
    logits = trainer.predictions(model, Batch({IMAGE: data.test_x}, data.test_y))
    assert np.mean(np.argmax(logits, axis=1) == data.test_y) > 0.9
