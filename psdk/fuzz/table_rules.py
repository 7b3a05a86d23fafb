"""The stateful fuzzer's rules for embedding tables: rows pushed and pulled, valid and hostile.

:class:`TableRules` is a mixin of :class:`TablesMachine`, the state machine
whose every sequence's job declares tables. ``push_rows`` sends a
``push_pull`` whose ``tables`` part pushes rows of one table (and may pull
or read rows back), ``pull_rows`` a ``pull`` of rows (a training pull or a
``read``). About half of each are valid: strictly increasing int64 ids,
float32 rows of the table's ``dim``; the reference model applies them
(:mod:`psdk.fuzz.rows`) and the rows every reply carries are compared with
the model's. ``named_push`` sends a step that pulls rows, then the next
one, pushing their rows by naming that pull (only the rows travel): the ps
must apply them to the ids it pulled, and refuse, changing nothing, a name
another worker, an unknown request or a read made. The others of each carry one fault the ps must refuse (int32,
unsorted, duplicate or negative ids, more than ``max_ids``, an unknown table,
an extra or missing frame, rows of the wrong shape, NaN rows, ...): the
reply must be an error, and the ps's tables must be bit for bit what they
were.

Under ``ssp`` a push's pulls are reads only: its reply (and so when a
training pull would create rows) may be held by the staleness bound until a
step the model does not place.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import zmq

from psdk.fuzz.draws import (
    BAD_TABLES,
    NAMED_FAULTS,
    PULL_FAULTS,
    PUSH_FAULTS,
    ROW_IDS,
    RULES,
    SPREAD_MODES,
    SPREAD_RULES,
    SPREAD_TABLES,
    SYNC_MODES,
    TABLE_SETS,
    half_faulty,
)
from psdk.fuzz.following import ModelFollowing
from psdk.fuzz.harness import WORKERS, Actor
from psdk.fuzz.stateful import PsMachine
from psdk.protocol.ops import PULL_NOT_HELD
from psdk.transport.wire import Message

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize, precondition, rule
except ImportError:  # pragma: no cover - the CLI says how to install it
    raise ImportError("the stateful fuzzer needs hypothesis: pip install 'psdk[fuzz]'") from None

FALLBACK = next(spec for specs in TABLE_SETS.values() if specs for spec in specs)
"""The table a request names when the ps holds none (then it must be refused as unknown)."""


class TableRules(ModelFollowing):
    """Rules that push and pull rows (see the module docstring); the machine provides its actors and gradients."""

    actors: list[Actor]

    # -------------------------------------------------------------- helpers
    def _table(self, index: int) -> dict[str, Any]:
        """The spec of one table the ps holds (by index), or a table it does not hold."""
        specs = [table.spec.to_json() for table in self.ps.server.store.tables.values()]
        return specs[index % len(specs)] if specs else FALLBACK

    @staticmethod
    def _ids(spec: dict[str, Any], drawn: list[int]) -> np.ndarray:
        """Drawn ids cut to what one request may name: the table's ``max_ids`` and its capacity."""
        return np.array(drawn[: min(int(spec.get("max_ids", 1 << 16)), int(spec["capacity"]))], np.int64)

    @staticmethod
    def _row_grads(ids: np.ndarray, dim: int, scale: float, key: int) -> np.ndarray:
        """Row gradients that differ by id, column and push (a constant hides a mix-up)."""
        pattern = (ids[:, None] % 101) * 3 + np.arange(dim)[None, :] * 7 + key * 5
        return (scale * (0.25 + 0.075 * (pattern % 11))).astype(np.float32).reshape(len(ids), dim)

    def _next_push(self, actor: Actor) -> tuple[int, np.ndarray]:
        """``actor``'s next push's seq, and a dense gradient that differs by worker and push."""
        seq = actor.next_seq
        actor.next_seq += 1
        return seq, (0.01 * self._pattern(3 * (actor.worker or 0) + seq)).astype(np.float32)

    def _kept(self, actor: Actor, name: str, rid: int) -> np.ndarray | None:
        """The ids the ps keeps of ``actor``'s request ``rid``'s pull of table ``name`` for a push to name, if any."""
        held = self.ps.server.shard.named_pulls.kept.get((actor.worker, name))  # type: ignore[arg-type]
        return held[2] if held is not None and held[:2] == (actor.sock.getsockopt(zmq.ROUTING_ID), rid) else None

    def _holds(self, name: str) -> bool:
        return name in self.ps.server.store.tables

    def _flat_size(self) -> int:
        raise NotImplementedError  # the machine's

    def _pattern(self, key: int) -> np.ndarray:
        raise NotImplementedError  # the machine's

    def _send_faulty(self, actor: Actor, message: Message, fault: str | None, must_fail: bool) -> None:
        """Send; a request with a fault must leave every table exactly as it was (its rows, slots, counters).

        What the replies were is counted in the coverage again as ``rows:``
        (``rows: push_pull -> params applied``), apart from the dense pushes.
        """
        coverage = self.harness.coverage
        seen = Counter({key: n for key, n in coverage.items() if key.startswith(message.op)})
        before = self.table_states() if fault is not None else {}
        self.send(actor, message, must_fail=must_fail or fault is not None)
        for key, n in (Counter({k: n for k, n in coverage.items() if k.startswith(message.op)}) - seen).items():
            coverage[f"rows: {key}"] += n
        if fault is None:
            return
        after = self.table_states()
        for name, old in before.items():
            new = after.get(name)
            pairs = [(old.ids, new.ids), (old.rows, new.rows)] if new is not None else []
            pairs += [(old.slots[s], new.slots[s]) for s in old.slots] if new is not None else []
            same = new is not None and all(np.array_equal(a, b) for a, b in pairs)
            if not same or (new is not None and (new.evicted, new.dropped) != (old.evicted, old.dropped)):
                self._disagree(f"a {message.op} with {fault} was refused but changed table {name!r}")

    @staticmethod
    def _fault_ids(fault: str, ids: np.ndarray, spec: dict[str, Any]) -> np.ndarray:
        if fault == "int32 ids":
            return ids.astype(np.int32)
        if fault == "unsorted ids":
            return np.array([5, 1], np.int64)
        if fault == "duplicate ids":
            return np.array([2, 2], np.int64)
        if fault == "a negative id":
            return np.array([-1, 3], np.int64)
        if fault == "more than max_ids":
            return np.arange(int(spec.get("max_ids", 1 << 16)) + 1, dtype=np.int64)
        return ids

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: self.ps.serving and self.ps.server.store.tables)
    @rule(
        who=st.integers(0, WORKERS - 1),
        table=st.integers(0, 1),
        ids=ROW_IDS,
        pulled=ROW_IDS,
        how=st.tuples(
            st.sampled_from(["train", "read", "none"]), st.sampled_from([0.01, 1.0, -0.5]), half_faulty(PUSH_FAULTS)
        ),
    )
    def push_rows(
        self, who: int, table: int, ids: list[int], pulled: list[int], how: tuple[str, float, str | None]
    ) -> None:
        """A worker's step with rows: push one table's row gradients, pull (or read) rows of the next batch."""
        pull, scale, fault = how
        actor, spec = self.actors[who], self._table(table)
        if fault is None:  # as a worker does: pull the batch's rows first (half of them: the others are dropped)
            self.pull_rows(who, table, ids[::2], False, None)
        seq, dense = self._next_push(actor)
        push_ids = self._fault_ids(fault, self._ids(spec, ids), spec) if fault else self._ids(spec, ids)
        grads = self._row_grads(push_ids.astype(np.int64), int(spec["dim"]), scale, seq)
        if fault == "rows of the wrong shape":
            grads = np.zeros((len(push_ids), int(spec["dim"]) + 1), np.float32)
        elif fault == "NaN rows":
            push_ids = push_ids if len(push_ids) else np.array([1], np.int64)
            grads = np.full((len(push_ids), int(spec["dim"])), np.nan, np.float32)
        entry: dict[str, Any] = {"table": "nope" if fault == "an unknown table" else spec["name"], "push": True}
        if fault == "a NaN dense gradient":
            dense[0] = np.nan
        arrays = [dense, push_ids, grads]
        if pull != "none":
            entry["pull"] = True
            if pull == "read" or self.model.mode == "ssp":
                entry["read"] = True
            arrays.append(self._ids(spec, pulled))
        if fault == "an extra frame":
            arrays.append(np.zeros(1, np.int64))
        elif fault == "a missing frame":
            arrays.pop()
        fields = actor.fields(version=self.ps.server.store.version, seq=seq, epoch=self.harness.epoch, tables=[entry])
        must_fail = actor.worker is None or not self.ps.server.store.initialized or not self._holds(spec["name"])
        self._send_faulty(actor, Message("push_pull", fields, arrays, actor.rid()), fault, must_fail)

    @precondition(lambda self: self.ps.serving and self.ps.server.store.tables)
    @rule(
        who=st.integers(0, WORKERS - 1),
        table=st.integers(0, 1),
        ids=ROW_IDS,
        read=st.booleans(),
        fault=half_faulty(PULL_FAULTS),
    )
    def pull_rows(self, who: int, table: int, ids: list[int], read: bool, fault: str | None) -> None:
        """A pull of one table's rows: a training pull (creates and counts) or a read (changes nothing)."""
        actor, spec = self.actors[who], self._table(table)
        pull_ids = self._fault_ids(fault, self._ids(spec, ids), spec) if fault else self._ids(spec, ids)
        entry: dict[str, Any] = {"table": "nope" if fault == "an unknown table" else spec["name"], "pull": True}
        if read:
            entry["read"] = True
        arrays = [pull_ids]
        if fault == "read without pull":
            entry = {"table": spec["name"], "read": True}
        elif fault == "a push in a pull":
            entry["push"] = True
            arrays = [pull_ids, np.zeros((len(pull_ids), int(spec["dim"])), np.float32), pull_ids]
        elif fault == "an extra frame":
            arrays.append(np.zeros(1, np.int64))
        elif fault == "a missing frame":
            arrays = []
        fields = actor.fields(tables=[entry])
        must_fail = actor.worker is None or not self.ps.server.store.initialized or not self._holds(spec["name"])
        self._send_faulty(actor, Message("pull", fields, arrays, actor.rid()), fault, must_fail)

    @precondition(lambda self: self.ps.serving and self.ps.server.store.tables)
    @rule(
        who=st.integers(0, WORKERS - 1),
        table=st.integers(0, 1),
        ids=ROW_IDS,
        fault=half_faulty(NAMED_FAULTS),
    )
    def named_push(self, who: int, table: int, ids: list[int], fault: str | None) -> None:
        """A step that pulls a batch's rows, then the next one, pushing their rows by naming that pull."""
        actor, spec = self.actors[who], self._table(table)
        name, pulled = spec["name"], self._ids(spec, ids)
        entry: dict[str, Any] = {"table": name, "pull": True}
        if fault == "a read named" or self.model.mode == "ssp":  # ssp: a training pull's reply may be held
            entry["read"] = True
        (seq, dense), rid = self._next_push(actor), actor.rid()
        fields = actor.fields(version=self.ps.server.store.version, seq=seq, epoch=self.harness.epoch, tables=[entry])
        must_fail = actor.worker is None or not self.ps.server.store.initialized or not self._holds(name)
        self._send_faulty(actor, Message("push_pull", fields, [dense, pulled], rid), None, must_fail)
        answer = self.last_answer  # a training pull answered with its rows: the shard holds it for a push to name
        answered = answer is not None and answer.op == "params" and answer.fields.get("outcome") != "pulled"
        holds = self._kept(actor, name, rid) is not None
        if (answered and not entry.get("read")) != holds:
            said = f"answered {answer.op if answer else 'later'}{', a read' if entry.get('read') else ''}"
            self._disagree(f"the ps {'holds' if holds else 'does not hold'} the pull of request {rid} ({said})")
        namer = self.actors[(who + 1) % WORKERS] if fault == "another worker's name" else actor
        named = rid + 1000 if fault == "a pull never made" else rid
        kept = self._kept(namer, name, named)
        ours = kept is not None
        if ours and (namer is not actor or named != rid):
            return  # by chance the namer's own last pull had that request id: a valid name, not this fault
        if kept is not None and not np.array_equal(kept, pulled):
            self._disagree(f"the ps keeps ids {kept.tolist()} of a pull of {pulled.tolist()}")
        rows = self._row_grads(pulled, int(spec["dim"]), 1.0, seq + 1)
        if fault == "rows of the wrong shape":
            rows = np.zeros((len(pulled) + 1, int(spec["dim"])), np.float32)
        seq, dense = self._next_push(namer)
        names = {} if fault == "no pulled field" else {"pulled": named}
        fields = namer.fields(version=self.ps.server.store.version, seq=seq, epoch=self.harness.epoch,
                              tables=[{"table": name, "push": True, "pulled": True}], **names)  # fmt: skip
        refused = fault or (None if ours else "a pull the shard does not hold")
        self.harness.coverage[f"named: {refused or 'a pull the shard holds'}"] += 1
        self.naming = {name: pulled}
        try:
            self._send_faulty(namer, Message("push_pull", fields, [dense, rows], namer.rid()), refused, must_fail)
        finally:
            self.naming = None
        answer = self.last_answer
        if refused is None and answer is not None and answer.fields.get("kind") == PULL_NOT_HELD:
            self._disagree(f"a push naming the pull of request {rid}, which the ps holds, was refused as not held")


