"""psdk's network and Keras models in the tf backend: canonical layout, naming, gradients."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf
from psdk_tf.backend import TfBackend
from psdk_tf.models import DenseStack, binding, canonical_names, record_gradients

from psdk.backends.numpy_backend import NumpyBackend
from psdk.errors import PsdkError
from psdk.models import ModelSpec, init_weights

SPEC = ModelSpec(hidden=(32, 16), input_dim=50, num_classes=10)


def batch(size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((size, 50), dtype=np.float32), rng.integers(0, 10, size)


def zeros() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}


def keras_mlp(name: str = "net") -> tf.keras.Model:
    """psdk's MLP written as a Keras user would, with the layers named as psdk names them."""
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(32, activation="relu", name="hidden1"),
            tf.keras.layers.Dense(16, activation="relu", name="hidden2"),
            tf.keras.layers.Dense(10, name="logits"),
        ],
        name=name,
    )
    model.build((None, 50))
    return model


def test_psdk_models_are_canonical_by_construction() -> None:
    """tf.Variables named and shaped as the ps keeps them: no transposes anywhere."""
    model = TfBackend().build_model(SPEC, init_weights(SPEC, 1))
    assert [(v.name, tuple(v.shape)) for v in model.trainable_variables] == [
        (f"{name}:0", shape) for name, shape in SPEC.variables()
    ]
    x, _ = batch(5)
    w = init_weights(SPEC, 1)
    h = np.maximum(x @ w["hidden1/kernel"] + w["hidden1/bias"], 0)
    h = np.maximum(h @ w["hidden2/kernel"] + w["hidden2/bias"], 0)
    np.testing.assert_allclose(model(x).numpy(), h @ w["logits/kernel"] + w["logits/bias"], rtol=1e-5)


def test_a_write_reaches_the_variables_before_they_are_next_used() -> None:
    """Writes are staged and assigned inside the next step; every other reader sees them too."""
    backend = TfBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 1))
    new = init_weights(SPEC, 2)
    backend.write_weights(model, new)
    x, _ = batch(3)
    reference = NumpyBackend().build_model(SPEC, new)
    np.testing.assert_allclose(model(x).numpy(), reference.logits(x)[0], rtol=1e-5)
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), new["hidden1/kernel"])


def test_writing_an_unknown_variable_names_the_known_ones() -> None:
    backend = TfBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    with pytest.raises(PsdkError, match=r"'dense/kernel'.*hidden1/bias"):
        backend.write_weights(model, {"dense/kernel": np.zeros((50, 32), np.float32)})


def test_keras_variables_are_named_from_their_paths() -> None:
    named = canonical_names(keras_mlp("net"))
    assert [name for name, _ in named] == [name for name, _ in SPEC.variables()]
    plain = tf.keras.Sequential([tf.keras.layers.Dense(4, name="a"), tf.keras.layers.Dense(2, name="b")])
    plain.build((None, 3))
    assert [name for name, _ in canonical_names(plain)] == ["a/kernel", "a/bias", "b/kernel", "b/bias"]
    inputs = tf.keras.Input((3,))
    functional = tf.keras.Model(inputs, tf.keras.layers.Dense(2, name="out")(inputs), name="f")
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
        canonical_names(tf.keras.Sequential([tf.keras.layers.Dense(2)]))
    with pytest.raises(PsdkError, match="distinct names"):
        canonical_names(type("M", (), {"trainable_variables": [tf.Variable(1.0), tf.Variable(2.0)]})())


def test_a_keras_model_matches_the_numpy_reference() -> None:
    """Keras Dense kernels are (in, out) already: psdk's weights go in unchanged."""
    backend, reference = TfBackend(), NumpyBackend()
    weights = init_weights(SPEC, 3)
    model, ref = keras_mlp(), reference.build_model(SPEC, weights)
    backend.write_weights(model, weights)
    assert list(backend.variables(model).items()) == SPEC.variables()
    x, y = batch()
    expected_loss = reference.forward_backward(ref, x, y)
    assert backend.forward_backward(model, x, y) == pytest.approx(expected_loss, rel=1e-5)
    grads, expected = zeros(), zeros()
    backend.read_gradients(model, grads)
    reference.read_gradients(ref, expected)
    for name in expected:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert backend.accuracy(model, x, y) == reference.accuracy(ref, x, y)


def test_recorded_gradients_are_what_a_step_pushes() -> None:
    backend = TfBackend()
    model = keras_mlp()
    out = zeros()
    with pytest.raises(PsdkError, match="record_gradients"):
        backend.read_gradients(model, out)
    x, y = batch()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(PsdkError, match="got 2 gradients for 6"):
        record_gradients(model, grads[:2])
    record_gradients(model, [*grads[:-1], None])  # an unused variable pushes zeros
    backend.read_gradients(model, out)
    np.testing.assert_allclose(out["hidden1/kernel"], grads[0].numpy(), rtol=1e-6)
    assert not out["logits/bias"].any()


def test_record_gradients_works_for_psdk_models_too() -> None:
    backend = TfBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    grads = [tf.ones(v.shape) * i for i, v in enumerate(model.trainable_variables)]
    record_gradients(model, grads)
    out = zeros()
    backend.read_gradients(model, out)
    assert [float(v.mean()) for v in out.values()] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_batches_of_other_sizes_and_label_dtypes_do_not_retrace() -> None:
    backend = TfBackend()
    model = keras_mlp("retrace")
    for size, dtype in ((64, np.int64), (100, np.int32), (7, np.uint8), (64, np.int64)):
        x, y = batch(size)
        backend.forward_backward(model, x, y.astype(dtype))
    assert binding(model)._step.experimental_get_tracing_count() <= 2  # reduce_retracing generalises
    stack = backend.build_model(SPEC, init_weights(SPEC, 0))
    assert isinstance(stack, DenseStack)
    for size in (64, 100, 7):
        backend.forward_backward(stack, *batch(size))  # traced once, at build, for any batch size


def test_binding_a_keras_model_does_not_keep_it_alive() -> None:
    model = keras_mlp("transient")
    TfBackend().forward_backward(model, *batch(4))
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None
