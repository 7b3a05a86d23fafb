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

TensorFlow 2 keeps no gradients on variables (torch keeps ``.grad``), so a
training script hands its gradients over with :func:`record_gradients`
where torch's ``loss.backward()`` would leave them; ``opt.step()`` then
pushes them.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.models import ModelSpec
from psdk.protocol.sharding import flat_size, layout, views
from psdk_tf._tf import keras, tf

_OUTPUT_INDEX = re.compile(r":\d+$")


def _cross_entropy(logits: Any, y: Any) -> Any:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _predicted(logits: Any) -> Any:
    return tf.argmax(logits, axis=1)


def _traced(function: Callable[..., Any], *signature: Any) -> Any:
    """``function`` as a concrete function of ``signature``: traced now, never again."""
    return tf.function(function, input_signature=list(signature)).get_concrete_function()


def batch_arrays(x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
    """The batch as the compiled steps take it (float32 images, int64 labels), copied only if needed."""
    return tf.convert_to_tensor(np.asarray(x, np.float32)), tf.convert_to_tensor(np.asarray(y, np.int64))


class DenseStack(tf.Module):
    """Dense layers with ReLU between them, ending in logits; see the module docstring."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]):
        super().__init__(name="dense_stack")
        self.spec = spec
        self.specs = layout(spec.variables())
        names = [s.name for s in self.specs]
        self.named = [(n, tf.Variable(np.array(weights[n], np.float32), name=n)) for n in names]
        self._variables = [v for _, v in self.named]
        self._sizes = [s.size for s in self.specs]
        # Staged weights: what write() received, assigned before the next use of the variables.
        self._staged = np.zeros(flat_size(self.specs), np.float32)
        self._staged_views = views(self._staged, self.specs)
        self._pending = False
        self._grads = np.zeros_like(self._staged)
        self._grad_views = views(self._grads, self.specs)
        x = tf.TensorSpec([None, spec.input_dim], tf.float32)
        y = tf.TensorSpec([None], tf.int64)
        flat = tf.TensorSpec([self._staged.size], tf.float32)
        # Traced once here, with fixed dtypes and a free batch size: no retracing later.
        self._step = _traced(self._gradients, x, y)
        self._assign_step = _traced(self._assign_gradients, flat, x, y)
        self._assign = _traced(self._assign_flat, flat)
        self._predict = _traced(self._classes, x)

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

    def _gradients(self, x: Any, y: Any) -> tuple[Any, Any]:
        with tf.GradientTape() as tape:
            loss = _cross_entropy(self.logits(x), y)
        grads = tape.gradient(loss, self._variables)
        return loss, tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)

    def _assign_flat(self, flat: Any) -> None:
        for var, part in zip(self._variables, tf.split(flat, self._sizes), strict=True):
            var.assign(tf.reshape(part, var.shape))

    def _assign_gradients(self, flat: Any, x: Any, y: Any) -> tuple[Any, Any]:
        self._assign_flat(flat)  # tf.function orders it before the reads below
        return self._gradients(x, y)

    def _classes(self, x: Any) -> Any:
        return _predicted(self.logits(x))

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

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        xt, yt = batch_arrays(x, y)
        if self._pending:
            loss, grads = self._assign_step(tf.convert_to_tensor(self._staged), xt, yt)
            self._pending = False
        else:
            loss, grads = self._step(xt, yt)
        np.copyto(self._grads, grads.numpy())
        return float(loss.numpy())

    def record(self, gradients: Sequence[Any]) -> None:
        _check_count(gradients, self.named)
        for (name, _), grad in zip(self.named, gradients, strict=True):
            _copy_gradient(self._grad_views[name], grad)

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            np.copyto(view, self._grad_views[name])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The class each image is given (for :func:`psdk.plugins.backends.kit.batched_accuracy`)."""
        self.flush()
        return self._predict(tf.convert_to_tensor(np.asarray(x, np.float32))).numpy()


class ForeignModel:
    """A Keras model (or ``tf.Module``) from a training script, seen through the backend's interface."""

    def __init__(self, model: Any):
        # Held weakly: this object is the value of a WeakKeyDictionary keyed by the model.
        self._model = weakref.ref(model)
        self.named = canonical_names(model)
        self._variables = [v for _, v in self.named]
        self._index = {name: i for i, (name, _) in enumerate(self.named)}
        self.gradients: list[Any] | None = None
        # A model from outside may take any input shape: let tf.function generalise it.
        self._step = tf.function(self._gradients, reduce_retracing=True)
        self._predict = tf.function(self._classes, reduce_retracing=True)

    def _call(self, x: Any, training: bool) -> Any:
        model = self._model()
        if model is None:
            raise PsdkError("the model this backend was bound to no longer exists")
        if isinstance(model, keras.layers.Layer):
            return model(x, training=training)
        return model(x)

    def _gradients(self, x: Any, y: Any) -> tuple[Any, list[Any]]:
        with tf.GradientTape() as tape:
            loss = _cross_entropy(self._call(x, True), y)
        return loss, tape.gradient(loss, self._variables)

    def _classes(self, x: Any) -> Any:
        return _predicted(self._call(x, False))

    def flush(self) -> None:
        """Writes reach the variables at once: a script calls the model itself."""

    def read(self) -> dict[str, np.ndarray]:
        return {name: np.array(var.numpy(), np.float32) for name, var in self.named}

    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            index = self._index.get(name)
            if index is None:
                raise _unknown(name, self._index)
            var = self._variables[index]
            shape = tuple(var.shape)
            if shape != np.shape(value):
                raise PsdkError(f"{name}: cannot write shape {np.shape(value)} into a variable of {shape}")
            var.assign(np.asarray(value, np.float32))

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        loss, grads = self._step(*batch_arrays(x, y))
        self.gradients = list(grads)
        return float(loss.numpy())

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
            _copy_gradient(view, self.gradients[self._index[name]])

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._predict(tf.convert_to_tensor(np.asarray(x, np.float32))).numpy()


Binding = DenseStack | ForeignModel
_FOREIGN: weakref.WeakKeyDictionary[Any, ForeignModel] = weakref.WeakKeyDictionary()


def binding(model: Any) -> Binding:
    """The backend's view of ``model``: itself for a DenseStack, else a ForeignModel kept beside it."""
    if isinstance(model, DenseStack):
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


def _unknown(name: str, known: Mapping[str, Any]) -> PsdkError:
    return PsdkError(f"the model has no variable {name!r}; its variables are {sorted(known)}")
