"""The models the tf backend trains, and how it reaches their variables and gradients.

Two kinds of model, behind one small interface (:class:`DenseStack` and
:class:`ForeignModel`; :func:`binding` picks):

* :class:`DenseStack`, psdk's :class:`~psdk.plugins.models.ModelSpec` network, built by
  the backend. Its variables are in the canonical layout by construction:
  ``hidden1/kernel`` of shape (in, out), ``hidden1/bias``, ..., ``logits/bias``,
  in :meth:`ModelSpec.variables` order, so nothing is transposed on the way to
  or from the ps. It is the fast path of the MNIST job: weights written by the
  ps are staged in one flat float32 buffer and assigned inside the next
  training step, so a step costs one ``tf.function`` call (assign, forward,
  backward) whose gradients come back as one flat tensor and one ``.numpy()``.
* Any other Keras model (or ``tf.Module``) with ``trainable_variables``, wrapped
  by :class:`ForeignModel`, for training scripts on the public API. Its
  variables are named by :func:`canonical_names` and kept in Keras's own
  layout, which for ``Dense`` kernels is already (in, out).
* A model that is its own binding (:class:`OwnBinding`), as the click-through
  trainer's (:mod:`psdk_tf.ctr`): it keeps its weights, gradients and a
  table's pulled rows itself, so the bridge only hands calls over.

The loss is not the bridge's: a workload's trainer (MNIST's is
:mod:`psdk_tf.mnist`) hands a binding its loss as graph code,
``loss(call, *tensors) -> scalar`` where ``call(x)`` is the model's forward
pass in training mode, and gets back from :meth:`DenseStack.train_step` (or
:meth:`ForeignModel.train_step`) that loss compiled into one step, traced at
its first use and kept with the model. The step leaves its gradients in the
binding, where :meth:`~psdk_tf.backend.TfBackend.read_gradients` reads them.
Predictions are the same, without gradients (``infer``).

TensorFlow 2 keeps no gradients on variables (torch keeps ``.grad``), so a
training script hands its gradients over with :func:`record_gradients`
where torch's ``loss.backward()`` would leave them; ``opt.step()`` then
pushes them.
"""

from __future__ import annotations

import re
import weakref
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Rows
from psdk.protocol.sharding import flat_size, layout, views
from psdk_tf import tables
from psdk_tf._tf import keras, tf

_OUTPUT_INDEX = re.compile(r":\d+$")


Loss = Callable[..., Any]
"""A trainer's loss as graph code: ``loss(call, *tensors)``, a scalar, where ``call(x)`` runs the model to train."""

Inference = Callable[..., Any]
"""A trainer's prediction as graph code: ``fn(call, *tensors)``, where ``call(x)`` runs the model to predict."""


def _traced(function: Callable[..., Any], *signature: Any) -> Any:
    """``function`` as a concrete function of ``signature``: traced now, never again."""
    return tf.function(function, input_signature=list(signature)).get_concrete_function()


def _any_batch_size(tensor: Any) -> Any:
    """``tensor``'s spec with the batch dimension left free: what one trace serves every batch size with."""
    shape = tensor.shape
    return tf.TensorSpec([None, *shape[1:]] if shape.rank else [], tensor.dtype)


def _flat(gradients: Sequence[Any], variables: Sequence[Any]) -> Any:
    """The gradients as one flat tensor in variable order; a variable the loss did not use gets zeros."""
    parts = [
        tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(gradients, variables, strict=True)
    ]
    return tf.concat([tf.reshape(g, [-1]) for g in parts], axis=0)


class _OnFirstCall:
    """A graph function traced at its first call, the batch dimension left free, then only called.

    One trace serves every batch size (the last batch of a pass is smaller);
    ``fixed`` are the specs of leading arguments that are no batch.
    """

    def __init__(self, function: Callable[..., Any], *fixed: Any):
        self._function = function
        self._fixed = fixed
        self._concrete: Any = None

    @property
    def traces(self) -> int:
        return int(self._concrete is not None)

    def trace(self, *batch: Any) -> None:
        """Trace now, for batches of the specs ``batch`` (a no-op once traced)."""
        if self._concrete is None:
            self._concrete = _traced(self._function, *self._fixed, *batch)

    def __call__(self, *args: Any) -> Any:
        if self._concrete is None:
            self.trace(*map(_any_batch_size, args[len(self._fixed) :]))
        return self._concrete(*args)


