"""psdk's dense networks in JAX: a params dict of jax arrays, and compiled steps around a trainer's loss.

A :class:`DenseStack` is what a JAX user would hold: ``params``, a dict of
jax arrays on the backend's device named canonically (``hidden1/kernel`` of
shape (in, out), ``hidden1/bias``, ..., ``logits/bias``, in
:meth:`~psdk.plugins.models.ModelSpec.variables` order), and the network as a
pure function of it (:meth:`DenseStack.apply`, the outputs). Kernels are
(in, out) because ``x @ kernel + bias`` is the forward pass, so nothing is
transposed on the way to or from the ps.

It knows no loss: that is the workload's, and its trainer hands it over
(``psdk_jax.mnist`` gives MNIST's, the mean softmax cross-entropy). A loss
is a pure function ``loss(model, params, *arrays)`` of this holder, the params
and the batch's arrays, built on ``model.apply``.

How a step moves data (the ps sends the whole parameter set every step):

* :meth:`DenseStack.write` copies the arrays it is given into one flat
  float32 staging buffer on the host and marks it pending: the caller keeps
  its arrays and nothing is sent to the device yet;
* :meth:`DenseStack.value_and_grad` is one ``jax.jit``-compiled call per loss
  (compiled the first time that loss is given, then cached): with a pending
  write it takes the staging buffer, cuts it into the params dict (kept as
  the model's new ``params``) and runs ``jax.value_and_grad``; the gradients
  come back as one flat array, one device-to-host transfer, of which
  :meth:`DenseStack.read_gradients` (what the backend reads) hands out copies;
* anything that reads ``params`` (:meth:`DenseStack.outputs`,
  :meth:`DenseStack.read`) first loads a pending write with one compiled call.

Another architecture is a subclass overriding :meth:`DenseStack.apply` (its
spec needs ``variables()`` and ``layers()``); the staging, the compiled steps
and the outputs come with it. A model plugin's builder for ``jax`` does that
(``plugins/example_plugin/psdk_example/jax_model.py``), built with the
backend's ``device_handle()``, ``precision()`` and ``option("jit")``.

JAX returns gradients instead of keeping them on the parameters (torch's
``.grad``), so a training script that computes its own hands them over with
:func:`record_gradients` where torch's ``loss.backward()`` would leave them;
``opt.step()`` then pushes them.

Embedding tables (``tables={name: psdk.Rows(dim, capacity)}``, docs/tables.md)
are JAX's way with sparse: gathered rows. The model keeps each table as a
local ``capacity x dim`` numpy array (:func:`lazy_rows`, whose pages Linux
maps only when a row is written; its values only ever come from the ps, through
:meth:`DenseStack.write_rows`), never as a jax array: a table never crosses to
the device. A step names its batch's ids, ``value_and_grad(loss, *arrays,
ids={name: ids})``: the rows are gathered by id in numpy, outside ``jax.jit``
(one row per id, duplicates repeated), and the loss sees them as
``params[name]``; ``jax.value_and_grad`` then gives one gradient row per
occurrence, which psdk sums per id before it pushes:
:meth:`DenseStack.row_gradients`. Ids given as the batch's
:class:`~psdk.plugins.batches.JaggedIds` go the faster way: the rows of
their distinct ids (sorted once per batch) are gathered in numpy, padded to
the number of lookups so that the compiled step keeps one shape, and
gathered per lookup inside ``jax.jit``; the gradient comes back summed per
id, in order, and the worker sorts and sums nothing (a click batch: 26,624
lookups, about 9,700 ids). Tables are not in ``params``,
:meth:`DenseStack.read`, :meth:`DenseStack.write` or the dense gradients.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.batches import JaggedIds
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Rows
from psdk.protocol.sharding import flat_size, layout, views

Params = dict[str, jax.Array]
RowGradients = tuple[np.ndarray, np.ndarray]
"""A table's ``(ids int64, gradients float32 len(ids) x dim)``: one row per occurrence of an id, or, for ids
given as a batch's ``JaggedIds``, one summed row per distinct id."""
Loss = Callable[..., Any]
"""A trainer's loss: ``loss(model, params, *arrays)``, a scalar, pure and jit-able (see the module docstring)."""


