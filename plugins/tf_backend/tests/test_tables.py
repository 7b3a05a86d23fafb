"""Embedding tables on the TensorFlow bridge: the table conformance suite, and Keras ``Embedding`` layers.

The suite's table is called ``emb``; a Keras ``Embedding`` layer's weight is
always ``<layer>/embeddings``, so the suite runs on the two models whose
table a user marks (:func:`psdk_tf.mark_table`): a ``tf.Module`` and a Keras
model, both looking rows up with ``tf.nn.embedding_lookup``. Keras
``Embedding`` layers have the checks below, the same ones under their name.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from psdk_tf import mark_table, record_gradients
from psdk_tf.backend import TfBackend

import psdk
from psdk.errors import ConfigError, PsdkError
from psdk.plugins.backend import Backend
from psdk.plugins.variables import Dense, Rows
from psdk.testing import TableConformance
from psdk.testing.ps import running_ps
from psdk.testing.table_conformance import CAPACITY, DIM, IDS

from .conftest import SPEC, zeros

pytestmark = pytest.mark.timeout(120)


class TableModule(tf.Module):
    """The suite's model as a ``tf.Module``: a marked table and a kernel, named as the suite names them."""

    def __init__(self) -> None:
        super().__init__(name="table_module")
        self.emb = mark_table(tf.Variable(tf.zeros((CAPACITY, DIM)), name="emb"))
        self.kernel = tf.Variable(tf.zeros((DIM, 1)), name="out/kernel")

    def __call__(self, ids: Any) -> Any:
        return tf.matmul(tf.nn.embedding_lookup(self.emb, ids), self.kernel)


class TableKeras(keras.Model):
    """The suite's model in Keras: a table the model marks, looked up with ``tf.nn.embedding_lookup``."""

    def __init__(self) -> None:
        super().__init__(name="table_keras")
        self.emb = mark_table(self.add_weight(name="emb", shape=(CAPACITY, DIM), initializer="zeros"))
        self.out = keras.layers.Dense(1, use_bias=False, name="out")
        self.out.build((None, DIM))

    def call(self, ids: Any) -> Any:
        return self.out(tf.nn.embedding_lookup(self.emb, ids))


