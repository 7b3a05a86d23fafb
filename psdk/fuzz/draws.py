"""What the stateful fuzzer draws from: the ops, the chief's steps, the sync modes, the rules, odd values.

Every list comes from the protocol's declaration (:mod:`psdk.protocol`) and
the sync policies (:mod:`psdk.ps.consistency`), so a new op or mode is fuzzed
without editing the fuzzer; the run's books (steps, first failures,
coverage) live here too, shared by the machine and its runner.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from psdk.fuzz.harness import ENDINGS
from psdk.protocol import ops as protocol
from psdk.ps.consistency import MODES
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

try:
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - the CLI says how to install it
    raise ImportError("the stateful fuzzer needs hypothesis: pip install 'psdk[fuzz]'") from None

# Every list of ops and modes below comes from the protocol's declaration and the sync policies, so a new op or
# mode is fuzzed without editing this module (the reference model then says whether it knows what it does).
MUTATED_OPS = sorted(name for name in protocol.OPS if name not in ENDINGS)
"""Every operation, each sent with one field (or the worker id, or an unknown key) odd; the ops that end the
job have a rule of their own (``end``), which expects the ps to exit."""
ASKED = sorted(
    name
    for name, op in protocol.OPS.items()
    if op.sender is protocol.Sender.WORKER and not any(f.required for f in op.fields)
)
"""What any worker may ask with no field required (ping, pull, status, ...): sent as it is."""
CHIEF_STEPS = sorted(
    name
    for name in protocol.CHIEF_ONLY
    if name not in ENDINGS and not any(f.required for f in protocol.OPS[name].fields)
)
"""The chief's requests with no field required (state, resume, ...)."""
TARGETS = sorted(
    name for name in protocol.CHIEF_ONLY if [f.name for f in protocol.OPS[name].fields if f.required] == ["version"]
)
"""The chief's requests that name a version and nothing else (pause_at, stop_at, ...)."""
SYNC_MODES = list(MODES)
SPREAD_MODES = st.integers(0, 1 << 16).map(lambda i: SYNC_MODES[i % len(SYNC_MODES)])
"""A sequence's sync mode. ``sampled_from`` favours the first: in 80 sequences the last mode had no push
applied, so a bug there went unseen; a wide integer's remainder spreads them."""
MUTATED_KEYS = sorted({"worker", "x"} | {f.name for op in protocol.OPS.values() for f in op.fields})
ODD: list[Any] = [-1, 0, 1, 7, 2**31, 2**63 - 1, -(2**63), 1.5, True, False, None, "", "x" * 300, [], [1], {}, {"a": 1}]


class Failures(list[str]):
    """The violations of a run, as first seen; ``caught_at``: the step (of :data:`STEPS`) that saw the first."""

    caught_at: int | None = None

    def append(self, item: str) -> None:
        if not self:
            self.caught_at = STEPS[0] + 1
        super().append(item)

    def clear(self) -> None:
        self.caught_at = None
        super().clear()


STEPS = [0]
"""Steps run (each sequence's start and each rule), over the current run."""
FIRST_FAILURES = Failures()
"""Every violation as first seen, before hypothesis replays and shrinks it (timing may not replay)."""
COVERAGE: Counter[str] = Counter()
"""What the sequences reached, over every run in this process: ``request -> reply`` (outcome, or error kind)."""
RULES: list[UpdateRule] = [SGD(lr=0.1), SGD(lr=0.5, momentum=0.9), Adam(lr=0.01), Adagrad(lr=0.1), RMSProp(lr=0.01)]
SPREAD_RULES = st.integers(0, 1 << 16).map(lambda i: i % len(RULES))
