"""The parameter store: one ps shard's named arrays and its version.

Variables are kept in the canonical layout (float32, C order, dense kernels
as (in, out)) back to back in one flat buffer, so a step's gradient and
parameters each travel as a single contiguous frame and an update rule runs
once over the whole shard. The version counts the updates the shard has
applied; shard 0's version is the job's global step.

The store is finite after every apply, whatever the gradients: finite
gradients can still overflow (two pushes of 3e38 make -inf), and one
non-finite value poisons every later step of every worker. Two ways keep
it so, the cheap one whenever it can prove its case:

* **Bounds.** The store keeps an upper bound on ``|x|`` of its parameters
  and of each slot, and the ps knows one for each gradient (from the check
  it makes anyway). The update rule turns them into bounds after the apply
  (:meth:`~psdk.ps.rules.UpdateRule.bounds_after`, a few scalar operations).
  While everything stays below 1e30, eight orders of magnitude from
  float32's limit, nothing can overflow: the rule applies in place, and
  nothing more is read or written.
* **Backup and check.** Otherwise (a rule that cannot tell, or bounds that
  grew too large), the parameters and slots are copied aside, the rule
  applies, and every buffer is checked; a result with NaN or Inf anywhere
  is undone from the copy and refused (:class:`~psdk.errors.NonFiniteError`).
  The check also measures the buffers again, which tightens the bounds.
  A rule may ask for lower bounds on its slots' values too, measured with
  them (:meth:`~psdk.ps.rules.UpdateRule.slot_floors`): Adagrad's smallest
  accumulator bounds its denominator when ``eps=0`` (TensorFlow 1.x's
  configuration), and a checkpoint's smaller sums lower it as they arrive.

A gradient's bound holds only while nobody changes it: the ps copies a
gradient out of a worker's shared memory before it measures it, unless the
rule's bounds do not depend on the gradient at all
(:meth:`FlatStore.needs_stable_gradient`); a gradient without a bound
(``None``) takes the backup path, whose check reads what the apply wrote.
Variables and slots that arrive with ``initialize`` or ``reset`` are
checked (and measured) before they are taken.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from psdk.errors import NonFiniteError, ProtocolError, RefusedError
from psdk.protocol.numerics import all_finite, as_float32, magnitude
from psdk.protocol.sharding import VarSpec, flat_size, layout, views
from psdk.ps.rules import Bounds, RuleState, UpdateRule
from psdk.ps.tables.served import RowGrad, ServedTable, StagedRows, stage_all


class ParameterStore(ABC):
    """What a ps needs from storage; a ps imports no ML framework."""

    rule: UpdateRule | None = None
    tables: dict[str, ServedTable]
    """This shard's part of each embedding table, by name (kept beside the flat buffer, never in it)."""

    @property
    @abstractmethod
    def initialized(self) -> bool: ...

    @property
    @abstractmethod
    def version(self) -> int: ...

    @property
    @abstractmethod
    def specs(self) -> list[VarSpec]: ...

    @property
    @abstractmethod
    def size(self) -> int:
        """Number of float32 elements in the shard."""

    @abstractmethod
    def initialize(
        self,
        variables: Mapping[str, np.ndarray],
        rule: UpdateRule,
        restore: RestoreState | None = None,
    ) -> None:
        """Set the variables and the update rule, once (from a checkpoint's state if given)."""

    @abstractmethod
    def reset(self, variables: Mapping[str, np.ndarray], restore: RestoreState) -> None:
        """Roll an initialised store back to a checkpoint's variables, slots, version and step."""

    def needs_stable_gradient(self) -> bool:
        """Whether an apply is proven finite only for a gradient that stays as it was measured."""
        return True

    @abstractmethod
    def slots(self) -> dict[str, np.ndarray]:
        """The update rule's flat slot buffers, by slot name (live: copy before they change)."""

    @property
    @abstractmethod
    def rule_step(self) -> int:
        """How many updates the rule has made (Adam's bias correction counts them)."""

    @abstractmethod
    def apply(
        self,
        grad: np.ndarray,
        grad_bound: float | None = None,
        rows: Mapping[str, RowGrad] | None = None,
        row_scale: float = 1.0,
    ) -> None:
        """Apply one (already averaged) flat gradient and advance the version.

        ``grad_bound``: an upper bound on the gradient's ``|g|`` that holds
        while the apply reads it (``None``: measure it here, or the gradient
        may change under the apply). ``rows``: the same update's row
        gradients by table (checked), each scaled by ``row_scale``. Raises
        :class:`~psdk.errors.NonFiniteError`, with the store as it was, when
        the result would hold NaN or Inf (rows included).
        """

    def place_tables(self, tables: Mapping[str, ServedTable]) -> None:
        """Hold these tables from now on (an initialised store, with the rule they were built for)."""
        self.tables = dict(tables)

    @abstractmethod
    def params(self) -> np.ndarray:
        """The live flat parameter buffer, read-only: copy before it changes."""

    def snapshot(self) -> np.ndarray:
        return self.params().copy()

    def variables(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in views(self.params(), self.specs).items()}

    def digest(self) -> str:
        """A hash of the variables and version, to prove a store did not change."""
        h = hashlib.sha256(str(self.version).encode())
        h.update(np.ascontiguousarray(self.params()).tobytes())
        return h.hexdigest()


