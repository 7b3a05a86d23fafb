"""Which dense variables are split across ps shards, and into which rows: decided once, by the chief.

TensorFlow 1.x spread a large variable over several ps tasks with a
partitioner (``fixed_size_partitioner(num_shards)``,
``min_max_variable_partitioner(max_partitions, min_slice_size)``): the
variable was cut along its first axis into nearly equal parts, the first
ones a row larger, each a variable of its own named ``<name>/part_<i>``,
dealt to the ps tasks like any other. Without it one variable (the MNIST
MLP's ``hidden1/kernel`` is 98.6% of the model) sits whole on one shard and
a second ps takes almost none of the load. :class:`Partitioning` is that
choice (``topology.partition_min_bytes``, ``topology.partitions``);
its :meth:`~Partitioning.plan` maps each variable it splits to its number of
parts. The plan travels in the job spec, so every worker joins the parts
back into the one variable it sees (:mod:`psdk.client.partitions`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from psdk.errors import ConfigError

FLOAT_BYTES = 4
PART = re.compile(r"^(.*)/part_(\d+)$")


def part_name(name: str, index: int) -> str:
    """TensorFlow 1.x's name of part ``index`` of variable ``name``."""
    return f"{name}/part_{index}"


def part_rows(rows: int, parts: int) -> list[int]:
    """``rows`` dealt into ``parts`` nearly equal runs, the first ``rows % parts`` one row longer (as TF does)."""
    if parts < 1:
        raise ConfigError("topology.partitions", f"must be at least 1, got {parts}")
    if parts > rows:
        raise ConfigError(
            "topology.partitions", f"{parts} parts of a variable of {rows} rows: each part needs a row at least"
        )
    base, extra = divmod(rows, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def part_shapes(shape: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """The shapes of the parts of a variable of ``shape`` split along axis 0."""
    return [(rows, *tuple(int(d) for d in shape[1:])) for rows in part_rows(int(shape[0]), parts)]


@dataclass(frozen=True)
class Partitioning:
    """Split every variable of at least ``min_bytes`` (float32) into ``parts`` (default: one per ps) along axis 0.

    ``min_bytes`` None or 0: nothing is split (the default). The parts are
    capped by the variable's rows, as ``fixed_size_partitioner`` caps them;
    a variable left with one part, or a scalar, stays whole.
    """

    min_bytes: int | None = None
    parts: int | None = None

    def __post_init__(self) -> None:
        if self.min_bytes is not None and (isinstance(self.min_bytes, bool) or int(self.min_bytes) < 0):
            raise ConfigError("topology.partition_min_bytes", f"must be null or at least 0, got {self.min_bytes!r}")
        if self.parts is not None and (isinstance(self.parts, bool) or int(self.parts) < 1):
            raise ConfigError("topology.partitions", f"must be null or at least 1, got {self.parts!r}")

    @property
    def on(self) -> bool:
        return bool(self.min_bytes)

    def plan(self, variables: Sequence[tuple[str, tuple[int, ...]]], num_ps: int) -> dict[str, int]:
        """The variables to split, in creation order, and into how many parts."""
        if not self.on:
            return {}
        wanted = int(self.parts) if self.parts is not None else num_ps
        chosen = {}
        for name, shape in variables:
            size = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if not shape or size * FLOAT_BYTES < int(self.min_bytes or 0):
                continue
            parts = min(wanted, int(shape[0]))
            if parts > 1:
                chosen[name] = parts
        return chosen


def expand(
    variables: Sequence[tuple[str, tuple[int, ...]]], plan: Mapping[str, int]
) -> list[tuple[str, tuple[int, ...]]]:
    """The variables as the shards hold them: each one of ``plan`` replaced, in place, by its parts."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in variables:
        if name in plan:
            out += [(part_name(name, i), s) for i, s in enumerate(part_shapes(shape, plan[name]))]
        else:
            out.append((name, tuple(shape)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            "topology.partition_min_bytes",
            f"a part's name is also a variable of the model: {clash}; rename the variable or turn partitioning off",
        )
    return out


def groups(plan: Mapping[str, int]) -> dict[str, str]:
    """Each part's name -> its variable's: the parts a placement keeps on different shards."""
    return {part_name(name, i): name for name, parts in plan.items() for i in range(parts)}


def check_plan(plan: object) -> dict[str, int]:
    """A plan as it arrives in a job spec: variable names to part counts of at least 2."""
    if not isinstance(plan, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 2 for k, v in plan.items()
    ):
        raise ValueError(f"partitions is {plan!r}, not variable names to part counts of at least 2")
    return dict(plan)
