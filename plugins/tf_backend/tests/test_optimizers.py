"""Keras optimizers and ps update rules: the same updates, Keras's defaults and schedules, and clear refusals.

The round trip of every rule is the conformance suite's (test_conformance.py);
this file holds what only Keras has.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from psdk_tf.optimizers import make_optimizer, optimizer_rule

from psdk.errors import ConfigError
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing import RuleAgreement
from psdk.testing.rule_agreement import CASES

EPSILON_INSIDE_THE_ROOT = (
    "Keras adds epsilon inside the square root, the ps outside: with the rule's epsilon the two part where "
    "the accumulated squares are small (the -tiny-eps case checks everything else)"
)


class TestKerasOptimizersAgreeWithTheRules(RuleAgreement):
    """Each rule, in numpy, against the Keras optimizer the backend makes for it: 20 steps of apply_gradients."""

    cases = {
        **CASES,
        "adam-options-tf-epsilon": Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=0.1, epsilon_mode="tf"),
        "rmsprop-tiny-eps": RMSProp(lr=0.01, eps=1e-16),
        "rmsprop-centered-momentum-tiny-eps": RMSProp(lr=0.01, momentum=0.9, centered=True, eps=1e-16),
        "exponential-decay": SGD(lr=0.1, decay_rate=0.5, decay_steps=5),
        "cosine-decay": SGD(lr=0.1, decay="cosine", decay_rate=0.25, decay_steps=10),
        "cosine-decay-momentum": SGD(lr=0.1, momentum=0.9, decay="cosine", decay_rate=0.25, decay_steps=10),
    }
    skipped = {
        "adam-options": "Keras adds Adam's epsilon to the uncorrected root (epsilon_mode='tf'); with eps=1e-6 the "
        "conventions part (the -tf-epsilon case checks Keras's own)",
        "rmsprop": EPSILON_INSIDE_THE_ROOT,
        "rmsprop-centered-momentum": EPSILON_INSIDE_THE_ROOT,
        "cosine-decay-momentum": "Keras scales each step by the rate before adding it to the momentum, the ps (as "
        "torch) after: with a decaying rate, Keras's past steps keep the rate they were taken at",
    }

    def framework_steps(self, rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        optimizer = make_optimizer(rule)
        variable = tf.Variable(start)
        l2 = getattr(rule, "weight_decay", 0.0)  # Keras has no L2 decay: its user adds the term to the loss
        for g in grads:
            optimizer.apply_gradients([(tf.constant(g) + l2 * variable, variable)])
        return variable.numpy()


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


@pytest.mark.parametrize("optimizer, rule", KERAS, ids=lambda o: type(o).__name__)
def test_a_keras_optimizer_written_by_hand_maps_to_its_rule(optimizer: Any, rule: UpdateRule) -> None:
    """Keras's own defaults (rho 0.9, epsilon 1e-7, TF-style Adam epsilon) and schedules carry over."""
    assert optimizer_rule(optimizer) == rule


def test_the_cosine_decay_is_keras_cosine_decay() -> None:
    """The ps's rate at each update is the one Keras's schedule gives at that step."""
    rule = SGD(lr=0.1, decay="cosine", decay_rate=0.25, decay_steps=100)
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 100, alpha=0.25)
    for step in (0, 1, 30, 50, 99, 100, 250):
        assert rule.lr_at(step) == pytest.approx(float(schedule(step)), rel=1e-5, abs=1e-8)


def test_a_changed_optimizer_no_longer_answers_with_the_kept_rule() -> None:
    optimizer = make_optimizer(SGD(lr=0.05, momentum=0.9, weight_decay=1e-4))
    optimizer.learning_rate = 0.2
    assert optimizer_rule(optimizer) == SGD(lr=0.2, momentum=0.9)


REFUSED: list[tuple[Any, str]] = [
    (
        keras.optimizers.AdamW(),
        r"^optimizer: keras.optimizers.AdamW has no ps update rule.*rule=.*keras.optimizers.SGD",
    ),
    (keras.optimizers.Adam(amsgrad=True), r"^optimizer.amsgrad: Adam\(amsgrad=True\) .*leave it at False"),
    (keras.optimizers.SGD(weight_decay=0.01), r"^optimizer.weight_decay: .*decoupled.*L2"),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)),
        r"^optimizer.learning_rate: .*staircase",
    ),
    (
        keras.optimizers.SGD(keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.1, 0.01])),
        r"^optimizer.learning_rate: the schedule PiecewiseConstantDecay",
    ),
    ("sgd", r"expected a Keras optimizer.*rule="),
]


@pytest.mark.parametrize("optimizer, message", REFUSED, ids=lambda o: type(o).__name__)
def test_refusals_say_what_to_do_instead(optimizer: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        optimizer_rule(optimizer)
