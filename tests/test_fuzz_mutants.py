"""The stateful fuzzer's reference model, proven by the mutants it catches.

Each test patches the ps with one bug of the kind the model exists for (a
lost update, a doubled one, a wrong sign, a wrong learning rate, a sync
round one replica short, a checkpoint's slots restored into the wrong
variable, bounded staleness without its bound) and runs the stateful fuzzer over frames with the budget the test
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

pytestmark = pytest.mark.timeout(300)

EXAMPLES, STEPS = 80, 40
"""The budget of one mode in tests/test_fuzz_stateful.py."""

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


MUTANTS: dict[str, Patch] = {
    "drop every second gradient": drop_every_second_gradient,
    "apply a gradient twice": apply_a_gradient_twice,
    "flip a gradient's sign": flip_the_sign,
    "scale the learning rate by 1.1": scale_the_learning_rate,
    "a sync round one replica short": one_replica_too_few,
    "restore slots into the wrong variable": slots_into_the_wrong_variable,
    "answer beyond the staleness bound": no_staleness_bound,
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_fuzzer_catches_the_mutant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTANTS[name](monkeypatch)
    report = runner.run(Mode(shared_memory=False), examples=EXAMPLES, steps=STEPS, shrink=False)
    print(f"\nmutant {name!r}: caught at step {report.caught_at} of at most {EXAMPLES * (STEPS + 1)}")
    assert report.failure is not None, f"the fuzzer passed a ps that does {name!r}"
    assert "the ps and the reference model disagree" in report.failure, report.failure