class DenseStack(tf.Module):
    """Dense layers with ReLU between them, ending in logits; see the module docstring."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]):
        super().__init__(name="dense_stack")
        self.spec = spec
        self.specs = layout(spec.variables())
        names = [s.name for s in self.specs]
        self.named = [(n, tf.Variable(np.array(weights[n], np.float32), name=n)) for n in names]
        self.dense = self.named
        self.tables: dict[str, Rows] = {}
        self._variables = [v for _, v in self.named]
        self._sizes = [s.size for s in self.specs]
        # Staged weights: what write() received, assigned before the next use of the variables.
        self._staged = np.zeros(flat_size(self.specs), np.float32)
        self._staged_views = views(self._staged, self.specs)
        self._pending = False
        self._grads = np.zeros_like(self._staged)
        self._grad_views = views(self._grads, self.specs)
        self._flat_spec = tf.TensorSpec([self._staged.size], tf.float32)
        self._assign = _traced(self._assign_flat, self._flat_spec)
        # Per trainer's loss (or prediction): its compiled step, traced at first use, kept with the model.
        self._steps: dict[Loss, partial[float]] = {}
        self._inferences: dict[Inference, partial[Any]] = {}

    @property
    def trainable_variables(self) -> tuple[Any, ...]:
        """The variables in canonical order (``tf.Module`` would sort them by attribute name)."""
        return tuple(self._variables)

    # ----------------------------------------------------------- graph code
    def logits(self, x: Any) -> Any:
        layers = len(self.specs) // 2
        for i in range(layers):
            x = tf.matmul(x, self._variables[2 * i]) + self._variables[2 * i + 1]
            if i < layers - 1:
                x = tf.nn.relu(x)
        return x

    def _gradients(self, loss: Loss, *batch: Any) -> tuple[Any, Any]:
        with tf.GradientTape() as tape:
            value = loss(self.logits, *batch)
        return value, _flat(tape.gradient(value, self._variables), self._variables)

    def _assign_flat(self, flat: Any) -> None:
        for var, part in zip(self._variables, tf.split(flat, self._sizes), strict=True):
            var.assign(tf.reshape(part, var.shape))

    def _assign_gradients(self, loss: Loss, flat: Any, *batch: Any) -> tuple[Any, Any]:
        self._assign_flat(flat)  # tf.function orders it before the reads below
        return self._gradients(loss, *batch)

    # -------------------------------------------------------- the interface
    def __call__(self, x: Any) -> Any:
        """Logits of ``x``, eagerly, after any staged write."""
        self.flush()
        return self.logits(tf.convert_to_tensor(x, tf.float32))

    def flush(self) -> None:
        if self._pending:
            self._assign(tf.convert_to_tensor(self._staged))
            self._pending = False

    def read(self) -> dict[str, np.ndarray]:
        self.flush()
        return {name: np.array(var.numpy(), np.float32) for name, var in self.named}

    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            view = self._staged_views.get(name)
            if view is None:
                raise _unknown(name, self._staged_views)
            np.copyto(view, value)
        self._pending = True

    def train_step(self, loss: Loss, signature: Sequence[Any] = ()) -> Callable[..., float]:
        """``loss`` as this model's training step: made once per loss function and kept with the model.

        The step takes the batch as tensors and is one ``tf.function`` call:
        it assigns any staged write, runs the forward and backward pass and
        returns the gradients as one flat tensor, copied once into the
        buffer :meth:`read_gradients` reads. It returns the loss. It is
        traced at its first call, or at once for batches of ``signature``'s
        specs (a trainer does that when it builds the model, so that no
        timed step pays for the trace).
        """
        step = self._steps.get(loss)
        if step is None:
            plain = _OnFirstCall(lambda *batch: self._gradients(loss, *batch))
            assigning = _OnFirstCall(lambda flat, *batch: self._assign_gradients(loss, flat, *batch), self._flat_spec)
            step = self._steps[loss] = partial(self._step, plain, assigning)
        if signature:
            for compiled in step.args:
                compiled.trace(*signature)
        return step

    def _step(self, plain: _OnFirstCall, assigning: _OnFirstCall, *batch: Any) -> float:
        if self._pending:
            loss, grads = assigning(tf.convert_to_tensor(self._staged), *batch)
            self._pending = False
        else:
            loss, grads = plain(*batch)
        np.copyto(self._grads, grads.numpy())
        return float(loss.numpy())

    def infer(self, fn: Inference, signature: Sequence[Any] = ()) -> Callable[..., Any]:
        """``fn`` compiled on this model, run after any staged write: predictions, no gradients.

        Traced at its first call, or at once for ``signature`` (as :meth:`train_step`).
        """
        predict = self._inferences.get(fn)
        if predict is None:
            predict = self._inferences[fn] = partial(self._infer, _OnFirstCall(lambda *batch: fn(self.logits, *batch)))
        if signature:
            predict.args[0].trace(*signature)
        return predict

    def _infer(self, compiled: _OnFirstCall, *batch: Any) -> Any:
        self.flush()
        return compiled(*batch)

    def traces(self, loss: Loss) -> int:
        """How often ``loss``'s step was traced on this model (at most twice: with and without a staged write)."""
        step = self._steps.get(loss)
        return 0 if step is None else sum(compiled.traces for compiled in step.args)

    def record(self, gradients: Sequence[Any]) -> None:
        _check_count(gradients, self.named)
        for (name, _), grad in zip(self.named, gradients, strict=True):
            _copy_gradient(self._grad_views[name], grad)

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            np.copyto(view, self._grad_views[name])


