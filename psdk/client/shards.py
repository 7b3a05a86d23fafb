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


def round_versions(basis: Basis, live: list[int]) -> tuple[int, ...]:
    """In sync mode, one version for every shard a step talks to (``live``): the lowest of the basis.

    Every shard runs its own rounds, in lockstep as TensorFlow's one ``global_step`` kept every
    accumulator: the pushes that close a round on one shard were sent, for that round, to every shard.
    Pushing each shard its own version let the shards drift apart with backup workers, and a lagging
    shard's last round, or a checkpoint pause at the leading one's version, then waited for pushes that
    never came. A shard already past the lowest version drops the push as stale, as any late push.
    """
    floor = min((basis.versions[i] for i in live), default=0)
    return tuple(floor if i in live else v for i, v in enumerate(basis.versions))
