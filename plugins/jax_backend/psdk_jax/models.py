"""psdk's dense networks in JAX: a params dict of jax arrays and one compiled training step.

A :class:`DenseStack` is what a JAX user would hold: ``params``, a dict of
jax arrays on the backend's device named canonically (``hidden1/kernel`` of
shape (in, out), ``hidden1/bias``, ..., ``logits/bias``, in
:meth:`~psdk.plugins.models.ModelSpec.variables` order), and pure functions of it
(:meth:`DenseStack.apply` for the logits, :meth:`DenseStack.loss` for the
mean softmax cross-entropy). Kernels are (in, out) because ``x @ kernel +
bias`` is the forward pass, so nothing is transposed on the way to or from
the ps.

How a step moves data (the ps sends the whole parameter set every step):

* :meth:`DenseStack.write` copies the arrays it is given into one flat
  float32 staging buffer on the host and marks it pending: the caller keeps
  its arrays and nothing is sent to the device yet;
* :meth:`DenseStack.forward_backward` is one ``jax.jit``-compiled call: with
  a pending write it takes the staging buffer, cuts it into the params dict
  (kept as the model's new ``params``) and runs ``jax.value_and_grad``; the
  gradients come back as one flat array, one device-to-host transfer, of
  which :meth:`DenseStack.read_gradients` hands out copies;
* anything that reads ``params`` (evaluation, :meth:`DenseStack.read`) first
  loads a pending write with one compiled call.

Another architecture is a subclass overriding :meth:`DenseStack.apply` and
:meth:`DenseStack.loss` (its spec needs ``variables()`` and ``layers()``); the
staging, the compiled step and the evaluation come with it. A model plugin's
builder for ``jax`` does that (``plugins/example_plugin/psdk_example/jax_model.py``),
built with the backend's ``device_handle()``, ``precision()`` and ``option("jit")``.

JAX returns gradients instead of keeping them on the parameters (torch's
``.grad``), so a training script that computes its own hands them over with
:func:`record_gradients` where torch's ``loss.backward()`` would leave them;
``opt.step()`` then pushes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.models import ModelSpec
from psdk.protocol.sharding import flat_size, layout, views

Params = dict[str, jax.Array]


def logits(params: Mapping[str, Any], x: Any, layers: tuple[str, ...], precision: str | None) -> Any:
    """Dense layers with ReLU between them; the last one's output is the logits."""
    for i, name in enumerate(layers):
        x = jnp.matmul(x, params[f"{name}/kernel"], precision=precision) + params[f"{name}/bias"]
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def cross_entropy(params: Mapping[str, Any], x: Any, y: Any, layers: tuple[str, ...], precision: str | None) -> Any:
    """Mean softmax cross-entropy of integer labels ``y``."""
    log_probs = jax.nn.log_softmax(logits(params, x, layers, precision))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