class ForeignModel:
    """A Keras model (or ``tf.Module``) from a training script, seen through the backend's interface."""

    def __init__(self, model: Any):
        # Held weakly: this object is the value of a WeakKeyDictionary keyed by the model.
        self._model = weakref.ref(model)
        self.named = canonical_names(model)
        self.tables = tables.declared(model, self.named)
        """The embedding tables among the variables (:mod:`psdk_tf.tables`): they never travel whole."""
        self.dense = [(name, var) for name, var in self.named if name not in self.tables]
        self._variables = [v for _, v in self.named]
        self._index = {name: i for i, (name, _) in enumerate(self.named)}
        self.gradients: list[Any] | None = None
        # A model from outside may take any input shape: its steps are tf.functions that generalise it.
        self._steps: dict[Loss, partial[float]] = {}
        self._inferences: dict[Inference, Any] = {}

    def _call(self, training: bool, *inputs: Any) -> Any:
        model = self._model()
        if model is None:
            raise PsdkError("the model this backend was bound to no longer exists")
        if isinstance(model, keras.layers.Layer):
            return model(*inputs, training=training)
        return model(*inputs)

    def _gradients(self, loss: Loss, *batch: Any) -> tuple[Any, list[Any]]:
        with tf.GradientTape() as tape:
            value = loss(partial(self._call, True), *batch)
        return value, tape.gradient(value, self._variables)

    def flush(self) -> None:
        """Writes reach the variables at once: a script calls the model itself."""

    def read(self) -> dict[str, np.ndarray]:
        return {name: np.array(var.numpy(), np.float32) for name, var in self.dense}

    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            index = self._index.get(name)
            if index is None:
                raise _unknown(name, self._index)
            if name in self.tables:
                raise _whole_table(name)
            var = self._variables[index]
            shape = tuple(var.shape)
            if shape != np.shape(value):
                raise PsdkError(f"{name}: cannot write shape {np.shape(value)} into a variable of {shape}")
            var.assign(np.asarray(value, np.float32))

    def train_step(self, loss: Loss) -> Callable[..., float]:
        """``loss`` as this model's training step (see :meth:`DenseStack.train_step`); the gradients stay tensors."""
        step = self._steps.get(loss)
        if step is None:
            compiled = tf.function(lambda *batch: self._gradients(loss, *batch), reduce_retracing=True)
            step = self._steps[loss] = partial(self._step, compiled)
        return step

    def _step(self, compiled: Any, *batch: Any) -> float:
        loss, grads = compiled(*batch)
        self.gradients = list(grads)
        return float(loss.numpy())

    def infer(self, fn: Inference) -> Callable[..., Any]:
        """``fn`` compiled on this model, in inference mode: predictions, no gradients."""
        compiled = self._inferences.get(fn)
        if compiled is None:
            compiled = self._inferences[fn] = tf.function(
                lambda *batch: fn(partial(self._call, False), *batch), reduce_retracing=True
            )
        return compiled

    def traces(self, loss: Loss) -> int:
        """How often ``loss``'s step was traced on this model (``reduce_retracing`` keeps it to one or two)."""
        step = self._steps.get(loss)
        return 0 if step is None else int(step.args[0].experimental_get_tracing_count())

    def record(self, gradients: Sequence[Any]) -> None:
        _check_count(gradients, self.named)
        self.gradients = list(gradients)

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        if self.gradients is None:
            raise PsdkError(
                "no gradients recorded for this model yet: compute them with tf.GradientTape and call "
                "psdk_tf.record_gradients(model, grads) before opt.step()"
            )
        for name, view in out.items():
            if name in self.tables:
                raise _whole_table(name)
            _copy_gradient(view, self.gradients[self._index[name]])

    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        tables.write_rows(table, self._table(table), ids, rows)

    def read_row_gradients(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        variable = self._table(table)
        if self.gradients is None:
            raise PsdkError(
                "no gradients recorded for this model yet: compute them with tf.GradientTape and call "
                "psdk_tf.record_gradients(model, grads) before opt.step()"
            )
        return tables.row_gradients(table, variable, self.gradients[self._index[table]])

    def _table(self, table: str) -> Any:
        if table not in self.tables:
            raise PsdkError(f"the model has no embedding table {table!r}; its tables are {sorted(self.tables)}")
        return self._variables[self._index[table]]


class OwnBinding(ABC):
    """A model that the bridge reaches as it is: it names its variables and moves its own weights, gradients and rows.

    For a trainer whose model is no Keras model and whose tables are no
    ``capacity x dim`` variables (:mod:`psdk_tf.ctr` keeps only the rows
    the ps sent). ``named`` lists ``(name, array)`` for every variable in
    order, tables included; ``tables`` says which are tables; ``dense`` is
    the rest. Gradients come from the trainer's steps, never from a script.
    """

    named: list[tuple[str, Any]]
    tables: dict[str, Rows]
    dense: list[tuple[str, Any]]

    @abstractmethod
    def read(self) -> dict[str, np.ndarray]:
        """Copies of the dense weights, canonical layout."""

    @abstractmethod
    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        """Take these dense weights (the caller keeps the arrays)."""

    @abstractmethod
    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        """Copy the last step's dense gradients into ``out``."""

    @abstractmethod
    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep the rows of ``ids`` for the next forward pass."""

    @abstractmethod
    def read_row_gradients(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of the last step's gradient of ``table``, one row per lookup."""

    def record(self, gradients: Sequence[Any]) -> None:
        raise PsdkError(f"{type(self).__name__} computes its own gradients: record_gradients is for Keras models")


Binding = DenseStack | ForeignModel | OwnBinding
_FOREIGN: weakref.WeakKeyDictionary[Any, ForeignModel] = weakref.WeakKeyDictionary()


def binding(model: Any) -> Binding:
    """The backend's view of ``model``: itself for a DenseStack or an OwnBinding, else a ForeignModel beside it."""
    if isinstance(model, DenseStack | OwnBinding):
        return model
    bound = _FOREIGN.get(model)
    if bound is None:
        bound = _FOREIGN[model] = ForeignModel(model)
    return bound


def record_gradients(model: Any, gradients: Sequence[Any]) -> None:
    """Leave ``gradients`` with ``model`` for the next ``DistributedOptimizer.step()``.

    ``gradients`` follow ``model.trainable_variables`` (what ``tape.gradient``
    returns for them); a ``None`` (an unused variable) pushes zeros::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        psdk_tf.record_gradients(model, tape.gradient(loss, model.trainable_variables))
        opt.step()
    """
    binding(model).record(gradients)


def canonical_names(model: Any) -> list[tuple[str, Any]]:
    """(name, variable) for each of ``model.trainable_variables``, in that order.

    The name is the variable's Keras path (``v.path``; a plain ``tf.Variable``'s
    ``name`` without its ``:0``), less the model's own name in front. So
    ``Sequential([Dense(100, name="hidden1"), Dense(10, name="logits")])`` has
    ``hidden1/kernel``, ``hidden1/bias``, ``logits/kernel``, ``logits/bias``,
    the names psdk's own MLP has. Unnamed layers get Keras's automatic names
    (``dense``, ``dense_1``, ...), which depend on what the process built
    before: name your layers so every worker agrees.
    """
    variables = list(getattr(model, "trainable_variables", None) or [])
    if not variables:
        raise PsdkError(
            f"{type(model).__name__} has no trainable variables yet: build it first "
            "(call it on a batch, or model.build(input_shape))"
        )
    prefix = f"{getattr(model, 'name', '')}/"
    named = []
    for var in variables:
        path = _OUTPUT_INDEX.sub("", getattr(var, "path", None) or var.name)
        named.append((path.removeprefix(prefix) if prefix != "/" else path, var))
    repeated = sorted(name for name, count in Counter(n for n, _ in named).items() if count > 1)
    if repeated:
        raise PsdkError(f"several variables are called {repeated}: give the model's layers distinct names")
    return named


def _check_count(gradients: Sequence[Any], named: Sequence[tuple[str, Any]]) -> None:
    if len(gradients) != len(named):
        raise PsdkError(
            f"got {len(gradients)} gradients for {len(named)} trainable variables; pass "
            "tape.gradient(loss, model.trainable_variables)"
        )


def _copy_gradient(out: np.ndarray, grad: Any) -> None:
    if grad is None:
        out.fill(0.0)
    else:
        np.copyto(out, tf.convert_to_tensor(grad).numpy())  # IndexedSlices become dense


def _whole_table(name: str) -> PsdkError:
    return PsdkError(
        f"{name!r} is an embedding table: its rows travel by id (write_rows, read_row_gradients), never whole"
    )


def _unknown(name: str, known: Mapping[str, Any]) -> PsdkError:
    return PsdkError(f"the model has no variable {name!r}; its variables are {sorted(known)}")
