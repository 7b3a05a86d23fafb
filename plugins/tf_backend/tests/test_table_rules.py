"""psdk's update rules on embedding rows against TensorFlow's own sparse applies on ``tf.nn.embedding_lookup``.

Each test looks rows up with ``tf.nn.embedding_lookup`` under a
``GradientTape``, so the variable's gradient is an ``IndexedSlices``
(indices with duplicates, one value row per lookup), applies it with
TensorFlow's optimizer, and pushes the very same indices and values through
a real ps (:mod:`psdk.testing.row_rules`); every row is compared after
every step. The TensorFlow 1.x optimizers run eagerly from ``tf.compat.v1``
(``apply_gradients`` on a ``tf.Variable`` needs no graph), and sum an
``IndexedSlices``' duplicate indices before their sparse apply, as psdk's
client does.

* ``tf.compat.v1.train.AdagradOptimizer(lr, initial_accumulator_value=0.1)``
  = psdk ``Adagrad(initial_accumulator_value=0.1, eps=0)``.
* ``tf.compat.v1.train.MomentumOptimizer`` (and ``use_nesterov``) = psdk
  ``SGD(momentum=...)`` on rows: both move only the touched rows'
  accumulators.
* ``keras.optimizers.Adam`` on an ``IndexedSlices`` is *not* lazy: it decays
  every row's moments and moves rows the batch did not touch. It agrees with
  psdk ``Adam(epsilon_mode="tf")`` when every row is touched on every step;
  for lazy Adam the reference is ``torch.optim.SparseAdam`` (the torch
  plugin's tests). LazyAdam (TensorFlow Addons) is not installed here.
  Keras also squares an ``IndexedSlices``' values before it sums duplicate
  indices (so ``v`` gets ``sum g_i^2`` where TensorFlow 1.x, torch and psdk
  take ``(sum g_i)^2``): its comparison uses batches without duplicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from psdk.ps.rules import SGD, Adagrad, Adam, UpdateRule
from psdk.testing.row_rules import table_on_a_ps

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 8, 3
BATCHES = [[1, 4, 4, 6], [1, 2], [4, 6, 6, 6, 0], [1], [2, 4], [6, 1, 1]]
"""Ids per step, with duplicates; rows 3, 5 and 7 are never touched, the others skip some steps."""
EVERY_ROW = [[3, 0, 1, 2, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
"""Every row on every step, each once (see the Keras tests)."""
RTOL, ATOL = 1e-5, 1e-6


@dataclass
class Run:
    """Both sides of one run: (TensorFlow's rows, the ps's rows) after each step."""

    after: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


def run_both(rule: UpdateRule, optimizer: Any, batches: list[list[int]]) -> Run:
    """TensorFlow's ``optimizer`` and the ps's ``rule`` over ``batches``, from the same rows and gradients."""
    rng = np.random.default_rng(0)
    run = Run()
    with table_on_a_ps(rule, ROWS, DIM) as table:
        variable = tf.Variable(table.initial())
        for ids in batches:
            weights = tf.constant(rng.standard_normal((len(ids), DIM)).astype(np.float32))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.embedding_lookup(variable, tf.constant(ids, tf.int64)) * weights)
            grad = tape.gradient(loss, variable)
            assert isinstance(grad, tf.IndexedSlices)
            table.push(grad.indices.numpy(), grad.values.numpy())
            optimizer.apply_gradients([(grad, variable)])
            run.after.append((variable.numpy().copy(), table.rows(range(ROWS))))
    return run


def assert_same(run: Run, rows: list[int] | slice = slice(None)) -> None:
    for step, (theirs, ours) in enumerate(run.after, start=1):
        np.testing.assert_allclose(ours[rows], theirs[rows], rtol=RTOL, atol=ATOL, err_msg=f"step {step}")


def test_adagrad_on_rows_is_tf1_adagrad_with_its_initial_accumulator_and_no_epsilon() -> None:
    tf1 = lambda: tf.compat.v1.train.AdagradOptimizer(0.1, initial_accumulator_value=0.1)  # noqa: E731
    assert_same(run_both(Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=0.0), tf1(), BATCHES))
    # torch's defaults (sums from 0, eps outside the root) are another rule: the comparison can tell them apart.
    theirs, ours = run_both(Adagrad(lr=0.1), tf1(), BATCHES).after[-1]
    assert float(np.abs(theirs - ours).max()) > 100 * ATOL


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_on_rows_is_tf1_sparse_momentum(nesterov: bool) -> None:
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=nesterov)
    run = run_both(SGD(lr=0.1, momentum=0.9, nesterov=nesterov), optimizer, BATCHES)
    assert_same(run)
    np.testing.assert_array_equal(run.after[1][1][2], run.after[2][1][2])  # row 2 skips step 3: not moved


MakeAdam = Callable[[], keras.optimizers.Optimizer]
KERAS_ADAM: MakeAdam = lambda: keras.optimizers.Adam(learning_rate=0.01, beta_1=0.8, beta_2=0.9, epsilon=0.05)  # noqa: E731
PSDK_ADAM = Adam(lr=0.01, beta1=0.8, beta2=0.9, eps=0.05, epsilon_mode="tf")


def test_keras_adam_is_psdk_adam_with_tf_epsilon_when_every_row_is_touched() -> None:
    """Without duplicate ids: Keras squares an ``IndexedSlices``' values before it sums duplicates, psdk after."""
    assert_same(run_both(PSDK_ADAM, KERAS_ADAM(), EVERY_ROW))


def test_keras_adam_on_indexed_slices_is_not_lazy_where_psdk_adam_is() -> None:
    """Row 1 sits out step 2: Keras moves it all the same, psdk leaves it (and its moments) alone."""
    run = run_both(PSDK_ADAM, KERAS_ADAM(), [[0, 1, 2], [0, 2], [0, 1], [0, 1, 2]])
    assert_same(run, [0, 3, 4, 5, 6, 7])  # touched on every step, or never: the same
    (keras_1, ours_1), (keras_2, ours_2) = run.after[0], run.after[1]
    assert float(np.abs(keras_2[1] - keras_1[1]).max()) > 1e-4
    np.testing.assert_array_equal(ours_2[1], ours_1[1])
