"""Running the stateful fuzzer: one state machine per transport mode, a budget, a seed, and its report.

:func:`run` drives :class:`psdk.fuzz.stateful.PsMachine` through
hypothesis with a budget of sequences and steps (``python -m psdk fuzz`` and
the test suite); its report says where the first violation was caught.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from psdk.fuzz.draws import FIRST_FAILURES, STEPS
from psdk.fuzz.harness import Mode
from psdk.fuzz.stateful import PsMachine
from psdk.fuzz.table_rules import TablesMachine


def machine(mode: Mode, tables: bool = False) -> type[PsMachine]:
    """The state machine over a ps in ``mode`` (a subclass per mode: hypothesis builds it without arguments);
    ``tables``: every sequence's job declares embedding tables (:class:`TablesMachine`)."""
    base = TablesMachine if tables else PsMachine
    return type(
        f"{base.__name__}_{'curve' if mode.curve else 'plain'}_{'shm' if mode.shared_memory else 'frames'}",
        (base,),
        {"MODE": mode},
    )


@dataclass
class StatefulReport:
    mode: Mode
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    failure: str | None = None
    caught_at: int | None = None
    tables: bool = False
    """Every sequence declared embedding tables (:class:`psdk.fuzz.table_rules.TablesMachine`)."""
    """The step that saw the first violation, counting every sequence's steps."""

    def line(self) -> str:
        outcome = "PASS" if self.failure is None else f"FAIL (caught at step {self.caught_at}): {self.failure}"
        label = f"{self.mode.label}, tables" if self.tables else self.mode.label
        return f"stateful ({label}): {self.examples} sequences, {self.seconds:.1f} s: {outcome}"


def run(
    mode: Mode, examples: int, steps: int, seed: int | None = None, shrink: bool = True, tables: bool = False
) -> StatefulReport:
    """Run ``examples`` sequences of up to ``steps`` steps each, each against a fresh ps in ``mode``.

    ``seed`` fixes the sequences (the same seed, the same sequences); ``None``
    derives them from the test itself, as the test suite does. ``shrink``:
    on a failure, look for the shortest sequence that fails too. ``tables``:
    every sequence declares embedding tables (:class:`psdk.fuzz.table_rules.TablesMachine`).
    """
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.stateful import get_state_machine_test

    report = StatefulReport(mode, examples, steps, tables=tables)
    FIRST_FAILURES.clear()
    STEPS[0] = 0
    started = time.monotonic()
    options = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        phases=list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate],
    )
    test = get_state_machine_test(machine(mode, tables), settings=options)
    if seed is not None:
        test = fixed_seed(seed)(test)
    try:
        test()
    except Exception as exc:  # a violation, or hypothesis's own error about one that did not replay
        first = FIRST_FAILURES[0] if FIRST_FAILURES else str(exc) or repr(exc)
        report.failure = first
    report.seconds = time.monotonic() - started
    report.caught_at = FIRST_FAILURES.caught_at
    return report
