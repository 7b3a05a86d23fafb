"""Embedding tables on TensorFlow: which variables are tables, rows in, row gradients out.

A table is a 2-D variable whose rows a batch looks up by id, as a
recommendation model's embeddings are. The ps keeps its real rows
(docs/tables.md); the worker's variable (``capacity x dim``, ids index it
directly) holds only the rows of the ids its batch needs, written by
:func:`write_rows` with one scatter, never assigned whole.

Which variables are tables:

* the weight of each Keras ``Embedding`` layer of a Keras model (not one
  with LoRA or quantisation on: its looked-up matrix is no variable);
* a variable marked with :func:`mark_table`, for a ``tf.Module`` or a
  custom layer that looks rows up with ``tf.nn.embedding_lookup`` or
  ``tf.gather``.

The gradient of a lookup is ``tf.IndexedSlices`` (ids, one row per
occurrence), which :func:`row_gradients` hands over as numpy as it is.
It never converts a table's gradient to a dense tensor, and refuses one
that came dense: that is a whole table per step, what tables exist to avoid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.variables import Rows
from psdk_tf._tf import keras, tf

_MARK = "_psdk_table"
"""The attribute :func:`mark_table` sets on a variable: its :class:`Rows` record."""


def mark_table(variable: Any, initializer: str = "normal", init_scale: float = 0.01) -> Any:
    """Declare ``variable`` (``capacity x dim``) an embedding table; returns it.

    For a variable looked up with ``tf.nn.embedding_lookup`` (or
    ``tf.gather``) rather than through a Keras ``Embedding``; the ps draws
    its rows with ``initializer`` (``normal``, ``uniform``, ``zeros``) at
    ``init_scale``, so the variable's own values are never used::

        self.emb = psdk_tf.mark_table(tf.Variable(tf.zeros((vocab, dim)), name="emb"))
    """
    shape = tuple(int(d) for d in variable.shape)
    if len(shape) != 2:
        raise PsdkError(f"an embedding table is a 2-D variable (capacity x dim), got shape {shape}")
    try:
        rows = Rows(dim=shape[1], capacity=shape[0], initializer=initializer, init_scale=float(init_scale))
    except ValueError as exc:
        raise PsdkError(f"mark_table: {exc}") from None
    setattr(variable, _MARK, rows)
    return variable


def declared(model: Any, named: Sequence[tuple[str, Any]]) -> dict[str, Rows]:
    """The tables among ``named`` (the model's canonical names and variables), by name."""
    embeddings = {id(var): rows for var, rows in _keras_embeddings(model)}
    tables = {}
    for name, var in named:
        rows = getattr(var, _MARK, None) or embeddings.get(id(var))
        if rows is not None:
            tables[name] = rows
    return tables


def _keras_embeddings(model: Any) -> list[tuple[Any, Rows]]:
    """Each Keras ``Embedding`` layer's weight in ``model``, with the rows record it stands for."""
    if not isinstance(model, keras.layers.Layer):
        return []
    found = []
    # Keras 3 has no public walk over nested layers; _flatten_layers is what its own summary uses.
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not isinstance(layer, keras.layers.Embedding) or not layer.built:
            continue
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            continue
        initializer, scale = _initializer(layer.embeddings_initializer)
        rows = Rows(dim=int(layer.output_dim), capacity=int(layer.input_dim), initializer=initializer, init_scale=scale)
        found.append((layer.embeddings, rows))
    return found


def _initializer(init: Any) -> tuple[str, float]:
    """psdk's row initializer for a Keras one it can draw: zeros, N(0, s²), U(-a, a); else N(0, 0.01²)."""
    if isinstance(init, keras.initializers.Zeros):
        return "zeros", 0.01
    config = init.get_config() if hasattr(init, "get_config") else {}
    if isinstance(init, keras.initializers.RandomNormal) and float(config.get("mean", 0.0)) == 0.0:
        return "normal", float(config["stddev"])
    if isinstance(init, keras.initializers.RandomUniform):
        low, high = float(config["minval"]), float(config["maxval"])
        if low == -high and high > 0:
            return "uniform", high
    return "normal", 0.01


def write_rows(name: str, variable: Any, ids: np.ndarray, rows: np.ndarray) -> None:
    """Scatter ``rows`` into ``variable`` at ``ids``: only those rows are written."""
    capacity, dim = (int(d) for d in variable.shape)
    ids = np.asarray(ids, np.int64).reshape(-1)
    rows = np.asarray(rows, np.float32)
    if rows.shape != (len(ids), dim):
        raise PsdkError(f"table {name!r}: got rows of shape {rows.shape} for {len(ids)} ids of width {dim}")
    if not len(ids):
        return
    if int(ids.min()) < 0 or int(ids.max()) >= capacity:
        raise PsdkError(
            f"table {name!r}: ids must index its {capacity} local rows (0 .. {capacity - 1}), got "
            f"{int(ids.min())} .. {int(ids.max())}; hash ids into [0, capacity) before the lookup"
        )
    # A Keras 3 variable wraps a tf.Variable (.value); a tf.Variable's own .value is a method.
    target = variable if isinstance(variable, tf.Variable) else variable.value
    if not isinstance(target, tf.Variable):  # inside a Keras stateless or autocast scope: a tensor, not the variable
        raise PsdkError(f"table {name!r}: write rows outside the model's forward pass, where it is a variable")
    target.scatter_update(tf.IndexedSlices(tf.constant(rows), tf.constant(ids)))


def row_gradients(name: str, variable: Any, gradient: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64, rows float32)`` of a table's gradient, one row per lookup; empty when it was not used."""
    dim = int(variable.shape[1])
    if gradient is None:
        return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    if not isinstance(gradient, tf.IndexedSlices):
        raise PsdkError(
            f"the gradient of embedding table {name!r} is a dense tensor of shape "
            f"{tuple(gradient.shape)}, not tf.IndexedSlices: psdk pushes a table's gradient as the rows a batch "
            "looked up and never a whole table. Look rows up with keras.layers.Embedding, tf.nn.embedding_lookup "
            "or tf.gather, keep the table out of anything that reads it whole (a regularizer, a norm, a matmul), "
            "and pass tape.gradient's result to record_gradients unconverted"
        )
    ids = np.asarray(gradient.indices.numpy(), np.int64).reshape(-1)
    values = np.asarray(gradient.values.numpy(), np.float32).reshape(len(ids), dim)
    return ids, values
