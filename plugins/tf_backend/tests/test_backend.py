"""The tf bridge beyond the conformance suite: its registration, Keras models, recorded gradients, the public API.

psdk's own network is canonical by construction (``hidden1/kernel`` (in, out),
...); a Keras model from a training script is named from its variables'
paths and kept in Keras's layout, which for ``Dense`` is already (in, out).
MNIST's trainer on this bridge is test_mnist.py's.
"""

from __future__ import annotations

import subprocess
import sys

import keras
import numpy as np
import psdk_tf
import pytest
import tensorflow as tf
from psdk_tf.backend import TfBackend
from psdk_tf.models import canonical_names, record_gradients

import psdk
from psdk import plugins
from psdk.errors import PsdkError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import init_weights
from psdk.testing.ps import RunningPs

from .conftest import SPEC, batch, keras_mlp, zeros


# ------------------------------------------------------------ registration
def test_the_backend_is_registered_by_its_distribution() -> None:
    entry = plugins.installed_backends()["tf"]
    assert entry.distribution.startswith("psdk-tf") and entry.record.framework == "tensorflow"
    assert plugins.resolve_backend_name("keras") == "tf"


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
