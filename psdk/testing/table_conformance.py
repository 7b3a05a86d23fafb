"""The table conformance suite: what a backend must do for a model with an embedding table.

A plugin's test class adds it beside the bridge suite and says how its
framework builds and runs the suite's model: a table ``emb`` of
:data:`DIM`-wide rows (:data:`CAPACITY` of them, ids ``0 .. CAPACITY-1``
indexing it directly), and a dense ``out/kernel`` of shape ``(DIM, 1)``::

    class TestTorchTables(psdk.testing.TableConformance):
        backend_name = "torch"

        def table_model(self, backend):
            return MyNet()            # nn.Embedding(CAPACITY, DIM, sparse=True) + kernel

        def table_backward(self, backend, model, ids):
            model.zero_grad(set_to_none=True)
            loss = model(torch.as_tensor(ids)).sum()   # sum over ids of emb[id] @ kernel
            loss.backward()
            return float(loss)

Everything else is checked here against numpy: the loss of rows written with
``write_rows``, the (ids, rows) gradient ``read_row_gradients`` gives (with
duplicates summed as psdk will), the kernel's gradient, and a few SGD steps
through a real ps with ``psdk.DistributedOptimizer``, rows pulled and pushed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

import psdk
from psdk import plugins
from psdk.plugins.backend import Backend
from psdk.plugins.variables import Dense, Rows
from psdk.ps.rules import SGD
from psdk.ps.tables.hashing import initial_rows, table_key
from psdk.testing.ps import RunningPs, running_ps

DIM = 4
CAPACITY = 64
TABLE = "emb"
KERNEL = "out/kernel"
IDS = np.array([3, 17, 3, 60, 0, 17, 3], np.int64)
"""A batch's ids, with duplicates, out of order."""


def reference_loss(rows: dict[int, np.ndarray], kernel: np.ndarray, ids: np.ndarray) -> float:
    """``sum over ids of emb[id] @ kernel``, in float64."""
    return float(sum(rows[int(i)].astype(np.float64) @ kernel.astype(np.float64)[:, 0] for i in ids))


def summed(ids: np.ndarray, grads: np.ndarray) -> dict[int, np.ndarray]:
    """Row gradients by id, duplicates summed."""
    out: dict[int, np.ndarray] = {}
    for i, g in zip(np.asarray(ids).tolist(), np.asarray(grads, np.float64), strict=True):
        out[int(i)] = out.get(int(i), np.zeros(DIM)) + g
    return out


