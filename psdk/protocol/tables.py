"""Embedding tables as the job declares them, and which ps shard holds which row.

A table is declared once, by the chief's ``init`` (every shard gets every
table's spec and holds its own rows of it); workers learn the specs from the
shards' layouts. Rows are placed by id, the same way on every task:

* ``hash``: shard ``mix(id) % num_ps``, so hashed feature ids of any range
  spread evenly (TensorFlow's ``partition_strategy="mod"`` without its
  weakness for ids that share a stride);
* ``range``: shard ``id // ceil(capacity / num_ps)`` for ids below
  ``capacity``, as a ``fixed_size_partitioner`` cuts a vocabulary of that
  size into contiguous blocks (``partition_strategy="div"``). Ids at or past
  ``capacity`` are refused: a range table is a fixed vocabulary.

``capacity`` is the table's rows in total: each shard holds at most
``ceil(capacity / num_ps)`` of them (:meth:`TableSpec.shard_capacity`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from psdk.errors import ConfigError, ProtocolError
from psdk.ps.tables.hashing import INITIALIZERS, hash_ids

SHARDINGS = ("hash", "range")
MAX_IDS_PER_REQUEST = 1 << 20
"""The most ids one request may name per table and shard, whatever a table says (a flood bound)."""
_NAME = re.compile(r"^[A-Za-z0-9_.\-/]{1,128}$")
PLACEMENT_KEY = np.uint64(0x5053444B5441424C)
"""The hash key of ``hash`` placement: fixed, so every task (and every version of psdk) agrees."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: its shape, how rows start and are kept, how ids are placed on shards."""

    name: str
    dim: int
    capacity: int
    """Rows in total, over every shard (each holds at most ``ceil(capacity / num_ps)``)."""
    initializer: str = "normal"
    init_scale: float = 0.01
    admit_after: int = 0
    """Create a row only once its id was pulled this many times (0: at once); until then it reads zeros."""
    sharding: str = "hash"
    preallocate: bool = False
    """Create every row of ids ``0 .. capacity-1`` when the table is placed (``range`` sharding only)."""
    max_ids: int = 1 << 16
    """The most ids one request may carry per shard for this table: a bigger push or pull is refused."""
    seed: int = 0
    """Rows start from (seed, table name, id) alone: the same on any shard, in any order, after any restore."""

    def __post_init__(self) -> None:
        where = f"tables.{self.name}"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError("tables", f"a table name is 1-128 of [A-Za-z0-9_.-/], not {self.name!r}")
        if not _positive_int(self.dim):
            raise ConfigError(f"{where}.dim", f"must be a positive integer, got {self.dim!r}")
        if not _positive_int(self.capacity) or self.capacity >= 1 << 40:
            raise ConfigError(f"{where}.capacity", f"must be a positive integer below 2^40, got {self.capacity!r}")
        if self.initializer not in INITIALIZERS:
            raise ConfigError(f"{where}.initializer", f"got {self.initializer!r}", INITIALIZERS)
        if not (isinstance(self.init_scale, int | float) and math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ConfigError(f"{where}.init_scale", f"must be a finite number >= 0, got {self.init_scale!r}")
        if not (isinstance(self.admit_after, int) and not isinstance(self.admit_after, bool) and self.admit_after >= 0):
            raise ConfigError(f"{where}.admit_after", f"must be an integer >= 0, got {self.admit_after!r}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"{where}.sharding", f"got {self.sharding!r}", SHARDINGS)
        if self.preallocate and self.sharding != "range":
            raise ConfigError(f"{where}.preallocate", "needs sharding=range (ids 0 .. capacity-1 on their shards)")
        if self.preallocate and self.admit_after:
            raise ConfigError(f"{where}.admit_after", "a preallocated table has every row: admission means nothing")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 1 << 63):
            raise ConfigError("seed", f"a table's seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not _positive_int(self.max_ids) or self.max_ids > MAX_IDS_PER_REQUEST:
            raise ConfigError(f"{where}.max_ids", f"must be in 1 .. {MAX_IDS_PER_REQUEST}, got {self.max_ids!r}")

    def shard_capacity(self, num_ps: int) -> int:
        """The most rows one of ``num_ps`` shards holds."""
        return -(-self.capacity // num_ps)

    def row_bytes(self) -> int:
        return 4 * self.dim

    def request_bytes(self) -> int:
        """The most bytes of this table's arrays one push carries: ``max_ids`` ids and rows pushed, as many ids
        pulled (more than its reply's rows). The ps caps messages with it; a worker sizes lent memory with it."""
        return self.max_ids * (8 + self.row_bytes() + 8)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> TableSpec:
        """A spec from an ``init`` or a layout: bad fields are a protocol error, not a crash."""
        if not isinstance(data, dict):
            raise ProtocolError("a table spec must be an object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ProtocolError(f"a table spec has unknown fields {sorted(unknown)}")
        try:
            return cls(**data)
        except (ConfigError, TypeError) as exc:
            raise ProtocolError(f"bad table spec: {exc}") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def shard_of_ids(spec: TableSpec, ids: np.ndarray, num_ps: int) -> np.ndarray:
    """The shard index of each id (int64 array); ids a ``range`` table cannot hold raise ValueError."""
    if spec.sharding == "range":
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= spec.capacity):
            raise ValueError(f"table {spec.name!r} holds ids 0 .. {spec.capacity - 1} (range sharding)")
        return ids // spec.shard_capacity(num_ps)
    if num_ps == 1:
        return np.zeros(len(ids), np.int64)
    return (hash_ids(ids, PLACEMENT_KEY) % np.uint64(num_ps)).astype(np.int64)


def owned_range(spec: TableSpec, shard: int, num_ps: int) -> tuple[int, int]:
    """The ids ``[low, high)`` shard ``shard`` holds of a ``range`` table."""
    per = spec.shard_capacity(num_ps)
    return min(shard * per, spec.capacity), min((shard + 1) * per, spec.capacity)
