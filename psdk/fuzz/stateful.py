"""Stateful fuzzing of a live ps: sequences of every operation, from workers holding real sessions.

A single mutated message from a stranger stops at the session check: every
operation that changes state needs a registered worker, so the validation
inside init, restore and push is only reached by a sequence (init
first, then the worker's own requests on its own connection). Here
hypothesis's rule-based state machine drives one live ps, over TCP, from the
chief and two more workers, each on a connection of its own (under CURVE,
with its own key), plus a stranger. It sends every operation of the protocol
(init, wait_init, pull, push_pull over frames, over lent memory and as a
knock, finish, ping, status, stats, pause_at, state, resume, stop_at,
restore, shutdown, abort), valid or with fields and arrays mutated, with
the transport's own offers of memory (good and tampered) and releases
between, and after every step checks, against its own record of what it
sent:

* every request gets exactly one typed reply, or is waiting for one
  (parked) and the ps knows it, or its request id could not be read and the
  ps counted it as unanswerable: ``requests == replies + unanswerable +
  parked`` on the ps, and the same numbers on the fuzzer's side;
* a request the protocol must refuse was refused (an error reply);
* the store is finite, parameters and slots;
* the store's version, parameters, slots and rule step are those of the
  reference model (:mod:`psdk.fuzz.model`), which applies every
  gradient the ps took with the rule's formulas restated, after every step
  and in every checkpoint's state; each push's outcome (applied, dropped,
  held, done, refused for overflow) is the one the model gives it;
* the ps is alive and answers a ping, or it exited on purpose (the chief's
  shutdown or abort), with its reason logged and the matching exit code,
  never with a traceback, and never hangs.

:class:`psdk.fuzz.table_rules.TablesMachine` adds embedding tables: rows pushed and pulled, valid or
with a fault the ps must refuse; the model follows their rows too (:mod:`psdk.fuzz.rows`).

The live ps, the connections and the books are the harness's
(:mod:`psdk.fuzz.harness`); this module holds the rules that draw
the sequences (what they draw from: :mod:`psdk.fuzz.draws`; the
model's bookkeeping: :mod:`psdk.fuzz.following`). Run it through
:func:`psdk.fuzz.runner.run` (``python -m psdk fuzz``, long budgets)
or the test suite (``tests/test_fuzz_stateful.py``, short ones).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from psdk.fuzz.harness import ENDINGS, WORKERS, Harness, Mode
from psdk.fuzz.model import Model
from psdk.fuzz.rows import RowRequest
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import POLICIES, SyncSpec
from psdk.ps.rules import SGD
from psdk.transport import shm
from psdk.transport.wire import Message

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ImportError:  # pragma: no cover - the CLI says how to install it
    raise ImportError("the stateful fuzzer needs hypothesis: pip install 'psdk[fuzz]'") from None

from psdk.fuzz.draws import (
    ASKED,
    BAD_TABLES,
    CHIEF_STEPS,
    COVERAGE,
    FIRST_FAILURES,
    MUTATED_KEYS,
    MUTATED_OPS,
    ODD,
    RULES,
    SPREAD_MODES,
    SPREAD_RULES,
    STEPS,
    SYNC_MODES,
    TABLE_SETS,
    TARGETS,
    ill_typed,
)
from psdk.fuzz.following import ModelFollowing


class PsMachine(ModelFollowing, RuleBasedStateMachine):
    """Hypothesis's state machine over one live ps; :data:`MODE` picks the transport (set by :func:`machine`)."""

    MODE = Mode()

    def __init__(self) -> None:
        super().__init__()
        self.harness = Harness(self.MODE, COVERAGE, FIRST_FAILURES)
        # What the rules act on: the harness's ps and its connections (the stranger's last).
        self.ps, self.actors = self.harness.ps, self.harness.actors
        self.ended: str | None = None
        """"shutdown" or "abort" once the chief ended the job (the ps then exits on purpose)."""
        self.names = ["dense/kernel", "dense/bias"]
        self.shapes = [(4, 5), (4,)]
        self.model = Model()
        self.saved: Message | None = None
        self.declared: dict[str, Any] | None = None
        """The tables the chief's init declared (a restarted ps is initialised with them again)."""
        self.bounded: dict[tuple[int | None, int], tuple[int, int]] = {}
        """Applied pushes whose answer the staleness bound may hold: (connection's worker, rid) -> (worker,
        its iterations once applied); each answer is checked against the bound when it comes."""
        """The last checkpoint the chief read (a ``state`` reply): what a restore or a restarted ps starts from."""
        """What the shard should hold (:mod:`psdk.fuzz.model`), checked after every step."""

    @initialize(
        start=st.sampled_from(["nothing", "init", "init+attach"]),
        mode=SPREAD_MODES,
        rule_index=SPREAD_RULES,
    )
    def start(self, start: str, mode: str, rule_index: int, tables: str = "none") -> None:
        """Most sequences begin with a job the chief initialised (and memory lent): the handlers past init."""
        if start == "nothing":
            return
        self.init(0, mode, rule_index, 10**6, False, 1.0, tables)
        for who in range(1, WORKERS):
            self.wait_init(who)
        if start == "init+attach" and self.MODE.shared_memory and shm.available():
            for who in range(WORKERS):
                self.attach(who, None)
            self.train(1, "best")  # a first step through the memory lent: a knock, answered by the doorbell

    # ----------------------------------------------------------- messages
    def _variables(self, scale: float = 1.0) -> list[np.ndarray]:
        return [np.full(shape, 0.1 * scale, np.float32) for shape in self.shapes]

    def _flat_size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def _pattern(self, key: int) -> np.ndarray:
        """Values in [0.25, 1] that differ along the shard and from push to push (a constant hides a mix-up)."""
        return 0.25 + 0.075 * ((np.arange(self._flat_size()) * 7 + key * 5) % 11)

    # --------------------------------------------------------------- rules
    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        mode=st.sampled_from(SYNC_MODES),
        rule_index=st.integers(0, len(RULES) - 1),
        steps=st.sampled_from([3, 20, 10**6]),
        restore=st.booleans(),
        scale=st.sampled_from([1.0, 1e30, float("nan")]),
    )
    def init(
        self, who: int, mode: str, rule_index: int, steps: int, restore: bool, scale: float, tables: str = "none"
    ) -> None:
        actor = self.actors[who]
        rule = RULES[rule_index]
        rounds = POLICIES[mode].waits_for_rounds  # two of the three workers' gradients make a round: one is a backup
        sync = SyncSpec(mode, replicas_to_aggregate=2 if rounds else None, staleness=1)
        fields = actor.fields(job=JobSpec(sync.resolved(WORKERS), steps, WORKERS).to_json(), rule=rule.to_json())
        fields["names"] = self.names
        arrays = self._variables(scale)
        if restore:
            slots = list(rule.slot_names())
            fields["restore"] = {"version": 5, "rule_step": 5, "slots": slots}
            arrays += [
                np.full(shape, abs(scale) * 0.01 * (1 + i + 2 * j), np.float32)
                for j, _ in enumerate(slots)
                for i, shape in enumerate(self.shapes)
            ]
        if TABLE_SETS.get(tables) or tables in BAD_TABLES:  # rows by hash on this one ps, or tables it must refuse
            fields["tables"] = BAD_TABLES.get(tables) or {"shard": 0, "num_ps": 1, "specs": TABLE_SETS[tables]}
        refused = math.isnan(scale) or tables in BAD_TABLES
        must_fail = actor.worker != 0 or (refused and not self.ps.server.store.initialized)
        initialized = self.model.initialized
        self.send(actor, Message("init", fields, arrays, actor.rid()), must_fail=must_fail)
        if self.model.initialized and not initialized:  # this init made the job: a restart declares its tables
            self.declared = fields.get("tables")

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS))
    def wait_init(self, who: int) -> None:
        actor = self.actors[who]
        self.send(actor, Message("wait_init", actor.fields(), [], actor.rid()), must_fail=actor.worker is None)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS))
    def pull(self, who: int) -> None:
        actor = self.actors[who]
        must_fail = actor.worker is None or not self.ps.server.store.initialized
        self.send(actor, Message("pull", actor.fields(), [], actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        values=st.sampled_from(["small", "huge", "nan", "inf", "zero"]),
        version=st.sampled_from(["current", "old", "future"]),
        seq=st.sampled_from(["next", "repeat"]),
        channel=st.sampled_from(["frames", "shm", "knock"]),
    )
    def push(self, who: int, values: str, version: str, seq: str, channel: str) -> None:
        actor = self.actors[who]
        current = self._store_version()
        at = {"current": current, "old": max(0, current - 2), "future": current + 5}[version]
        number = actor.next_seq if seq == "next" else max(1, actor.next_seq - 1)
        if seq == "next":
            actor.next_seq += 1
        fill = {"small": 0.01, "huge": 3e38, "nan": np.nan, "inf": -np.inf, "zero": 0.0}[values]
        grad = (fill * self._pattern(3 * (actor.worker or 0) + number)).astype(np.float32)
        server = self.ps.server
        last = server.stats.workers[actor.worker].last_seq if actor.worker in server.stats.workers else -1
        must_fail = (
            actor.worker is None
            or not server.store.initialized
            or version == "future"
            or number <= last
            or values in ("nan", "inf")
        )
        if channel == "knock" and actor.knocks and actor.buffers is not None and actor.worker is not None:
            actor.buffers.grads[...] = grad
            rid = self.harness.knock(actor, at, number, self.harness.epoch)
            if rid is not None:
                self._follow_push(actor, rid, at, grad, rows=RowRequest())
            return
        if channel == "shm" and actor.buffers is not None:
            actor.buffers.grads[...] = grad
            must_fail = must_fail or not actor.attached
            push = actor.lent_push(actor.rid(), version=at, seq=number, epoch=self.harness.epoch)
            self.send(actor, push, must_fail=must_fail)
            return
        self.send(actor, self._push(actor, grad, at, number, self.harness.epoch), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving and self.MODE.shared_memory and shm.available())
    @rule(who=st.integers(0, WORKERS), tamper=st.sampled_from([None, "token", "bytes", "fd", "pid"]))
    def attach(self, who: int, tamper: str | None) -> None:
        actor = self.actors[who]
        offer = actor.offer_memory()
        if tamper == "token":
            offer["token"] = "00" * 16
        elif tamper == "bytes":
            offer["bytes"] += 4096
        elif tamper == "fd":
            offer["fd"] = 0
        elif tamper == "pid":
            offer["pid"] = 1
        self.harness.offer(actor, offer)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS - 1))
    def release(self, who: int) -> None:
        """The worker closes its memory: the ps sees its knock pipe hang up and lets the memory go."""
        self.actors[who].release()
        self.harness.settle()

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), report=st.sampled_from([None, {"local_steps": 3}, {"x": [[1]]}, "text"]))
    def finish(self, who: int, report: Any) -> None:
        actor = self.actors[who]
        self.send(
            actor, Message("finish", actor.fields(report=report), [], actor.rid()), must_fail=actor.worker is None
        )

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(ASKED))
    def query(self, who: int, op: str) -> None:
        actor = self.actors[who]
        self.send(actor, Message(op, actor.fields(), [], actor.rid()))

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), ahead=st.integers(-2, 3), op=st.sampled_from(TARGETS))
    def pause_or_stop(self, who: int, ahead: int, op: str) -> None:
        actor = self.actors[who]
        target = self._store_version() + ahead
        must_fail = actor.worker != 0 or not self.ps.server.store.initialized or target < 0
        self.send(actor, Message(op, actor.fields(version=target), [], actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(CHIEF_STEPS))
    def checkpoint_step(self, who: int, op: str) -> None:
        actor = self.actors[who]
        must_fail = actor.worker != 0 or (op == "state" and not self.ps.server.store.initialized)
        self.send(actor, Message(op, actor.fields(), [], actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        version=st.sampled_from([0, 3, 10**12]),
        slots=st.sampled_from(["right", "none", "nan", "negative"]),
    )
    def restore(self, who: int, version: int, slots: str) -> None:
        actor = self.actors[who]
        store = self.ps.server.store
        rule = store.rule
        specs = [(spec.name, spec.shape) for spec in store.specs] or list(zip(self.names, self.shapes, strict=True))
        slot_names = list(rule.slot_names()) if rule is not None and slots != "none" else []
        fill = {"right": 0.01, "none": 0.0, "nan": np.nan, "negative": -1.0}[slots]
        # Each variable and slot a value of its own: a slot restored into the wrong variable shows.
        arrays = [np.full(shape, 0.2 * (1 + i), np.float32) for i, (_, shape) in enumerate(specs)]
        arrays += [
            np.full(shape, fill * (1 + i + 2 * j), np.float32)
            for j, _ in enumerate(slot_names)
            for i, (_, shape) in enumerate(specs)
        ]
        restore = {"version": version, "rule_step": version, "slots": slot_names}
        fields = actor.fields(names=[name for name, _ in specs], restore=restore, epoch=self.harness.epoch + 1)
        wrong_slots = rule is not None and slots == "none" and bool(rule.slot_names())
        bad_values = bool(slot_names) and (
            slots == "nan" or (slots == "negative" and rule is not None and bool(rule.nonnegative_slots))
        )
        must_fail = actor.worker != 0 or not store.initialized or wrong_slots or bad_values
        self.send(actor, Message("restore", fields, arrays, actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving and self.saved is not None and self.ps.server.store.initialized)
    @rule()
    def restore_checkpoint(self) -> None:
        """The chief rolls the shard back to the checkpoint it took, as after another shard was lost."""
        assert self.saved is not None
        chief, (restore, arrays) = self.actors[0], self._checkpoint_arrays()
        fields = chief.fields(names=self.saved.fields["names"], restore=restore, epoch=self.harness.epoch + 1)
        self.send(chief, Message("restore", fields, arrays, chief.rid()))
        if self.model.version == restore["version"] and self.model.epoch == fields["epoch"]:
            COVERAGE["lifecycle: a checkpoint the fuzzer took, restored"] += 1

    @precondition(lambda self: self.saved is not None or (self.ps.serving and self.ps.server.store.initialized))
    @rule()
    def restart(self) -> None:
        """The ps is lost and restarted empty; the chief initialises it from the checkpoint it took (it takes one
        first if it has none), in a new epoch, and the other workers wait for that (the model starts again from
        the checkpoint)."""
        if self.saved is None:
            self.checkpoint()
        if self.saved is None:
            return  # no checkpoint could be read (the chief's pause was refused): nothing to restart from
        self.harness.restart()
        self.ps, self.actors, self.ended = self.harness.ps, self.harness.actors, None
        self.model, self.bounded = Model(), {}
        chief, (restore, arrays) = self.actors[0], self._checkpoint_arrays()
        saved = self.saved.fields
        fields = chief.fields(job=saved["job"], rule=saved["rule"], names=saved["names"], restore=restore)
        fields["epoch"] = self.harness.epoch + 1
        if self.declared is not None:  # the tables again, empty: a checkpoint's state holds no rows
            fields["tables"] = self.declared
        self.send(chief, Message("init", fields, arrays, chief.rid()))
        if self.model.initialized:
            COVERAGE["lifecycle: a ps restarted from a checkpoint the fuzzer took"] += 1
        for who in range(1, WORKERS):
            self.wait_init(who)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(sorted(ENDINGS)), now=st.integers(0, 2))
    def end(self, who: int, op: str, now: int) -> None:
        """The end of the job (one draw in three sends it, so most sequences run on)."""
        if now:
            return
        actor = self.actors[who]
        fields = actor.fields(reason="the fuzzer ends it") if op == "abort" else actor.fields()
        if actor.worker == 0:
            self.ended = op
        self.send(actor, Message(op, fields, [], actor.rid()), must_fail=actor.worker != 0)

    @precondition(lambda self: self.ps.serving and self.ps.server.store.initialized)
    @rule(who=st.integers(0, WORKERS - 1), channel=st.sampled_from(["best", "best", "frames", "shm", "knock"]))
    def train(self, who: int, channel: str) -> None:
        """A worker's ordinary step: a small gradient from the current version, the next sequence number.

        ``best`` is what a real worker does: knock if the ps listens, else a
        header over shared memory, else frames (which makes the ps let its
        memory go).
        """
        actor = self.actors[who]
        if channel == "best":
            channel = "knock" if actor.knocks else "shm" if actor.attached else "frames"
        self.push(who, "small", "current", "next", channel)

    @precondition(lambda self: self.ps.serving and self.ps.server.store.initialized)
    @rule(sign=st.sampled_from([1.0, -1.0]))
    def overflow(self, sign: float) -> None:
        """Finite pushes of 3e38, from each worker in turn, until the store or the round's sum would overflow."""
        refused = self.ps.server.stats.refused
        for turn in range(12):
            if not self.ps.serving or self.ps.server.stats.refused > refused:
                return
            actor = self.actors[turn % WORKERS]
            grad = np.full(self._flat_size(), sign * 3e38, np.float32)
            seq = actor.next_seq
            actor.next_seq += 1
            self.send(actor, self._push(actor, grad, self._store_version(), seq, self.harness.epoch))

    @precondition(lambda self: self.ps.serving and self.ps.server.store.initialized)
    @rule()
    def checkpoint(self) -> None:
        """The chief's checkpoint: pause at the current version, read the state, resume."""
        chief = self.actors[0]
        self.send(chief, Message("pause_at", chief.fields(version=self._store_version()), [], chief.rid()))
        self.send(chief, Message("state", chief.fields(), [], chief.rid()))
        self.refused_table_chunks(chief)
        self.send(chief, Message("resume", chief.fields(), [], chief.rid()))

    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        op=st.sampled_from(MUTATED_OPS),
        key=st.sampled_from(MUTATED_KEYS),
        value=st.sampled_from(ODD),
        arrays=st.sampled_from(["keep", "drop", "extra", "f64", "shape", "empty"]),
    )
    def mutated(self, who: int, op: str, key: str, value: Any, arrays: str) -> None:
        """A real message of ``op`` with one field replaced and its arrays changed."""
        actor = self.actors[who]
        grads = [np.full(self._flat_size(), 0.01, np.float32)] if op in ("push_pull",) else self._variables()
        fields = actor.fields(
            version=self._store_version(),
            seq=actor.next_seq,
            epoch=self.harness.epoch,
            names=self.names,
            job=JobSpec(SyncSpec("async").resolved(WORKERS), 50, WORKERS).to_json(),
            rule=SGD().to_json(),
        )
        actor.next_seq += 1
        fields[key] = value
        if arrays == "drop":
            grads = grads[:-1]
        elif arrays == "extra":
            grads = [*grads, np.zeros(3, np.float32)]
        elif arrays == "f64":
            grads = [g.astype(np.float64) for g in grads]
        elif arrays == "shape":
            grads = [g.reshape(-1)[:-1] for g in grads]
        elif arrays == "empty":
            grads = []
        if op == "init" and key == "worker" and value == 0 and not self.ps.server.store.initialized:
            return  # a valid init in disguise: the init rule covers it, and the model would not follow
        if op == "restore" and actor.worker == 0 and key != "worker":
            return  # a chief's restore with one odd field may still be valid: the restore rule covers that
        self.send(actor, Message(op, fields, grads, actor.rid()), must_fail=ill_typed(op, key, value))

    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        kind=st.sampled_from(["nested", "zero-shape", "bad-utf8", "no-rid", "nan-field", "frames", "long-op"]),
    )
    def garbage(self, who: int, kind: str) -> None:
        """Frames no real client sends: the decoder's refusals, from a connection holding a session."""
        actor = self.actors[who]
        rid = actor.rid()
        frames = {
            "nested": [b'{"op":"pull","rid":%d,"a":[],"f":{"x":' % rid + b"[" * 30_000 + b"]" * 30_000 + b"}}"],
            "zero-shape": [b'{"op":"push_pull","rid":%d,"f":{},"a":[["<f4",[0,1180591620717411303424]]]}' % rid, b""],
            "bad-utf8": [b'{"op":"pull","rid":%d,"f":{},"a":[]}\xff' % rid],
            "no-rid": [b'{"op":"pull","f":{},"a":[]}'],
            "nan-field": [b'{"op":"ping","rid":%d,"f":{"x":NaN},"a":[]}' % rid],
            "frames": [b'{"op":"ping","rid":%d,"f":{},"a":[]}' % rid, b"1234"],
            "long-op": [json.dumps({"op": "p" * 20_000, "rid": rid, "f": {}, "a": []}).encode()],
        }[kind]
        # A reply is required when the rid can be read leniently (the ps's rule), and it must be an error.
        self.harness.send(actor, Message(kind, {}, [], rid), must_fail=True, frames=frames)

    @rule()
    def idle(self) -> None:
        """Nothing sent: always possible, also after the chief ended the job."""
        if self.ps.serving:
            self.harness.settle()

    # ---------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        self.harness.check_books()

    @invariant()
    def store_is_finite(self) -> None:
        self.harness.check_store()

    @invariant()
    def store_is_the_models(self) -> None:
        """The ps's version, parameters, slots and rule step are the reference model's, within float tolerance."""
        STEPS[0] += 1
        self._check_bounds()
        store = self.ps.server.store
        if store.initialized != self.model.initialized:
            self._disagree(f"the store is {'' if store.initialized else 'not '}initialised, the model is not")
        if not store.initialized:
            return
        problems = self.model.compare(store.version, store.params(), store.slots(), store.rule_step)
        problems += self.model.compare_tables(self.table_states())
        if problems:
            self._disagree("; ".join(problems))

    @invariant()
    def alive_or_ended_on_purpose(self) -> None:
        self.harness.check_exit(self.ended)

    def teardown(self) -> None:
        """After each sequence the ps answers a ping, then takes one of the chief's endings (each in turn) and
        exits as it must, saying why."""
        try:
            if self.ps.serving and not FIRST_FAILURES:
                self.harness.probe()
                chief, op = self.actors[0], sorted(ENDINGS)[STEPS[0] % len(ENDINGS)]
                self.send(chief, Message(op, chief.fields(), [], chief.rid()))
                self.ended = op
                self.harness.check_exit(self.ended)
        finally:
            self.harness.close()