@dataclass
class RestoreState:
    """Where a restored shard starts: its version, its rule's step, and slots by variable."""

    version: int
    rule_step: int
    slots: Mapping[str, Mapping[str, np.ndarray]]


def _restore_into(state: RuleState, rule: UpdateRule, specs: list[VarSpec], restore: RestoreState) -> None:
    """Fill a fresh rule state from a checkpoint's slots, refusing anything the rule could not run from."""
    expected = set(state.slots)
    if set(restore.slots) != expected:
        raise RefusedError(
            f"the checkpoint has slots {sorted(restore.slots)} but the update rule keeps "
            f"{sorted(expected)}; resume with the optimizer that wrote it"
        )
    if restore.version < 0 or restore.rule_step < 0:
        raise ProtocolError("a restored version and rule step must be >= 0")
    for slot, by_name in restore.slots.items():
        for name, view in views(state.slots[slot], specs).items():
            value = by_name.get(name)
            if value is None or value.shape != view.shape:
                raise RefusedError(f"slot {slot!r} of {name!r} is missing or has the wrong shape")
            view[...] = as_float32(value)
    problem = rule.check_slots(state.slots)
    if problem is not None:
        raise RefusedError(f"the checkpoint's optimizer state cannot be used: {problem}")
    state.step = restore.rule_step


def _commit(staged: list[StagedRows]) -> None:
    for block in staged:
        block.table.commit(block)


