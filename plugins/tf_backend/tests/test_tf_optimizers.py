"""Keras optimizers and ps update rules: both ways, the same updates, and clear refusals."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from psdk_tf.optimizers import make_optimizer, optimizer_rule

from psdk.errors import ConfigError
from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule

ROUND_TRIP = [
    SGD(lr=0.05, momentum=0.9),
    SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    Adam(lr=1e-3),  # epsilon_mode="torch": Keras cannot say it, the kept rule does
    Adam(lr=1e-3, eps=1e-7, epsilon_mode="tf", decay_rate=0.5, decay_steps=100),
    SGD(lr=0.1, momentum=0.9, weight_decay=1e-4, decay="cosine", decay_rate=0.0, decay_steps=6000),
    Adagrad(lr=0.1, initial_accumulator_value=0.1),
    RMSProp(lr=0.01, alpha=0.9, momentum=0.5, centered=True),
]


@pytest.mark.parametrize("rule", ROUND_TRIP, ids=lambda r: r.name)
def test_a_rule_survives_the_round_trip_through_keras(rule: UpdateRule) -> None:
    assert optimizer_rule(make_optimizer(rule)) == rule


KERAS: list[tuple[Any, UpdateRule]] = [
    (keras.optimizers.SGD(0.05), SGD(lr=0.05)),
    (keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), SGD(lr=0.05, momentum=0.9, nesterov=True)),
    (keras.optimizers.Adam(), Adam(lr=0.001, eps=1e-7, epsilon_mode="tf")),
    (keras.optimizers.Adagrad(0.1), Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-7)),
    (keras.optimizers.RMSprop(), RMSProp(lr=0.001, alpha=0.9, eps=1e-7)),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.5)),
        SGD(lr=0.1, decay_rate=0.5, decay_steps=100),
    ),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.1, 100, alpha=0.25)),
        SGD(lr=0.1, decay="cosine", decay_rate=0.25, decay_steps=100),
    ),
]


def test_the_cosine_decay_is_keras_cosine_decay() -> None:
    """The ps's rate at each update is the one Keras's schedule gives at that step."""
    rule = SGD(lr=0.1, decay="cosine", decay_rate=0.25, decay_steps=100)
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 100, alpha=0.25)
    for step in (0, 1, 30, 50, 99, 100, 250):
        assert rule.lr_at(step) == pytest.approx(float(schedule(step)), rel=1e-5)


@pytest.mark.parametrize("optimizer, rule", KERAS, ids=lambda o: type(o).__name__)
def test_a_keras_optimizer_maps_to_its_rule(optimizer: Any, rule: UpdateRule) -> None:
    """Keras's own defaults (rho 0.9, epsilon 1e-7, TF-style Adam epsilon) carry over."""
    assert optimizer_rule(optimizer) == rule


def test_a_changed_optimizer_no_longer_answers_with_the_kept_rule() -> None:
    optimizer = make_optimizer(SGD(lr=0.05, momentum=0.9, weight_decay=1e-4))
    optimizer.learning_rate = 0.2
    assert optimizer_rule(optimizer) == SGD(lr=0.2, momentum=0.9)


REFUSED: list[tuple[Any, str]] = [
    (
        keras.optimizers.AdamW(),
        r"^optimizer: keras.optimizers.AdamW has no ps update rule.*keras.optimizers.SGD",
    ),
    (keras.optimizers.Nadam(), "Nadam has no ps update rule"),
    (keras.optimizers.Adam(amsgrad=True), r"^optimizer.amsgrad: .*leave it at False"),
    (keras.optimizers.SGD(weight_decay=0.01), r"^optimizer.weight_decay: .*decoupled"),
    (keras.optimizers.SGD(clipnorm=1.0), r"^optimizer.clipnorm"),
    (keras.optimizers.SGD(use_ema=True), r"^optimizer.use_ema"),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)),
        r"^optimizer.learning_rate: .*staircase",
    ),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.1, 0.01])),
        r"^optimizer.learning_rate: the schedule PiecewiseConstantDecay",
    ),
    ("sgd", "expected a Keras optimizer"),
]


@pytest.mark.parametrize("optimizer, message", REFUSED, ids=lambda o: type(o).__name__)
def test_optimizers_without_a_ps_rule_are_refused_by_name(optimizer: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        optimizer_rule(optimizer)


UPDATES = [
    keras.optimizers.SGD(0.1),
    keras.optimizers.SGD(0.05, momentum=0.9),
    keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    keras.optimizers.Adam(0.01),
    keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-3),  # where the epsilons differ
    # Keras adds Adagrad's and RMSprop's epsilon inside the root, the ps outside: a
    # negligible epsilon shows that everything else agrees.
    keras.optimizers.Adagrad(0.1, epsilon=1e-16),
    keras.optimizers.RMSprop(0.01, epsilon=1e-16),
    keras.optimizers.RMSprop(0.01, momentum=0.9, centered=True, epsilon=1e-16),
    keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 5, 0.5)),
]


@pytest.mark.parametrize("optimizer", UPDATES, ids=lambda o: type(o).__name__)
def test_the_rule_updates_as_the_keras_optimizer_would(optimizer: Any) -> None:
    """Twenty steps of the mapped rule in numpy against Keras's own apply_gradients."""
    rule = optimizer_rule(optimizer)
    rng = np.random.default_rng(3)
    start = rng.normal(size=1000).astype(np.float32)
    grads = [rng.normal(size=1000).astype(np.float32) for _ in range(20)]
    params, state = start.copy(), rule.new_state(start.size)
    for g in grads:
        rule.apply(params, g, state)
    variable = tf.Variable(start)
    for g in grads:
        optimizer.apply_gradients([(tf.constant(g), variable)])
    np.testing.assert_allclose(params, variable.numpy(), rtol=1e-5, atol=1e-6)