def backward(model: Any, ids: np.ndarray) -> float:
    """``sum(emb[ids] @ kernel)`` under a tape, its gradients left where the backend reads them."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(ids)))
    record_gradients(model, tape.gradient(loss, model.trainable_variables))
    return float(loss)


class TestTfModuleTables(TableConformance):
    backend_name = "tf"

    def table_model(self, backend: Backend) -> Any:
        return TableModule()

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        return backward(model, ids)


class TestTfKerasTables(TableConformance):
    backend_name = "tf"

    def table_model(self, backend: Backend) -> Any:
        return TableKeras()

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        return backward(model, ids)


# ---------------------------------------------------------------- Keras Embedding
EMB = "emb/embeddings"


def embedding_net(initializer: Any = "uniform", regularizer: Any = None) -> keras.Model:
    """``Embedding(CAPACITY, DIM)`` then a kernel, as a Keras user writes it."""
    model = keras.Sequential(
        [
            keras.layers.Embedding(
                CAPACITY, DIM, embeddings_initializer=initializer, embeddings_regularizer=regularizer, name="emb"
            ),
            keras.layers.Dense(1, use_bias=False, name="out"),
        ],
        name="net",
    )
    model.build((None, None))
    return model


@pytest.fixture
def tf_backend(backend: TfBackend) -> TfBackend:
    return backend


@pytest.mark.parametrize(
    ("initializer", "expected"),
    [
        ("uniform", ("uniform", 0.05)),  # Keras's default: U(-0.05, 0.05)
        (keras.initializers.RandomNormal(stddev=0.02), ("normal", 0.02)),
        ("zeros", ("zeros", 0.01)),
        ("glorot_uniform", ("normal", 0.01)),  # none psdk draws: its default
    ],
)
def test_a_keras_embedding_is_a_table_drawn_like_its_initializer(
    tf_backend: TfBackend, initializer: Any, expected: tuple[str, float]
) -> None:
    model = embedding_net(initializer)
    records = tf_backend.variable_records(model)
    assert records == {EMB: Rows(DIM, CAPACITY, *expected), "out/kernel": Dense((DIM, 1))}
    assert tf_backend.variables(model) == {"out/kernel": (DIM, 1)}
    assert set(tf_backend.read_weights(model)) == {"out/kernel"}


def test_rows_go_into_a_keras_embedding_and_come_back_as_indexed_slices(tf_backend: TfBackend) -> None:
    model = embedding_net()
    kernel = np.arange(1, DIM + 1, dtype=np.float32).reshape(DIM, 1)
    tf_backend.write_weights(model, {"out/kernel": kernel})
    unique = np.unique(IDS)
    rows = np.random.default_rng(0).normal(size=(len(unique), DIM)).astype(np.float32)
    before = model.get_layer("emb").embeddings.numpy()
    tf_backend.write_rows(model, EMB, unique, rows)
    after = model.get_layer("emb").embeddings.numpy()
    np.testing.assert_array_equal(after[unique], rows)
    untouched = np.setdiff1d(np.arange(CAPACITY), unique)
    np.testing.assert_array_equal(after[untouched], before[untouched])

    batch = IDS.reshape(1, -1)  # (batch, sequence) ids, as a Keras model gets them
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(batch), training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    record_gradients(model, grads)
    ids, values = tf_backend.read_row_gradients(model, EMB)
    assert ids.dtype == np.int64 and values.dtype == np.float32
    np.testing.assert_array_equal(ids, IDS)
    np.testing.assert_allclose(values, np.repeat(kernel.reshape(1, DIM), len(IDS), axis=0), atol=1e-6)
    out = {"out/kernel": np.zeros((DIM, 1), np.float32)}
    tf_backend.read_gradients(model, out)
    by_id = dict(zip(unique.tolist(), rows, strict=True))
    expected = np.sum([by_id[int(i)] for i in IDS], axis=0).reshape(DIM, 1)
    np.testing.assert_allclose(out["out/kernel"], expected, rtol=1e-5, atol=1e-5)


def test_an_untouched_table_reads_no_rows(tf_backend: TfBackend) -> None:
    model = embedding_net()
    record_gradients(model, [None, tf.zeros((DIM, 1))])
    ids, values = tf_backend.read_row_gradients(model, EMB)
    assert ids.shape == (0,) and ids.dtype == np.int64
    assert values.shape == (0, DIM) and values.dtype == np.float32


def test_a_dense_gradient_on_a_table_is_refused(tf_backend: TfBackend) -> None:
    """An L2 regularizer reads the whole table, so its gradient comes dense: refused, never pushed whole."""
    model = embedding_net(regularizer=keras.regularizers.L2(1e-4))
    with tf.GradientTape() as tape:
        out = model(tf.constant([[1, 2]]), training=True)
        loss = tf.reduce_sum(out) + tf.add_n(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    assert not isinstance(grads[0], tf.IndexedSlices)
    record_gradients(model, grads)
    with pytest.raises(PsdkError, match=r"emb/embeddings.*dense tensor of shape \(64, 4\).*never a whole table"):
        tf_backend.read_row_gradients(model, EMB)


def test_a_table_never_travels_whole(tf_backend: TfBackend) -> None:
    model = embedding_net()
    record_gradients(model, [None, None])
    with pytest.raises(PsdkError, match="emb/embeddings' is an embedding table"):
        tf_backend.write_weights(model, {EMB: np.zeros((CAPACITY, DIM), np.float32)})
    with pytest.raises(PsdkError, match="emb/embeddings' is an embedding table"):
        tf_backend.read_gradients(model, {EMB: np.zeros((CAPACITY, DIM), np.float32)})


def test_bad_rows_and_names_are_refused(tf_backend: TfBackend) -> None:
    model = embedding_net()
    with pytest.raises(PsdkError, match=r"ids must index its 64 local rows \(0 \.\. 63\), got 3 \.\. 64"):
        tf_backend.write_rows(model, EMB, np.array([3, 64], np.int64), np.zeros((2, DIM), np.float32))
    with pytest.raises(PsdkError, match=r"rows of shape \(2, 3\) for 2 ids of width 4"):
        tf_backend.write_rows(model, EMB, np.array([3, 4], np.int64), np.zeros((2, 3), np.float32))
    with pytest.raises(PsdkError, match=r"no embedding table 'out/kernel'; its tables are \['emb/embeddings'\]"):
        tf_backend.write_rows(model, "out/kernel", np.array([0], np.int64), np.zeros((1, DIM), np.float32))
    with pytest.raises(PsdkError, match="a 2-D variable"):
        mark_table(tf.Variable(tf.zeros(3)))
    stack = tf_backend.build_model(SPEC, zeros())
    with pytest.raises(ConfigError, match="dense stack keeps no embedding tables"):
        tf_backend.read_row_gradients(stack, "emb")


def test_a_keras_embedding_trains_through_a_ps_with_a_keras_optimizer(tf_backend: TfBackend) -> None:
    """docs/tables.md's model: rows pulled, a step with Keras SGD, the touched rows moved on the ps."""
    lr, seed, ids = 0.5, 3, np.array([[5, 9, 5]], np.int64)
    model = keras.Sequential(
        [
            keras.layers.Embedding(CAPACITY, DIM, embeddings_initializer="zeros", name="emb"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="out"),
        ],
        name="ctr",
    )
    model.build((None, None))
    with running_ps() as ps, psdk.connect(ps.cluster(1), 0, steps=1, transport=ps.transport) as session:
        opt = psdk.DistributedOptimizer(keras.optimizers.SGD(lr), model, session, seed=seed)
        opt.broadcast_parameters()
        assert opt.tables[EMB].initializer == "zeros"
        opt.pull_rows({EMB: ids})
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(ids), training=True))
        record_gradients(model, tape.gradient(loss, model.trainable_variables))
        opt.step()
        rows = session.client.pull_rows({EMB: np.array([5, 9], np.int64)}, read=True)[EMB]
        session.finish(wait_s=30)
    # d loss / d row = (occurrences / sequence length) * kernel (ones); rows started at zeros.
    np.testing.assert_allclose(rows, -lr * np.array([[2 / 3] * DIM, [1 / 3] * DIM]), atol=1e-6)