class FlatStore(ParameterStore):
    """In-memory store over one contiguous float32 buffer."""

    def __init__(self) -> None:
        self._flat = np.zeros(0, np.float32)
        self._readonly: np.ndarray | None = None
        self._specs: list[VarSpec] = []
        self._version = 0
        self._initialized = False
        self.rule: UpdateRule | None = None
        self.rule_state = RuleState()
        self._backup: list[np.ndarray] = []
        """The parameters and each slot as they were before the apply in progress (see the module docstring)."""
        self._bounds: Bounds | None = None
        """Upper bounds on ``|x|`` of the parameters and of each slot (see the module docstring)."""
        self.checked_applies = 0
        """Applies that took the backup-and-check path (the others were proven finite by their bounds)."""
        self.tables = {}

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def version(self) -> int:
        return self._version

    @property
    def specs(self) -> list[VarSpec]:
        return self._specs

    @property
    def size(self) -> int:
        return int(self._flat.size)

    def initialize(
        self,
        variables: Mapping[str, np.ndarray],
        rule: UpdateRule,
        restore: RestoreState | None = None,
    ) -> None:
        if self._initialized:
            raise RefusedError("store is already initialised")
        for name, value in variables.items():
            if not np.issubdtype(value.dtype, np.floating):
                raise ProtocolError(f"variable {name!r} has dtype {value.dtype}, not floating point")
            if not all_finite(as_float32(value)):
                raise RefusedError(f"variable {name!r} holds NaN or Inf (or a value beyond float32)")
        specs = layout([(name, tuple(v.shape)) for name, v in variables.items()])
        flat = np.empty(flat_size(specs), np.float32)
        for name, view in views(flat, specs).items():
            view[...] = as_float32(variables[name])
        state = rule.new_state(flat.size)
        if restore is not None:
            _restore_into(state, rule, specs, restore)
        self._specs, self._flat, self.rule, self.rule_state = specs, flat, rule, state
        self._version = restore.version if restore is not None else 0
        self._backup = [np.empty_like(flat) for _ in range(1 + len(state.slots))]
        self._bounds = self._measure()
        self._initialized = True

    def reset(self, variables: Mapping[str, np.ndarray], restore: RestoreState) -> None:
        if not self._initialized:
            raise RefusedError("only an initialised store can be rolled back")
        assert self.rule is not None
        for name, view in views(self._flat, self._specs).items():
            value = variables.get(name)
            if value is None or value.shape != view.shape or not all_finite(as_float32(value)):
                raise RefusedError(f"variable {name!r} is missing, has the wrong shape or is not finite")
        state = self.rule.new_state(self._flat.size)
        _restore_into(state, self.rule, self._specs, restore)  # checked whole before anything changes
        for name, view in views(self._flat, self._specs).items():
            view[...] = as_float32(variables[name])
        self.rule_state = state
        self._version = restore.version
        self._bounds = self._measure()

    def slots(self) -> dict[str, np.ndarray]:
        return dict(self.rule_state.slots)

    @property
    def rule_step(self) -> int:
        return self.rule_state.step

    def _measure(self) -> Bounds:
        assert self.rule is not None
        slots = self.rule_state.slots
        bounds = {name: magnitude(slot) for name, slot in slots.items()}
        return magnitude(self._flat), bounds | self.rule.slot_floors(slots)

    def needs_stable_gradient(self) -> bool:
        """Whether an apply is proven finite only for a gradient that stays as it was measured."""
        assert self.rule is not None and self._bounds is not None
        return self.rule.bounds_after(*self._bounds, math.inf) is None

    def apply(
        self,
        grad: np.ndarray,
        grad_bound: float | None = None,
        rows: Mapping[str, RowGrad] | None = None,
        row_scale: float = 1.0,
    ) -> None:
        assert self.rule is not None and self._bounds is not None, "apply before initialize"
        # Rows first, into blocks of their own: a refusal here or in the dense apply below writes nothing.
        staged = stage_all(self.tables, rows, self.rule, self.rule_state.step, row_scale) if rows else []
        after = self.rule.bounds_after(*self._bounds, math.inf if grad_bound is None else grad_bound)
        if after is not None:  # proven finite: nothing to copy, nothing to check
            self.rule.apply(self._flat, grad, self.rule_state)
            self._bounds = after
            self._version += 1
        else:
            self._checked_apply(grad)
        _commit(staged)

    def _checked_apply(self, grad: np.ndarray) -> None:
        assert self.rule is not None
        self.checked_applies += 1
        live = [self._flat, *self.rule_state.slots.values()]
        for saved, buffer in zip(self._backup, live, strict=True):
            np.copyto(saved, buffer)
        step = self.rule_state.step
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, not warned about
            self.rule.apply(self._flat, grad, self.rule_state)
        bounds = self._measure()
        if math.isfinite(bounds[0]) and all(math.isfinite(b) for b in bounds[1].values()):
            self._bounds = bounds
            self._version += 1
            return
        for saved, buffer in zip(self._backup, live, strict=True):
            np.copyto(buffer, saved)
        self.rule_state.step = step
        raise NonFiniteError(
            f"the update would leave NaN or Inf in the store at version {self._version}: refused, store unchanged"
        )

    def params(self) -> np.ndarray:
        if self._readonly is None or self._readonly.base is not self._flat:
            self._readonly = self._flat.view()
            self._readonly.flags.writeable = False
        return self._readonly
