"""The JAX backend with an embedding table: gathered rows in, their gradients out as rows.

The suite's model is a :class:`~psdk_jax.models.DenseStack` with the dense
``out/kernel`` and the table ``emb`` (``tables={"emb": psdk.Rows(...)}``); its
loss reads the batch's gathered rows as ``params["emb"]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from psdk_jax import record_gradients
from psdk_jax.models import DenseStack

from psdk.errors import PsdkError
from psdk.plugins.backend import Backend
from psdk.plugins.variables import Rows
from psdk.testing import TableConformance
from psdk.testing.table_conformance import CAPACITY, DIM, IDS, KERNEL, TABLE

pytestmark = pytest.mark.timeout(120)


class OutSpec:
    """A spec with one dense variable, ``out/kernel``; the table is declared beside it."""

    name = "table-test"

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(KERNEL, (DIM, 1))]

    def layers(self) -> list[tuple[str, int, int]]:
        return []


class Scores(DenseStack):
    """One score per id: its row times the kernel, plus ``x``."""

    def apply(self, params: Mapping[str, Any], x: Any) -> Any:
        return jnp.matmul(params[TABLE], params[KERNEL], precision=self.precision)[:, 0] + x


def table_loss(model: DenseStack, params: Any) -> Any:
    """``sum over ids of emb[id] @ out/kernel``: ``params[TABLE]`` holds the batch's gathered rows."""
    return jnp.sum(model.apply(params, 0.0))


def build(backend: Any) -> Scores:
    weights = {KERNEL: np.zeros((DIM, 1), np.float32)}
    return Scores(
        OutSpec(),  # type: ignore[arg-type]  # DenseStack takes any spec with variables() and layers()
        weights,
        backend.device_handle(),
        jit=bool(backend.option("jit")),
        precision=backend.precision(),
        tables={TABLE: Rows(dim=DIM, capacity=CAPACITY)},
    )


class TestJaxTables(TableConformance):
    backend_name = "jax"

    def table_model(self, backend: Backend) -> Any:
        return build(backend)

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        return model.value_and_grad(table_loss, ids={TABLE: ids})


@pytest.fixture
def backend() -> Backend:
    from psdk import plugins

    return plugins.load_backend("jax")


def test_a_scripts_own_row_gradients_are_recorded(backend: Backend) -> None:
    """``jax.grad`` with respect to the gathered rows, handed over with ``record_gradients``."""
    model = build(backend)
    unique = np.unique(IDS)
    backend.write_rows(model, TABLE, unique, np.arange(len(unique) * DIM, dtype=np.float32).reshape(-1, DIM))
    backend.write_weights(model, {KERNEL: np.ones((DIM, 1), np.float32)})
    rows = model.gather(TABLE, IDS)
    grads, row_grads = jax.grad(lambda p, r: table_loss(model, {**p, TABLE: r}), argnums=(0, 1))(model.params, rows)
    record_gradients(model, grads, rows={TABLE: (IDS, row_grads)})
    ids, got = backend.read_row_gradients(model, TABLE)
    np.testing.assert_array_equal(ids, IDS)
    np.testing.assert_allclose(got, np.ones((len(IDS), DIM)), atol=1e-6)
    out = {KERNEL: np.zeros((DIM, 1), np.float32)}
    backend.read_gradients(model, out)
    np.testing.assert_allclose(out[KERNEL][:, 0], rows.sum(axis=0), rtol=1e-6, atol=1e-6)


def test_a_step_without_ids_leaves_no_row_gradients(backend: Backend) -> None:
    model = build(backend)
    model.value_and_grad(table_loss, ids={TABLE: IDS})
    assert len(backend.read_row_gradients(model, TABLE)[0]) == len(IDS)
    model.value_and_grad(lambda m, p: jnp.sum(p[KERNEL]))
    ids, grads = backend.read_row_gradients(model, TABLE)
    assert ids.dtype == np.int64 and ids.shape == (0,) and grads.shape == (0, DIM)


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        (np.array([1, -1], np.int64), "must lie in [0, 64), got -1 .. 1"),
        (np.array([CAPACITY], np.int64), "must lie in [0, 64), got 64 .. 64"),
        (np.array([0.5]), "1-D integer array"),
        (np.array([[1]], np.int64), "1-D integer array"),
    ],
)
def test_ids_outside_the_local_table_are_refused(backend: Backend, ids: np.ndarray, says: str) -> None:
    """A negative id would wrap around to another row in numpy: refused, as are ids past the capacity."""
    model = build(backend)
    with pytest.raises(PsdkError, match=f"table 'emb': .*{re.escape(says)}"):
        model.value_and_grad(table_loss, ids={TABLE: ids})


def test_unknown_tables_and_clashing_names_are_refused(backend: Backend) -> None:
    model = build(backend)
    with pytest.raises(PsdkError, match="no embedding table 'users'; its tables: \\['emb'\\]"):
        backend.write_rows(model, "users", np.array([1], np.int64), np.zeros((1, DIM), np.float32))
    with pytest.raises(PsdkError, match="both a dense variable and an embedding table"):
        DenseStack(OutSpec(), {KERNEL: np.zeros((DIM, 1), np.float32)}, tables={KERNEL: Rows(DIM, 8)})  # type: ignore[arg-type]


def test_outputs_read_the_gathered_rows(backend: Backend) -> None:
    model = build(backend)
    backend.write_rows(model, TABLE, np.array([2], np.int64), np.ones((1, DIM), np.float32))
    backend.write_weights(model, {KERNEL: np.full((DIM, 1), 0.5, np.float32)})
    out = model.outputs(np.float32(1.0), ids={TABLE: np.array([2, 2, 0])})
    np.testing.assert_allclose(out, [3.0, 3.0, 1.0], atol=1e-6)
