"""What a worker knows of each ps shard, and what a step or a recovery tells it.

Kept apart from :mod:`psdk.client.client` so the parts of the client (its
checkpoint cut, :mod:`psdk.client.recovery`) share these types
without importing the client itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from psdk.protocol.sharding import VarSpec
from psdk.transport.wire import Message


class Requests(Protocol):
    """How the client's parts ask every shard something and wait for the replies (see ParameterClient)."""

    names: list[str]
    task_index: int

    def message(self, op: str, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message: ...

    def to_all(self, op: str, **fields: Any) -> dict[int, Message]: ...

    def request(
        self, messages: Mapping[int, Message], what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]: ...


@dataclass(frozen=True)
class StepResult:
    """What one push-and-pull did, seen from shard 0 (which keeps the global step)."""

    global_step: int
    done: bool
    outcome: str
    slowest: int | None = None
    """Async and ssp: iterations the slowest live worker had finished when this reply left."""
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    """The rows the step pulled, by table, in the order their ids were given."""


@dataclass
class StepTimes:
    """Wall seconds a worker's steps spent, summed: moving weights, rows and gradients in and out of the
    model (``lookup_s``), and from encoding a push to decoding its reply (``wire_s``, the wait included)."""

    lookup_s: float = 0.0
    wire_s: float = 0.0


@dataclass(frozen=True)
class Basis:
    """The parameters a gradient was computed from: the job's epoch and each shard's version.

    A worker that computes its next gradient while the last push is still in
    flight sends it with the basis it was computed from, not the newer
    versions the reply brought in meanwhile, so the ps measures (and, with
    ssp, bounds) its staleness truly.
    """

    epoch: int
    versions: tuple[int, ...]


@dataclass
class Shard:
    """The client's copy of one shard: layout, version, and its two flat buffers."""

    specs: list[VarSpec]
    version: int
    params: np.ndarray
    grads: np.ndarray
    outbox: np.ndarray
    """A copy of a gradient that travels while the next one is computed into :attr:`grads`.

    All three come from the transport (``ClientEndpoint.buffers``), which may have lent them to the ps.
    """

    @property
    def size(self) -> int:
        return int(self.params.size)