class DenseStack:
    """The :class:`psdk.ModelSpec` network as params and compiled functions; see the module docstring."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, np.ndarray],
        device: Any = None,
        *,
        jit: bool = True,
        precision: str | None = "highest",
    ):
        self.spec = spec
        self.device = device if device is not None else jax.devices()[0]
        self.specs = layout(spec.variables())
        self.names = tuple(s.name for s in self.specs)
        self.shapes = {s.name: s.shape for s in self.specs}
        self.layers = tuple(name for name, _, _ in spec.layers())
        self.precision = precision
        self._staged = np.zeros(flat_size(self.specs), np.float32)
        self._staged_views = views(self._staged, self.specs)
        self._pending = False
        self._grads = np.zeros_like(self._staged)
        self._grad_views = views(self._grads, self.specs)
        compiled: Callable[[Callable[..., Any]], Callable[..., Any]] = jax.jit if jit else (lambda f: f)
        self._step = compiled(self._gradients)
        self._load_step = compiled(self._load_and_gradients)
        self._load = compiled(self._unflatten)
        self._predict = compiled(self._classes)
        self._params: Params = {}
        _check_tree(weights, self.shapes, "weights")
        self.write(weights)
        self.flush()

    # ------------------------------------------------------ pure functions
    def apply(self, params: Mapping[str, Any], x: Any) -> Any:
        """Logits of ``x`` under ``params`` (differentiable, jit-able)."""
        return logits(params, x, self.layers, self.precision)

    def loss(self, params: Mapping[str, Any], x: Any, y: Any) -> Any:
        """Mean softmax cross-entropy of ``x`` labelled ``y`` under ``params``."""
        return cross_entropy(params, x, y, self.layers, self.precision)

    def _unflatten(self, flat: Any) -> Params:
        return {s.name: flat[s.offset : s.offset + s.size].reshape(s.shape) for s in self.specs}

    def _gradients(self, params: Params, x: Any, y: Any) -> Any:
        """The gradients as one flat array, with the loss appended: a single transfer to the host."""
        loss, grads = jax.value_and_grad(self.loss)(params, x, y)
        return jnp.concatenate([*(jnp.ravel(grads[name]) for name in self.names), loss[None]])

    def _load_and_gradients(self, flat: Any, x: Any, y: Any) -> tuple[Any, Params]:
        params = self._unflatten(flat)
        return self._gradients(params, x, y), params

    def _classes(self, params: Params, x: Any) -> Any:
        return jnp.argmax(self.apply(params, x), axis=1)

    # -------------------------------------------------------- the interface
    @property
    def params(self) -> Params:
        """The weights as a dict of jax arrays on the device, after any pending write."""
        self.flush()
        return self._params

    @params.setter
    def params(self, params: Mapping[str, Any]) -> None:
        """Replace the weights with a params dict (e.g. after a local optax step)."""
        _check_tree(params, self.shapes, "params")
        self._params = {
            name: jax.device_put(jnp.asarray(params[name], jnp.float32), self.device) for name in self.names
        }
        self._pending = False

    def flush(self) -> None:
        """Load a pending write onto the device."""
        if self._pending:
            self._params = self._load(jax.device_put(self._staged, self.device))
            jax.block_until_ready(self._params)  # the staging buffer may be written again right after
            self._pending = False

    def read(self) -> dict[str, np.ndarray]:
        params = self.params  # a jitted function's dict comes back with sorted keys: go by self.names
        return {name: np.array(params[name], np.float32) for name in self.names}

    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            view = self._staged_views.get(name)
            if view is None:
                raise PsdkError(f"the model has no variable {name!r}; it has {list(self.names)}")
            if view.shape != np.shape(value):
                raise PsdkError(f"{name}: cannot write shape {np.shape(value)} into a variable of {view.shape}")
        if not self._pending and len(weights) < len(self.names):
            for name, view in self._staged_views.items():  # a partial write keeps the other weights
                np.copyto(view, np.asarray(self._params[name]))
        for name, value in weights.items():
            np.copyto(self._staged_views[name], value)
        self._pending = True

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        xb, yb = batch_arrays(x, y)
        if self._pending:
            out, self._params = self._load_step(jax.device_put(self._staged, self.device), xb, yb)
            self._pending = False
        else:
            out = self._step(self._params, xb, yb)
        host = np.asarray(out)  # waits for the step: the staging buffer is free again
        np.copyto(self._grads, host[:-1])
        return float(host[-1])

    def record(self, gradients: Mapping[str, Any]) -> None:
        """Gradients a script computed itself (a dict like ``params``), for :meth:`read_gradients`."""
        _check_tree(gradients, self.shapes, "gradients")
        for name, view in self._grad_views.items():
            np.copyto(view, np.asarray(gradients[name], np.float32))

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            np.copyto(view, self._grad_views[name])

    def predict(self, x: np.ndarray) -> Any:
        """Predicted class of each row of ``x``."""
        return self._predict(self.params, np.asarray(x, np.float32))


def batch_arrays(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch as the compiled step takes it: float32 images, int32 labels (JAX's default integer)."""
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


def _check_tree(tree: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    if set(tree) != set(shapes):
        raise PsdkError(
            f"{what} must name exactly the model's variables: missing {sorted(set(shapes) - set(tree))}, "
            f"unknown {sorted(set(tree) - set(shapes))}"
        )
    for name, shape in shapes.items():
        if tuple(np.shape(tree[name])) != shape:
            raise PsdkError(f"{what}[{name!r}] has shape {tuple(np.shape(tree[name]))}, the variable {shape}")


def record_gradients(model: DenseStack, gradients: Mapping[str, Any]) -> None:
    """Hand a script's own gradients (``jax.grad(model.loss)(model.params, x, y)``) to ``opt.step()``."""
    if not isinstance(model, DenseStack):
        raise PsdkError(f"record_gradients takes a psdk_jax DenseStack, got {type(model).__name__}")
    model.record(gradients)


__all__ = ["DenseStack", "batch_arrays", "cross_entropy", "logits", "record_gradients"]
