"""The click-through workload's trainer on TensorFlow: a DLRM-style model, mean BCE with logits, logits out.

psdk's ``ctr`` workload names no framework; this plugin gives it a
TensorFlow trainer through ``psdk_register_trainers`` (:mod:`psdk_tf.plugin`),
as it gives MNIST one. The model is the workload's: one shared table ``emb``
that every categorical field looks its ids up in, a bottom MLP over the dense
features (ReLU after each layer), the pairwise dot products ``i < j`` of the
27 vectors ``[bottom output, row of field 0, ..., row of field 25]``, and a
top MLP over ``[bottom output, the dots]`` (ReLU between its layers) to one
logit: the order of Facebook's DLRM and of the workload's numpy reference
(:mod:`psdk.workloads.ctr.model`), which every framework's trainer matches.

How it holds its variables, and why:

* **The table holds only pulled rows.** A ``capacity x dim`` ``tf.Variable``
  (what :mod:`psdk_tf.tables` scatters rows into) is filled when it is made:
  640 MB per worker for 10 million rows of 16 floats. The model keeps the
  rows the ps sent instead (:class:`~psdk_tf.pulled_rows.PulledRows`). A
  training step feeds the rows of the batch's distinct ids (in a training
  step, the very rows pulled for it) and each lookup's position among them
  (the batch's :meth:`~psdk.plugins.batches.JaggedIds.positions`, sorted
  once per batch); the graph gathers the ``[B, 26, dim]`` rows and its
  gradient at the distinct rows is summed per id (an ``IndexedSlices`` made
  dense): the row gradient psdk pushes, each id once and in order, so the
  worker sorts and sums nothing. Gathering every lookup in numpy and summing
  the per-lookup gradients in the client instead cost 4-5 ms more a step at
  batch 1024 (docs/ctr.md). Predictions gather in numpy (ids not held read zeros).
* **Dense weights are one flat input.** The eight dense variables live in
  one float32 buffer (canonical names and (in, out) kernels, as the ps keeps
  them); a step takes it as one tensor, splits it in the graph and returns
  the gradients as one flat tensor: one ``.numpy()`` per step, no variable
  assignments.
* **One trace for every batch.** The step and the logits are ``tf.function``
  s traced once, at build, with the batch dimension free (``None``), so
  neither a short last batch nor a new count of distinct ids retraces.

The interaction is arranged for one CPU thread: the Gram matrix ``v @ v.T``'s
gradient is one batched product ``(g + g.T) @ v`` (``tf.custom_gradient``),
not autograd's two, and the top MLP's first layer multiplies the whole
flattened Gram matrix by its kernel's rows spread to their ``(i, j)`` places
(zeros on and below the diagonal) instead of gathering the 351 dots out of
it, forward and back: 4-5 ms less per step at batch 1024. The trainer sets no threads: the job does
(``train.threads``). This module imports TensorFlow; psdk imports it only when
a job trains ``ctr`` on TensorFlow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from psdk.errors import ConfigError, PsdkError
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.protocol.ids import unique_positions
from psdk.protocol.sharding import flat_size, layout, views
from psdk.workloads.ctr.data import CAT_INPUT, DENSE_INPUT, TABLE, own_lookups
from psdk.workloads.ctr.model import fields_of, table_of
from psdk_tf._tf import tf
from psdk_tf.backend import TfBackend
from psdk_tf.models import OwnBinding
from psdk_tf.pulled_rows import PulledRows

_LAYER = re.compile(r"^(bottom|top)(\d+)/(kernel|bias)$")


def layer_counts(variables: list[tuple[str, tuple[int, ...]]]) -> tuple[int, int]:
    """How many layers the bottom and the top MLP have, numbered from 0, from the spec's dense variables."""
    numbers: dict[str, set[int]] = {"bottom": set(), "top": set()}
    for name, _ in variables:
        match = _LAYER.match(name)
        if match is None:
            raise ConfigError(
                "model", f"the ctr model on TensorFlow has dense layers bottom<i> and top<i>, not {name!r}"
            )
        numbers[match[1]].add(int(match[2]))
    bottom, top = (sorted(numbers[part]) for part in ("bottom", "top"))
    if not bottom or not top or bottom != list(range(len(bottom))) or top != list(range(len(top))):
        raise ConfigError(
            "model",
            f"the ctr model needs dense layers bottom0.. and top0.., numbered from 0; got bottom {bottom}, top {top}",
        )
    return len(bottom), len(top)


