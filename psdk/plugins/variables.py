"""The kinds of variable the ps keeps: dense tensors, and tables of rows.

A model's variables used to be names and shapes, all dense. A recommendation
model's embedding table is another kind: rows of a fixed width, far more of
them than any worker holds, each made when first looked up and read a batch
at a time. Declaring the kind now lets backends and models say what they hold
without another break of every plugin when the ps learns to serve rows.

The ps serves both: a :class:`Dense` variable travels whole in the shard's
flat buffer; a :class:`Rows` variable becomes an embedding table on the ps
(docs/tables.md) whose rows travel a batch's ids at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ROW_INITIALIZERS = ("zeros", "normal", "uniform")
"""How a table's rows are drawn when first looked up (the scale is :attr:`Rows.init_scale`)."""


@dataclass(frozen=True)
class Dense:
    """A dense tensor of ``shape``, pulled and pushed whole."""

    shape: tuple[int, ...]
    kind = "dense"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if any(n < 0 for n in self.shape):
            raise ValueError(f"a dense variable's shape has no negative sizes: {self.shape}")


@dataclass(frozen=True)
class Rows:
    """A table of up to ``capacity`` rows of ``dim`` floats, each drawn by ``initializer`` when first used."""

    dim: int
    capacity: int
    initializer: str = "normal"
    init_scale: float = 0.01
    kind = "rows"

    def __post_init__(self) -> None:
        if self.dim < 1 or self.capacity < 1:
            raise ValueError(f"a table needs a positive dim and capacity, got dim={self.dim} capacity={self.capacity}")
        if self.initializer not in ROW_INITIALIZERS:
            raise ValueError(f"unknown row initializer {self.initializer!r}; one of {', '.join(ROW_INITIALIZERS)}")


Variable = Dense | Rows


def as_variables(declared: Mapping[str, object] | Iterable[tuple[str, object]]) -> dict[str, Variable]:
    """Variables by name from what a model or backend declares: a record each, or a shape (dense)."""
    items = declared.items() if isinstance(declared, Mapping) else declared
    out: dict[str, Variable] = {}
    for name, what in items:
        out[name] = what if isinstance(what, (Dense, Rows)) else Dense(tuple(what))  # type: ignore[arg-type]
    return out


def tables_of(variables: Mapping[str, Variable]) -> dict[str, Rows]:
    """The table variables of a model, by name: what the ps keeps as rows, never as a dense array."""
    return {name: v for name, v in variables.items() if isinstance(v, Rows)}
