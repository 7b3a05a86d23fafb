"""The stateful fuzzer's reference model, proven by the mutants it catches.

Each test patches the ps with one bug of the kind the model exists for (a
lost update, a doubled one, a wrong sign, a wrong learning rate, a sync
round one replica short, a checkpoint's slots restored into the wrong
variable, bounded staleness without its bound, row gradients applied the
wrong way or to the wrong rows) and runs the stateful fuzzer over frames with the budget the test
suite gives one mode (``tests/test_fuzz_stateful.py``): it must fail, and
say the ps and the model disagree. The real ps passes that budget in
``tests/test_fuzz_stateful.py``. Each prints the step that caught it,
counting every sequence's steps (docs/security.md keeps the table).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from psdk.fuzz import runner
from psdk.fuzz.harness import Mode
from psdk.ps import store as store_module
from psdk.ps.consistency import SSPPolicy, SyncPolicy
from psdk.ps.rules import UpdateRule
from psdk.ps.store import FlatStore
from psdk.ps.tables.served import RowGrad, ServedTable

pytestmark = pytest.mark.timeout(300)

EXAMPLES, STEPS = 80, 40
"""The budget of one mode in tests/test_fuzz_stateful.py."""
TABLE_EXAMPLES, TABLE_STEPS = 30, 30
"""The budget of the sequences that all declare tables there (the table mutants run with it)."""

Patch = Callable[[pytest.MonkeyPatch], None]


def drop_every_second_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every second update applies zeros instead of its gradient; the version still advances."""
    original, calls = FlatStore.apply, [0]

    def apply(self: FlatStore, grad: np.ndarray, grad_bound: float | None = None, *rows: Any) -> None:
        calls[0] += 1
        original(self, np.zeros_like(grad) if calls[0] % 2 == 0 else grad, grad_bound, *rows)

    monkeypatch.setattr(FlatStore, "apply", apply)


def apply_a_gradient_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update is applied twice, the version advanced once."""
    original = FlatStore.apply

    def apply(self: FlatStore, grad: np.ndarray, grad_bound: float | None = None, *rows: Any) -> None:
        original(self, grad, grad_bound, *rows)
        original(self, grad, grad_bound, *rows)
        self._version -= 1

    monkeypatch.setattr(FlatStore, "apply", apply)


def flip_the_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    original = FlatStore.apply

    def apply(self: FlatStore, grad: np.ndarray, grad_bound: float | None = None, *rows: Any) -> None:
        original(self, -grad, grad_bound, *rows)

    monkeypatch.setattr(FlatStore, "apply", apply)


def scale_the_learning_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rule's rate 10% high."""
    original = UpdateRule.lr_at
    monkeypatch.setattr(UpdateRule, "lr_at", lambda self, step: 1.1 * original(self, step))


def one_replica_too_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync round closes one gradient early (and averages over what it has)."""
    original = SyncPolicy.__init__

    def init(self: SyncPolicy, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.replicas = max(1, self.replicas - 1)

    monkeypatch.setattr(SyncPolicy, "__init__", init)


def slots_into_the_wrong_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's slots are restored each into the next variable's place (resized to fit)."""
    original = store_module._restore_into

    def restore_into(state: Any, rule: Any, specs: Any, restore: store_module.RestoreState) -> None:
        rotated: dict[str, Mapping[str, np.ndarray]] = {}
        for slot, by_name in restore.slots.items():
            names = list(by_name)
            rotated[slot] = {
                name: np.resize(by_name[names[(i + 1) % len(names)]], by_name[name].shape)
                for i, name in enumerate(names)
            }
        original(state, rule, specs, store_module.RestoreState(restore.version, restore.rule_step, rotated))

    monkeypatch.setattr(store_module, "_restore_into", restore_into)


def no_staleness_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded staleness answers every push at once, however far ahead its worker is."""

    def release_ready(self: SSPPolicy) -> list[Any]:
        ready, self._held = self._held, []
        return ready

    monkeypatch.setattr(SSPPolicy, "release_ready", release_ready)


def flip_the_rows_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push's row gradients go the wrong way (the dense part is right)."""
    original = ServedTable.stage_update

    def stage_update(self: ServedTable, grad: RowGrad, *args: Any, **kwargs: Any) -> Any:
        return original(self, RowGrad(grad.ids, -grad.rows), *args, **kwargs)

    monkeypatch.setattr(ServedTable, "stage_update", stage_update)


def rows_into_their_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pushed row gradient lands on the next id's row (rotated within the push)."""
    original = ServedTable.stage_update

    def stage_update(self: ServedTable, grad: RowGrad, *args: Any, **kwargs: Any) -> Any:
        return original(self, RowGrad(grad.ids, np.roll(grad.rows, 1, axis=0)), *args, **kwargs)

    monkeypatch.setattr(ServedTable, "stage_update", stage_update)


MUTANTS: dict[str, Patch] = {
    "drop every second gradient": drop_every_second_gradient,
    "apply a gradient twice": apply_a_gradient_twice,
    "flip a gradient's sign": flip_the_sign,
    "scale the learning rate by 1.1": scale_the_learning_rate,
    "a sync round one replica short": one_replica_too_few,
    "restore slots into the wrong variable": slots_into_the_wrong_variable,
    "answer beyond the staleness bound": no_staleness_bound,
    "flip the rows' sign": flip_the_rows_sign,
    "rows into their neighbours": rows_into_their_neighbours,
}
TABLE_MUTANTS = {"flip the rows' sign", "rows into their neighbours"}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_fuzzer_catches_the_mutant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTANTS[name](monkeypatch)
    tables = name in TABLE_MUTANTS
    examples, steps = (TABLE_EXAMPLES, TABLE_STEPS) if tables else (EXAMPLES, STEPS)
    report = runner.run(Mode(shared_memory=False), examples=examples, steps=steps, shrink=False, tables=tables)
    print(f"\nmutant {name!r}: caught at step {report.caught_at} of at most {examples * (steps + 1)}")
    assert report.failure is not None, f"the fuzzer passed a ps that does {name!r}"
    assert "the ps and the reference model disagree" in report.failure, report.failure
