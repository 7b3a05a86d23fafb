"""The tf bridge and MNIST's tf trainer beyond the conformance suite.

Their registration, Keras models, recorded gradients, the compiled steps and
the public API. psdk's own network is canonical by construction
(``hidden1/kernel`` (in, out), ...); a Keras model from a training script is
named from its variables' paths and kept in Keras's layout, which for
``Dense`` is already (in, out). The trainer is held to MNIST's numpy
reference trainer on the numpy bridge.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import keras
import numpy as np
import psdk_tf
import pytest
import tensorflow as tf
from psdk_tf import mnist as tf_mnist
from psdk_tf.backend import TfBackend
from psdk_tf.mnist import TfClassifier
from psdk_tf.models import DenseStack, binding, canonical_names, record_gradients

import psdk
from psdk import plugins
from psdk.data import mnist
from psdk.errors import PsdkError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec, init_weights
from psdk.rules import SGD
from psdk.testing.ps import RunningPs
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier

from .conftest import SPEC, batch


def zeros() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}


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


def keras_mlp(name: str = "net") -> keras.Model:
    """psdk's MLP written as a Keras user would, with the layers named as psdk names them."""
    model = keras.Sequential(
        [
            keras.layers.Dense(32, activation="relu", name="hidden1"),
            keras.layers.Dense(16, activation="relu", name="hidden2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name=name,
    )
    model.build((None, 50))
    return model


# ------------------------------------------------------------ registration
def test_the_backend_is_registered_by_its_distribution() -> None:
    entry = plugins.installed_backends()["tf"]
    assert entry.distribution.startswith("psdk-tf") and entry.record.framework == "tensorflow"
    assert plugins.resolve_backend_name("keras") == "tf"


def test_mnist_trains_on_tensorflow_with_this_plugins_trainer_and_registering_it_imports_none() -> None:
    code = (
        "import sys\n"
        "from psdk import plugins\n"
        "print(plugins.installed_workloads()['mnist'].trainer('tensorflow'))\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["psdk_tf.mnist:TfClassifier", "[]"]


def test_the_backend_is_a_bridge_without_the_old_mnist_methods() -> None:
    """load_backend refuses a backend that still has them (the fixture loads this one)."""
    assert not hasattr(TfBackend, "forward_backward") and not hasattr(TfBackend, "accuracy")


def test_psdk_plugins_lists_tf() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psdk", "plugins"], capture_output=True, text=True, timeout=120, check=True
    )
    line = next(row for row in out.stdout.splitlines() if row.split()[:2] == ["backend", "tf"])
    assert "tensorflow" in line and "psdk-tf" in line


# ------------------------------------------------------------ psdk's model
def test_psdk_models_are_canonical_by_construction(backend: TfBackend) -> None:
    """tf.Variables named and shaped as the ps keeps them: no transposes anywhere."""
    model = backend.build_model(SPEC, init_weights(SPEC, 1))
    assert [(v.name, tuple(v.shape)) for v in model.trainable_variables] == [
        (f"{name}:0", shape) for name, shape in SPEC.variables()
    ]
    x, _ = batch(5)
    w = init_weights(SPEC, 1)
    h = np.maximum(x @ w["hidden1/kernel"] + w["hidden1/bias"], 0)
    h = np.maximum(h @ w["hidden2/kernel"] + w["hidden2/bias"], 0)
    np.testing.assert_allclose(model(x).numpy(), h @ w["logits/kernel"] + w["logits/bias"], rtol=1e-5, atol=1e-5)


def test_a_write_reaches_the_variables_before_they_are_next_used(backend: TfBackend) -> None:
    """Writes are staged and assigned inside the next step; every other reader sees them too."""
    model = backend.build_model(SPEC, init_weights(SPEC, 1))
    new = init_weights(SPEC, 2)
    backend.write_weights(model, new)
    x, _ = batch(3)
    reference = NumpyBackend().build_model(SPEC, new)
    np.testing.assert_allclose(model(x).numpy(), reference.logits(x)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), new["hidden1/kernel"])


def test_writing_an_unknown_variable_names_the_known_ones(backend: TfBackend) -> None:
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    with pytest.raises(PsdkError, match=r"'dense/kernel'.*hidden1/bias"):
        backend.write_weights(model, {"dense/kernel": np.zeros((50, 32), np.float32)})


# ----------------------------------------------------------- Keras models
def test_keras_variables_are_named_from_their_paths() -> None:
    named = canonical_names(keras_mlp("net"))
    assert [name for name, _ in named] == [name for name, _ in SPEC.variables()]
    plain = keras.Sequential([keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")])
    plain.build((None, 3))
    assert [name for name, _ in canonical_names(plain)] == ["a/kernel", "a/bias", "b/kernel", "b/bias"]
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(2, name="out")(inputs), name="f")
    assert [name for name, _ in canonical_names(functional)] == ["out/kernel", "out/bias"]


def test_a_tf_module_is_named_from_its_variable_names() -> None:
    class Affine(tf.Module):
        def __init__(self) -> None:
            super().__init__(name="affine")
            with self.name_scope:
                self.w = tf.Variable(tf.zeros((3, 2)), name="w")

    assert [name for name, _ in canonical_names(Affine())] == ["w"]


def test_models_that_cannot_be_named_are_refused_clearly() -> None:
    with pytest.raises(PsdkError, match="build it first"):
        canonical_names(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(PsdkError, match="distinct names"):
        canonical_names(type("M", (), {"trainable_variables": [tf.Variable(1.0), tf.Variable(2.0)]})())


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


def test_recorded_gradients_are_what_a_step_pushes(backend: TfBackend) -> None:
    model = keras_mlp()
    out = zeros()
    with pytest.raises(PsdkError, match="record_gradients"):
        backend.read_gradients(model, out)
    x, y = batch()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(PsdkError, match="got 2 gradients for 6"):
        record_gradients(model, grads[:2])
    record_gradients(model, [*grads[:-1], None])  # an unused variable pushes zeros
    backend.read_gradients(model, out)
    np.testing.assert_allclose(out["hidden1/kernel"], grads[0].numpy(), rtol=1e-6, atol=1e-7)
    assert not out["logits/bias"].any()


def test_record_gradients_works_for_psdk_models_too(backend: TfBackend) -> None:
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    grads = [tf.ones(v.shape) * i for i, v in enumerate(model.trainable_variables)]
    record_gradients(model, grads)
    out = zeros()
    backend.read_gradients(model, out)
    assert [float(v.mean()) for v in out.values()] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


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


# ------------------------------------------------------------- public API
def test_a_keras_model_trains_through_the_public_api(psdk_ps: RunningPs) -> None:
    x, y = batch(seed=5)
    net, reference = keras_mlp("net"), keras_mlp("reference")
    reference.set_weights(net.get_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    with psdk.connect(psdk_ps.cluster(1), 0, steps=5, transport=psdk_ps.transport) as session:
        opt = psdk.DistributedOptimizer(keras.optimizers.SGD(0.5), net, session)
        assert opt.backend.name == "tf" and next(iter(opt.backend.variables(net))) == "hidden1/kernel"
        opt.broadcast_parameters()
        while not session.should_stop():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, net(x, training=True))
            psdk_tf.record_gradients(net, tape.gradient(loss, net.trainable_variables))
            opt.step()
        session.finish()
        opt.pull()
    assert session.global_step == 5

    local = keras.optimizers.SGD(0.5)
    for _ in range(5):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, reference(x, training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        local.apply_gradients(zip(grads, reference.trainable_variables, strict=True))
    for ours, theirs in zip(net.trainable_variables, reference.trainable_variables, strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6, err_msg=ours.path)