def logits(params: Mapping[str, Any], x: Any, layers: tuple[str, ...], precision: str | None) -> Any:
    """Dense layers with ReLU between them; the last one's output is the logits."""
    for i, name in enumerate(layers):
        x = jnp.matmul(x, params[f"{name}/kernel"], precision=precision) + params[f"{name}/bias"]
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def lazy_rows(capacity: int, dim: int) -> np.ndarray:
    """Zeroed float32 ``capacity x dim`` rows in an anonymous mapping of 4 KiB pages, each mapped when first written.

    Not ``np.zeros``: numpy advises huge pages for a large array, and where
    the kernel's transparent huge pages follow that advice (``madvise``, the
    common setting) every row written maps 2 MiB, so a batch's few thousand
    ids scattered over ten million rows mapped the whole 640 MB table.
    """
    size = max(1, capacity * dim * 4)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; also where the kernel maps huge pages unasked ("always")
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, np.float32, capacity * dim).reshape(capacity, dim)


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
        tables: Mapping[str, Rows] | None = None,
    ):
        self.spec = spec
        self.device = device if device is not None else jax.devices()[0]
        self.specs = layout(spec.variables())
        self.names = tuple(s.name for s in self.specs)
        self.shapes = {s.name: s.shape for s in self.specs}
        self.layers = tuple(name for name, _, _ in spec.layers())
        self.precision = precision
        self.tables = _check_tables(tables or {}, self.shapes)
        """The embedding tables by name (see the module docstring): never in ``params``."""
        self.rows = {name: lazy_rows(t.capacity, t.dim) for name, t in self.tables.items()}
        """Each table's local rows, ``capacity x dim`` numpy, indexed by id; only rows written are mapped."""
        self._row_grads: dict[str, RowGradients] = {}
        self._staged = np.zeros(flat_size(self.specs), np.float32)
        self._staged_views = views(self._staged, self.specs)
        self._pending = False
        self._grads = np.zeros_like(self._staged)
        self._grad_views = views(self._grads, self.specs)
        self._jit: Callable[[Callable[..., Any]], Callable[..., Any]] = jax.jit if jit else (lambda f: f)
        self._steps: dict[Loss, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._load = self._jit(self._unflatten)
        self._outputs = self._jit(self.apply)
        self._params: Params = {}
        _check_tree(weights, self.shapes, "weights")
        self.write(weights)
        self.flush()

    # ------------------------------------------------------ pure functions
    def apply(self, params: Mapping[str, Any], x: Any) -> Any:
        """The network's outputs for ``x`` under ``params``, here the logits (differentiable, jit-able)."""
        return logits(params, x, self.layers, self.precision)

    def _unflatten(self, flat: Any) -> Params:
        return {s.name: flat[s.offset : s.offset + s.size].reshape(s.shape) for s in self.specs}

    def _compile(self, loss: Loss) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``loss``'s training step, from the params and from a staged write, compiled once per model."""

        def gradients(params: Params, rows: Params, positions: Params, *arrays: Any) -> Any:
            """The gradients (dense, then each table's rows by name) as one flat array, with the loss appended:
            a single transfer to the host. The loss sees a table's gathered ``rows`` as ``params[table]``; a
            table in ``positions`` has its distinct rows there, gathered per lookup here (its gradient summed)."""

            def looked_up(r: Params) -> Params:
                return {t: jnp.take(r[t], positions[t], axis=0) if t in positions else r[t] for t in r}

            value, (grads, row_grads) = jax.value_and_grad(
                lambda p, r: loss(self, {**p, **looked_up(r)}, *arrays), argnums=(0, 1)
            )(params, rows)
            flat = [jnp.ravel(grads[name]) for name in self.names] + [jnp.ravel(row_grads[t]) for t in sorted(rows)]
            return jnp.concatenate([*flat, jnp.reshape(value, (1,))])

        def load_and_gradients(flat: Any, rows: Params, positions: Params, *arrays: Any) -> tuple[Any, Params]:
            params = self._unflatten(flat)
            return gradients(params, rows, positions, *arrays), params

        steps = self._jit(gradients), self._jit(load_and_gradients)
        self._steps[loss] = steps
        return steps

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

    def value_and_grad(self, loss: Loss, *arrays: Any, ids: Mapping[str, Any] | None = None) -> float:
        """``loss`` on the batch ``arrays`` (numpy, as the compiled step takes them), leaving its gradients here.

        ``loss`` is compiled the first time it is given, so pass the same
        function every step (a module's function, not a new lambda). With
        tables, ``ids`` names the batch's ids per table: the loss sees their
        gathered rows as ``params[table]`` and their gradients are kept for
        :meth:`row_gradients` (a table not named is untouched): one row per
        id given, or, for ids given as the batch's
        :class:`~psdk.plugins.batches.JaggedIds`, one summed row per distinct id.
        """
        wanted: dict[str, np.ndarray] = {}
        positions: dict[str, np.ndarray] = {}
        for name, value in (ids or {}).items():
            if isinstance(value, JaggedIds):
                wanted[name], positions[name] = self.table_ids(name, value.unique()), value.positions().astype(np.int32)
            else:
                wanted[name] = self.table_ids(name, value)
        lookups = {name: len(positions[name]) if name in positions else len(index) for name, index in wanted.items()}
        rows = {name: self._rows_in(name, index, lookups[name]) for name, index in wanted.items()}
        step, load_step = self._steps.get(loss) or self._compile(loss)
        if self._pending:
            out, self._params = load_step(jax.device_put(self._staged, self.device), rows, positions, *arrays)
            self._pending = False
        else:
            out = step(self._params, rows, positions, *arrays)
        host = np.asarray(out)  # waits for the step: the staging buffer is free again
        np.copyto(self._grads, host[: self._grads.size])
        self._row_grads, offset = {}, self._grads.size
        for name in sorted(rows):
            size, index = rows[name].size, wanted[name]
            grads = host[offset : offset + size].reshape(rows[name].shape)[: len(index)]
            self._row_grads[name] = (index, grads.copy())
            offset += size
        return float(host[-1])

    def _rows_in(self, table: str, index: np.ndarray, lookups: int) -> np.ndarray:
        """The local rows of ``index``, padded with zero rows to ``lookups`` (the compiled step's one shape)."""
        if lookups == len(index):
            return self.rows[table][index]
        padded = np.zeros((lookups, self.tables[table].dim), np.float32)
        np.take(self.rows[table], index, axis=0, out=padded[: len(index)])
        return padded

    def record(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None) -> None:
        """Gradients a script computed itself (a dict like ``params``), for :meth:`read_gradients`.

        ``rows`` gives each touched table's ``(ids, row gradients)``, one row per id (see :meth:`gather`).
        """
        _check_tree(gradients, self.shapes, "gradients")
        recorded = {name: self._checked_row_gradients(name, *pair) for name, pair in (rows or {}).items()}
        for name, view in self._grad_views.items():
            np.copyto(view, np.asarray(gradients[name], np.float32))
        self._row_grads = recorded

    # ------------------------------------------------------------- tables
    def table_ids(self, table: str, ids: Any) -> np.ndarray:
        """``ids`` as int64 indices into ``table``'s local rows; refused unless 1-D integers in [0, capacity)."""
        capacity = self._table(table).capacity
        array = np.asarray(ids)
        if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
            raise PsdkError(
                f"table {table!r}: ids must be a 1-D integer array, got {array.dtype} of shape {array.shape}"
            )
        if array.size and (int(array.min()) < 0 or int(array.max()) >= capacity):
            raise PsdkError(
                f"table {table!r}: ids index the local table directly and must lie in [0, {capacity}), got "
                f"{int(array.min())} .. {int(array.max())}; hash features into [0, capacity) first"
            )
        return array.astype(np.int64)

    def gather(self, table: str, ids: Any) -> np.ndarray:
        """The rows of ``ids`` (one per id, in order, duplicates repeated) as the ps last sent them, numpy."""
        return self.rows[table][self.table_ids(table, ids)]

    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Copy the rows of ``ids`` the ps sent into ``table``'s local rows, where the next step gathers them."""
        index = self.table_ids(table, ids)
        if np.shape(rows) != (len(index), self.tables[table].dim):
            raise PsdkError(
                f"table {table!r}: {len(index)} ids need rows of shape "
                f"{(len(index), self.tables[table].dim)}, got {np.shape(rows)}"
            )
        self.rows[table][index] = rows

    def row_gradients(self, table: str) -> RowGradients:
        """``(ids, gradients)`` the last step left for ``table``, one row per id; empty if it did not touch it."""
        dim = self._table(table).dim
        return self._row_grads.get(table, (np.zeros(0, np.int64), np.zeros((0, dim), np.float32)))

    def _table(self, table: str) -> Rows:
        found = self.tables.get(table)
        if found is None:
            raise PsdkError(f"the model has no embedding table {table!r}; its tables: {sorted(self.tables)}")
        return found

    def _checked_row_gradients(self, table: str, ids: Any, grads: Any) -> RowGradients:
        index = self.table_ids(table, ids)
        grads = np.array(grads, np.float32)  # a copy: the caller keeps its arrays
        if grads.shape != (len(index), self.tables[table].dim):
            raise PsdkError(
                f"table {table!r}: {len(index)} ids need row gradients of shape "
                f"{(len(index), self.tables[table].dim)}, got {grads.shape}"
            )
        return index, grads

    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            np.copyto(view, self._grad_views[name])

    def outputs(self, x: Any, ids: Mapping[str, Any] | None = None) -> np.ndarray:
        """:meth:`apply` on the current params, compiled, as float32 numpy (no gradients).

        With tables, ``ids`` per table: ``apply`` sees their gathered rows as ``params[table]``.
        """
        rows = {name: self.gather(name, value) for name, value in (ids or {}).items()}
        return np.asarray(self._outputs({**self.params, **rows}, x), np.float32)


def _check_tree(tree: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    if set(tree) != set(shapes):
        raise PsdkError(
            f"{what} must name exactly the model's variables: missing {sorted(set(shapes) - set(tree))}, "
            f"unknown {sorted(set(tree) - set(shapes))}"
        )
    for name, shape in shapes.items():
        if tuple(np.shape(tree[name])) != shape:
            raise PsdkError(f"{what}[{name!r}] has shape {tuple(np.shape(tree[name]))}, the variable {shape}")


def _check_tables(tables: Mapping[str, Rows], dense: Mapping[str, tuple[int, ...]]) -> dict[str, Rows]:
    for name, table in tables.items():
        if not isinstance(table, Rows):
            raise PsdkError(f"tables[{name!r}] must be a psdk.Rows(dim, capacity), got {type(table).__name__}")
        if name in dense:
            raise PsdkError(f"{name!r} is both a dense variable and an embedding table of the model")
    return dict(tables)


def record_gradients(
    model: DenseStack, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None
) -> None:
    """Hand a script's own gradients (``jax.grad(loss)(model.params, x, y)``) to ``opt.step()``.

    ``rows``: each touched table's ``(ids, row gradients)``, one row per id, as
    ``jax.grad`` gives them with respect to ``model.gather(table, ids)``.
    """
    if not isinstance(model, DenseStack):
        raise PsdkError(f"record_gradients takes a psdk_jax DenseStack, got {type(model).__name__}")
    model.record(gradients, rows)


__all__ = ["DenseStack", "Loss", "logits", "record_gradients"]
