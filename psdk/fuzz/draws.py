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

# Embedding tables the chief's init may declare (one ps: num_ps=1, hash placement), and the ids drawn for them.
_USERS: dict[str, Any] = {"name": "users", "dim": 3, "capacity": 64, "init_scale": 0.05, "seed": 3, "max_ids": 16}
_ITEMS: dict[str, Any] = {
    "name": "items",
    "dim": 2,
    "capacity": 64,
    "initializer": "uniform",
    "init_scale": 0.1,
    "max_ids": 16,
}
_ITEMS["admit_after"] = 2
TABLE_SETS: dict[str, list[dict[str, Any]] | None] = {
    "none": None,
    "one": [_USERS],
    "two, one admitting after 2 pulls": [_USERS, _ITEMS],
    "capped at 8 rows": [{**_USERS, "capacity": 8}],
}
"""What an init declares (its ``tables`` specs); the ids below overflow the capped one, which then evicts."""
SPREAD_TABLES = st.integers(0, 1 << 16).map(lambda i: list(TABLE_SETS)[i % len(TABLE_SETS)])
"""A sequence's tables, spread as its mode is (``sampled_from`` would favour none)."""
BAD_TABLES: dict[str, dict[str, Any]] = {
    "another shard's": {"shard": 1, "num_ps": 2, "specs": [_USERS]},
    "a bad spec": {"shard": 0, "num_ps": 1, "specs": [{**_USERS, "dim": 0}]},
    "a name twice": {"shard": 0, "num_ps": 1, "specs": [_USERS, _USERS]},
}
"""An init's tables the ps must refuse (before anything changes)."""
ROW_IDS = st.sets(st.sampled_from([*range(20), 2**40 + 1, 2**62 + 7]), min_size=1, max_size=10).map(sorted)
"""A request's ids of one table (strictly increasing), from few enough that rows are pulled, pushed and read
again; a capped table's limit cuts them."""
ROW_FAULTS = [
    "int32 ids",
    "unsorted ids",
    "duplicate ids",
    "a negative id",
    "more than max_ids",
    "an unknown table",
    "an extra frame",
    "a missing frame",
]
"""What makes a table request one the ps must refuse, pushes and pulls alike."""
PUSH_FAULTS = [*ROW_FAULTS, "rows of the wrong shape", "NaN rows", "a NaN dense gradient"]
PULL_FAULTS = [*ROW_FAULTS, "read without pull", "a push in a pull"]
NAMED_FAULTS = ["another worker's name", "a pull never made", "a read named", "rows of the wrong shape",
                "no pulled field"]  # fmt: skip
"""What a push naming the pull of its ids may get wrong (:meth:`psdk.fuzz.table_rules.TableRules.named_push`)."""


def half_faulty(faults: list[str]) -> st.SearchStrategy[str | None]:
    """No fault (``None``) half the time, else one of ``faults``, spread as the modes are."""
    return st.integers(0, 1 << 16).map(lambda i: faults[i // 2 % len(faults)] if i % 2 else None)


def ill_typed(op: str, key: str, value: Any) -> bool:
    """Whether ``value`` breaks the type the protocol declares for ``op``'s field ``key`` (then it must be refused)."""
    if key == "worker":
        return not protocol.WORKER_FIELD.type.accepts(value)
    declared = {f.name: f for f in protocol.OPS[op].fields}.get(key)
    if declared is None:
        return False
    return not (value is None and declared.nullable) and not declared.type.accepts(value)