class TablesMachine(PsMachine, TableRules):
    """Every sequence's job declares embedding tables, and the rules that push and pull rows join the others.

    A machine of its own, so that :class:`PsMachine`'s sequences (and what
    its budgets catch) stay as they were: hypothesis draws every sequence
    from the list of rules. The chief's ``init`` here also declares tables,
    some of which the ps must refuse (another shard's, a bad spec, a name
    twice).
    """

    @initialize(
        start=st.sampled_from(["init", "init+attach"]),
        mode=SPREAD_MODES,
        rule_index=SPREAD_RULES,
        tables=SPREAD_TABLES.filter(lambda name: TABLE_SETS[name] is not None),
    )
    def start(self, start: str, mode: str, rule_index: int, tables: str = "none") -> None:
        super().start(start, mode, rule_index, tables)

    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        mode=st.sampled_from(SYNC_MODES),
        rule_index=st.integers(0, len(RULES) - 1),
        steps=st.sampled_from([3, 20, 10**6]),
        restore=st.booleans(),
        scale=st.sampled_from([1.0, 1e30, float("nan")]),
        tables=st.one_of(SPREAD_TABLES, st.sampled_from(list(BAD_TABLES))),
    )
    def init(
        self, who: int, mode: str, rule_index: int, steps: int, restore: bool, scale: float, tables: str = "none"
    ) -> None:
        super().init(who, mode, rule_index, steps, restore, scale, tables)