class TableConformance:
    """Embedding tables through the bridge (:meth:`~psdk.plugins.backend.Backend.write_rows`, ...)."""

    backend_name: ClassVar[str]
    grad_rtol: ClassVar[float] = 1e-5
    grad_atol: ClassVar[float] = 1e-6

    def table_model(self, backend: Backend) -> Any:
        """A model with the table ``emb`` (CAPACITY x DIM, ids index it) and a dense ``out/kernel`` (DIM x 1)."""
        raise NotImplementedError

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        """Forward ``sum over ids of emb[id] @ out/kernel`` with fresh gradients, backward; return the loss."""
        raise NotImplementedError

    @pytest.fixture
    def backend(self) -> Backend:
        return plugins.load_backend(self.backend_name)

    @pytest.fixture
    def ps(self) -> Iterator[RunningPs]:
        with running_ps() as ps:
            yield ps

    def _kernel(self, backend: Backend, model: Any) -> np.ndarray:
        kernel = np.linspace(-1.0, 1.0, DIM, dtype=np.float32).reshape(DIM, 1)
        backend.write_weights(model, {KERNEL: kernel})
        return kernel

    def _rows(self, backend: Backend, model: Any, seed: int = 0) -> dict[int, np.ndarray]:
        unique = np.unique(IDS)
        rows = np.random.default_rng(seed).normal(size=(len(unique), DIM)).astype(np.float32)
        backend.write_rows(model, TABLE, unique, rows)
        return dict(zip(unique.tolist(), rows, strict=True))

    # ------------------------------------------------------------------ checks
    def test_the_table_is_declared_as_rows_and_left_out_of_the_dense_variables(self, backend: Backend) -> None:
        model = self.table_model(backend)
        records = backend.variable_records(model)
        table = records.get(TABLE)
        assert isinstance(table, Rows), f"{TABLE} must be declared as Rows, got {table}"
        assert (table.dim, table.capacity) == (DIM, CAPACITY)
        assert records.get(KERNEL) == Dense((DIM, 1))
        assert TABLE not in backend.variables(model), "a table is no dense variable: it never travels whole"
        assert set(backend.read_weights(model)) == {KERNEL}

    def test_rows_written_are_the_rows_the_forward_pass_reads(self, backend: Backend) -> None:
        model = self.table_model(backend)
        kernel, rows = self._kernel(backend, model), self._rows(backend, model)
        loss = self.table_backward(backend, model, IDS)
        np.testing.assert_allclose(loss, reference_loss(rows, kernel, IDS), rtol=self.grad_rtol, atol=self.grad_atol)

    def test_row_gradients_are_read_back_by_id(self, backend: Backend) -> None:
        model = self.table_model(backend)
        kernel, rows = self._kernel(backend, model), self._rows(backend, model)
        self.table_backward(backend, model, IDS)
        ids, grads = backend.read_row_gradients(model, TABLE)
        assert np.asarray(ids).dtype == np.int64 and np.asarray(grads).dtype == np.float32
        got = summed(ids, grads)
        assert sorted(got) == sorted(set(IDS.tolist())), "exactly the ids the batch touched"
        for i in got:
            expected = kernel[:, 0].astype(np.float64) * int(np.count_nonzero(i == IDS))
            np.testing.assert_allclose(got[i], expected, rtol=self.grad_rtol, atol=self.grad_atol, err_msg=str(i))
        out = {KERNEL: np.zeros((DIM, 1), np.float32)}
        backend.read_gradients(model, out)
        expected_kernel = np.sum([rows[int(i)].astype(np.float64) for i in IDS], axis=0).reshape(DIM, 1)
        np.testing.assert_allclose(out[KERNEL], expected_kernel, rtol=self.grad_rtol, atol=self.grad_atol)

    def test_it_trains_rows_through_a_ps(self, backend: Backend, ps: RunningPs) -> None:
        """Three SGD steps through a real ps move exactly the touched rows, by the summed gradient."""
        lr, steps = 0.5, 3
        batches = [IDS, np.array([5, 5, 60], np.int64), np.array([3, 9], np.int64)]
        model = self.table_model(backend)
        kernel = self._kernel(backend, model)
        with psdk.connect(ps.cluster(1), 0, steps=steps, transport=ps.transport) as session:
            opt = psdk.DistributedOptimizer(None, model, session, backend=backend, rule=SGD(lr=lr), seed=11)
            opt.broadcast_parameters()
            assert set(opt.tables) == {TABLE}
            opt.pull_rows({TABLE: batches[0]})
            for t, ids in enumerate(batches):
                self.table_backward(backend, model, ids)
                opt.step(next_ids={TABLE: batches[t + 1]} if t + 1 < len(batches) else None)
            touched = np.unique(np.concatenate(batches))
            rows = session.client.pull_rows({TABLE: touched}, read=True)[TABLE]
            session.finish(wait_s=30)
        expected = {int(i): r.astype(np.float64) for i, r in zip(touched, self._initial(touched, 11), strict=True)}
        k = kernel[:, 0].astype(np.float64)
        for ids in batches:
            grad_k = sum((expected[int(i)] for i in ids.tolist()), np.zeros(DIM))
            for i in ids.tolist():
                expected[int(i)] = expected[int(i)] - lr * k
            k = k - lr * grad_k
        for i, row in zip(touched.tolist(), rows, strict=True):
            np.testing.assert_allclose(row, expected[i], rtol=1e-4, atol=1e-5, err_msg=f"row {i}")

    def _initial(self, ids: np.ndarray, seed: int) -> np.ndarray:
        return initial_rows(ids, DIM, table_key(seed, TABLE), "normal", 0.01)
