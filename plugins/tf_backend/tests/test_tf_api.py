"""A Keras model from outside psdk trains through the public API, as a TensorFlow user writes it."""

from __future__ import annotations

import keras
import numpy as np
import psdk_tf
import tensorflow as tf

import psdk
from psdk.testing.ps import RunningPs


def model() -> keras.Model:
    net = keras.Sequential(
        [keras.layers.Dense(16, activation="relu", name="hidden1"), keras.layers.Dense(10, name="logits")]
    )
    net.build((None, 50))
    return net


def test_a_keras_model_trains_through_the_public_api(psdk_ps: RunningPs) -> None:
    rng = np.random.default_rng(5)
    x, y = rng.random((64, 50), dtype=np.float32), rng.integers(0, 10, 64)
    net, reference = model(), model()
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
