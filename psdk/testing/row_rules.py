"""A table on a real ps, for checking update rules on rows against a framework's own sparse optimizers.

A plugin's test runs the framework's optimizer (``torch.optim.SparseAdam``,
``tf.compat.v1.train.AdagradOptimizer``, ...) on an embedding and the same
row gradients through :class:`PsTable`: the worker's path (duplicates summed,
ids sorted) and the ps's (ids checked, the job's rule run on a block of the
touched rows and their slots, written back), over a real connection. The
table starts from the rows the framework's embedding is given
(:meth:`PsTable.initial`), so the two can be compared step by step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import UpdateRule
from psdk.testing.ps import running_ps

OPTIONS = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)


class PsTable:
    """One table of ``rows`` x ``dim`` on one ps, updated by pushes of (ids, row gradients)."""

    def __init__(self, client: ParameterClient, spec: TableSpec) -> None:
        self.client, self.spec = client, spec

    def initial(self) -> np.ndarray:
        """Every row (ids ``0 .. capacity-1``) as the ps created it: give these to the framework's embedding."""
        return self.rows(range(self.spec.capacity))

    def rows(self, ids: Any) -> np.ndarray:
        """The rows of ``ids`` as the ps holds them (a training pull: rows are created on first touch)."""
        return self.client.pull_rows({self.spec.name: np.asarray(list(ids), np.int64)})[self.spec.name]

    def push(self, ids: Any, grads: Any) -> None:
        """One step: the row gradients of a batch (ids in any order, duplicates allowed) applied by the ps."""
        result = self.client.push_pull(rows={self.spec.name: (np.asarray(ids), np.asarray(grads, np.float32))})
        assert result.outcome == "applied", result.outcome


@contextmanager
def table_on_a_ps(rule: UpdateRule, rows: int, dim: int) -> Iterator[PsTable]:
    """A job of one worker whose ps runs ``rule``, with one table ``emb`` (and one small dense variable)."""
    spec = TableSpec("emb", dim=dim, capacity=rows, sharding="range", seed=3)
    with running_ps() as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, OPTIONS)
        try:
            job = JobSpec(SyncSpec("async").resolved(1), 1000, 1)
            assert client.initialize({"bias": np.zeros(1, np.float32)}, job, rule, tables=(spec,))
            client.pull()
            yield PsTable(client, spec)
        finally:
            client.close()