class ClickModel(OwnBinding):
    """DLRM-style: ``emb``'s pulled rows, the bottom MLP, the pairwise dots, the top MLP (see the module docstring).

    The interaction's vectors are the bottom output, then the fields' rows in
    field order; the top MLP reads the bottom output, then their dot products
    ``i < j`` in ``np.triu_indices(n, 1)`` order (row-major).
    """

    def __init__(self, spec: Any, weights: Mapping[str, np.ndarray], device: str = "/CPU:0"):
        table = table_of(spec, "TensorFlow")
        variables = [(name, tuple(int(d) for d in shape)) for name, shape in spec.variables()]
        self.bottom_layers, self.top_layers = layer_counts(variables)
        shapes = dict(variables)
        if shapes.get(f"bottom{self.bottom_layers - 1}/kernel", (0, 0))[1] != table.dim:
            raise ConfigError(
                "model",
                f"the bottom MLP's output ({shapes[f'bottom{self.bottom_layers - 1}/kernel'][1]}) meets the rows of "
                f"table {TABLE!r} ({table.dim} wide) in dot products: make them the same size",
            )
        self.top_inputs = shapes["top0/kernel"][0]
        self.fields = fields_of(self.top_inputs, table.dim)
        self.specs = layout(variables)
        self.flat = np.zeros(flat_size(self.specs), np.float32)
        self.grad_flat = np.zeros_like(self.flat)
        self.params, self.grads = views(self.flat, self.specs), views(self.grad_flat, self.specs)
        self.rows = PulledRows(TABLE, table.dim, table.capacity)
        self.dense = list(self.params.items())
        self.named = [*self.dense, (TABLE, self.rows)]
        self.tables = {TABLE: table}
        self._row_grads = (np.zeros(0, np.int64), np.zeros((0, table.dim), np.float32))
        self.write(weights)
        self._compile(shapes["bottom0/kernel"][0], table.dim, device)

    # ----------------------------------------------------------- graph code
    def _compile(self, features: int, dim: int, device: str) -> None:
        """Trace the step and the logits once, for any batch size (see the module docstring)."""
        vectors = self.fields + 1
        rows, cols = np.triu_indices(vectors, 1)
        where = np.zeros(vectors * vectors, np.int32)  # each Gram entry's dot, counted from 1; 0 on and below
        where[rows * vectors + cols] = np.arange(1, len(rows) + 1)  # the diagonal: no dot reads it
        self._where = tf.constant(where)
        flat = tf.TensorSpec([self.flat.size], tf.float32)
        dense = tf.TensorSpec([None, features], tf.float32)
        pulled = tf.TensorSpec([None, self.fields, dim], tf.float32)
        labels = tf.TensorSpec([None], tf.float32)
        distinct = tf.TensorSpec([None, dim], tf.float32)
        positions = tf.TensorSpec([None, self.fields], tf.int64)
        with tf.device(device):
            self._step = tf.function(
                self._loss_and_gradients, input_signature=[flat, dense, distinct, positions, labels]
            )
            self._logits = tf.function(self._forward, input_signature=[flat, dense, pulled])
            self._step.get_concrete_function()
            self._logits.get_concrete_function()

    def _forward(self, flat: Any, dense: Any, pulled: Any) -> Any:
        """The logits, [B], of dense features [B, 13] and the fields' rows [B, 26, dim]."""
        parts = tf.split(flat, [s.size for s in self.specs])
        w = {s.name: tf.reshape(part, s.shape) for s, part in zip(self.specs, parts, strict=True)}
        z = dense
        for i in range(self.bottom_layers):
            z = tf.nn.relu(tf.matmul(z, w[f"bottom{i}/kernel"]) + w[f"bottom{i}/bias"])
        gram = self._gram(tf.concat([z[:, None, :], pulled], axis=1))
        kernel, dim = w["top0/kernel"], self.rows.dim
        # top0 over [z, dots i < j] is z @ kernel[:dim] + gram @ (kernel's dot rows, each at its (i, j), zeros
        # elsewhere): one product over the whole Gram matrix costs less than picking the 351 dots out of it.
        spread = tf.gather(tf.concat([tf.zeros_like(kernel[:1]), kernel[dim:]], axis=0), self._where)
        x = tf.matmul(z, kernel[:dim]) + tf.matmul(gram, spread) + w["top0/bias"]
        for i in range(1, self.top_layers):
            x = tf.matmul(tf.nn.relu(x), w[f"top{i}/kernel"]) + w[f"top{i}/bias"]
        return x[:, 0]

    def _gram(self, vectors: Any) -> Any:
        """Each example's Gram matrix ``v @ v.T``, flattened to [B, n * n], with a hand-written gradient."""
        n = self.fields + 1

        @tf.custom_gradient
        def gram(v: Any) -> tuple[Any, Any]:
            def backward(d_gram: Any) -> Any:
                d = tf.reshape(d_gram, [-1, n, n])
                return tf.matmul(d + tf.transpose(d, [0, 2, 1]), v)

            return tf.reshape(tf.matmul(v, v, transpose_b=True), [-1, n * n]), backward

        return gram(vectors)

    def _loss_and_gradients(
        self, flat: Any, dense: Any, distinct: Any, positions: Any, labels: Any
    ) -> tuple[Any, Any, Any]:
        """The loss, the dense gradient and one summed gradient row per distinct id (see the module docstring)."""
        with tf.GradientTape() as tape:
            tape.watch([flat, distinct])
            logits = self._forward(flat, dense, tf.gather(distinct, positions))
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        d_flat, d_distinct = tape.gradient(loss, [flat, distinct])
        return loss, d_flat, tf.convert_to_tensor(d_distinct)  # the lookups' rows summed per id

    # -------------------------------------------------------------- a step
    def _inputs(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """(dense, ids) of ``batch``; a batch of another number of fields is refused by name."""
        cat = np.asarray(batch.inputs[CAT_INPUT], np.int64)
        if cat.ndim != 2 or cat.shape[1] != self.fields:
            fields = cat.shape[1] if cat.ndim == 2 else cat.shape
            raise ConfigError(
                "model",
                f"a batch of {fields} categorical fields is not what top0 takes ({self.top_inputs} inputs: the "
                f"bottom output and the dot products of {self.fields} fields' rows with it): the model's fields "
                "must be the data's",
            )
        return np.asarray(batch.inputs[DENSE_INPUT], np.float32), cat

    def train(self, batch: Batch) -> float:
        """One forward and backward pass: the loss; the gradients stay here for the bridge to read."""
        dense, cat = self._inputs(batch)
        distinct, positions = _distinct_ids(batch, cat)
        labels = np.asarray(batch.targets, np.float32)
        step = self._step(self.flat, dense, self.rows.rows_of(distinct), positions.reshape(cat.shape), labels)
        loss, d_flat, d_distinct = step
        self.rows.retire()
        np.copyto(self.grad_flat, d_flat.numpy())
        self._row_grads = (distinct.copy(), d_distinct.numpy())
        return float(loss.numpy())

    def logits(self, batch: Batch) -> np.ndarray:
        """The logits of ``batch``, float32 [B]; no gradient changes."""
        dense, cat = self._inputs(batch)
        return np.asarray(self._logits(self.flat, dense, self.rows.gather(cat)).numpy(), np.float32)

    # ---------------------------------------------------- the bridge's calls
    def read(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in self.params.items()}

    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            view = self.params.get(name)
            if view is None:
                if name == TABLE:
                    raise PsdkError(f"{name!r} is an embedding table: its rows travel by id (write_rows), never whole")
                raise PsdkError(f"the model has no variable {name!r}; its variables are {sorted(self.params)}")
            if view.shape != np.shape(value):
                raise PsdkError(f"{name}: cannot write shape {np.shape(value)} into a variable of {view.shape}")
            np.copyto(view, value)

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            grad = self.grads.get(name)
            if grad is None:
                raise PsdkError(f"the model has no dense variable {name!r}; its variables are {sorted(self.grads)}")
            np.copyto(view, grad)

    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        self._table(table).write(ids, rows)

    def read_row_gradients(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        self._table(table)
        return self._row_grads

    def _table(self, table: str) -> PulledRows:
        if table != TABLE:
            raise PsdkError(f"the model has no embedding table {table!r}; its tables are [{TABLE!r}]")
        return self.rows


def _distinct_ids(batch: Batch, cat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cat``'s distinct ids, sorted, and where each lookup is among them (the batch's own, when it has them)."""
    lookups = own_lookups(batch, cat)
    return (lookups.unique(), lookups.positions()) if lookups is not None else unique_positions(cat.reshape(-1))


class TfCtr(Trainer):
    """``ctr`` on TensorFlow: one traced step (forward, mean BCE with logits, backward), logits as float32 [B]."""

    bridge: TfBackend
    bridge_class = TfBackend

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> ClickModel:
        """``spec``'s model holding ``weights`` (dense only: the rows come from the ps), its step traced now."""
        return ClickModel(spec, weights, self.bridge.plan.tf_device)

    def forward_backward(self, model: ClickModel, batch: Batch) -> float:
        return model.train(batch)

    def predict(self, model: ClickModel, batch: Batch) -> np.ndarray:
        """The logits of ``batch``, float32 [B]; the workload scores their AUC and log loss."""
        return model.logits(batch)
