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
  reference model (:mod:`psdk.testing.fuzz.model`), which applies every
  gradient the ps took with the rule's formulas restated, after every step
  and in every checkpoint's state; each push's outcome (applied, dropped,
  held, done, refused for overflow) is the one the model gives it;
* the ps is alive and answers a ping, or it exited on purpose (the chief's
  shutdown or abort), with its reason logged and the matching exit code,
  never with a traceback, and never hangs.


The live ps, the connections and the books are the harness's
(:mod:`psdk.testing.fuzz.harness`); this module holds the rules that draw
the sequences, and runs them. Run it through :func:`run` (``python -m psdk
fuzz``, long budgets) or the test suite (``tests/test_fuzz_stateful.py``,
short ones).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from psdk import protocol
from psdk.consistency import MODES, POLICIES, SyncSpec
from psdk.jobspec import JobSpec
from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing.fuzz.harness import ENDINGS, WORKERS, Actor, Harness, Mode
from psdk.testing.fuzz.model import Model, Pushed
from psdk.transport import shm
from psdk.transport.wire import Message

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ImportError:  # pragma: no cover - the CLI says how to install it
    raise ImportError("the stateful fuzzer needs hypothesis: pip install 'psdk[test]'") from None

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


class PsMachine(RuleBasedStateMachine):
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
        self.bounded: dict[tuple[int | None, int], tuple[int, int]] = {}
        """Applied pushes whose answer the staleness bound may hold: (connection's worker, rid) -> (worker,
        its iterations once applied); each answer is checked against the bound when it comes."""
        """The last checkpoint the chief read (a ``state`` reply): what a restore or a restarted ps starts from."""
        """What the shard should hold (:mod:`psdk.testing.fuzz.model`), checked after every step."""

    @initialize(
        start=st.sampled_from(["nothing", "init", "init+attach"]),
        mode=SPREAD_MODES,
        rule_index=SPREAD_RULES,
    )
    def start(self, start: str, mode: str, rule_index: int) -> None:
        """Most sequences begin with a job the chief initialised (and memory lent): the handlers past init."""
        if start == "nothing":
            return
        self.init(0, mode, rule_index, 10**6, False, 1.0)
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

    # ------------------------------------------------------ following
    def send(self, actor: Actor, message: Message, must_fail: bool = False) -> None:
        """Send ``message`` through the harness, then let the reference model follow what the ps did with it."""
        grad = None
        if message.op == "push_pull":
            if message.arrays:
                grad = message.arrays[0]
            elif actor.buffers is not None:
                grad = actor.buffers.grads.copy()
        pauses_ended = self._pauses_ended()
        self.harness.send(actor, message, must_fail=must_fail)
        if self._pauses_ended() > pauses_ended:  # the chief's id from a new connection: the ps resumed by itself
            self.model.resume()
        if message.op == "push_pull":
            if grad is not None:
                self._follow_push(actor, message.rid, message.fields.get("version"), grad, message.fields.get("worker"))
            return
        self._follow(actor, message)

    def _pauses_ended(self) -> int:
        return sum("training goes on" in record.getMessage() for record in self.ps.tap.records)

    def _follow(self, actor: Actor, message: Message) -> None:
        model, fields = self.model, message.fields
        reply = self.harness.answers.pop((actor.worker, message.rid), None)
        said = reply.op if reply is not None else None
        if reply is not None and reply.op == "error" and reply.fields.get("kind") == "failed":
            model.fail()
        if fields.get("worker") != 0 or (said == "error" and message.op != "pause_at"):
            return
        if message.op == "init" and said == "ok":
            model.init(fields, message.arrays)
        elif message.op == "restore" and said == "ok":
            model.restore(fields, message.arrays)
        elif message.op == "pause_at" and model.initialized and not model.failed:
            error = str(reply.fields.get("error", "")) if reply is not None else ""
            if said in (None, "paused", "passed") or "already wait" in error:  # the ps holds the pause then
                model.pause_at(int(fields["version"]), refused=said == "error")
        elif message.op == "resume" and said == "ok":
            model.resume()
        elif message.op == "stop_at" and said == "ok" and reply is not None:
            steps = model.stop_at(int(fields["version"]))
            if reply.fields.get("steps") != steps:
                self._disagree(f"stop_at answered steps {reply.fields.get('steps')}, the model says {steps}")
        elif message.op == "state" and said == "state" and reply is not None:
            self._check_state(reply)
            self.saved = reply

    def _follow_push(self, actor: Actor, rid: int, version: Any, grad: np.ndarray, worker: Any = None) -> None:
        """A push the ps handled: if its checks let it through, the model submits it and must agree on the outcome."""
        model = self.model
        reply = self.harness.answers.pop((actor.worker, rid), None)
        error = str(reply.fields.get("error", "")) if reply is not None and reply.op == "error" else ""
        if reply is not None and reply.op == "error" and reply.fields.get("kind") == "failed":
            model.fail()
            return
        overflow = "NaN or Inf in the store" in error or "overflow" in error
        if reply is not None and reply.op not in ("params",) and not overflow:
            return  # refused by the checks before the policy (a resync, a repeat, a stranger...): nothing changed
        worker = actor.worker if worker is None else worker  # the id the push claims is the one the ps counts
        if not model.initialized or not isinstance(worker, int) or not isinstance(version, int):
            self._disagree(f"the ps took a push the model cannot place: {reply.op if reply else 'parked'}")
            return
        outcomes = dict(model.submit(Pushed(worker, version, np.asarray(grad, np.float64).copy())))
        expected = outcomes.get(worker)
        got = "refused" if overflow else reply.fields.get("outcome") if reply is not None else None
        if expected == "applied" and not model.rounds:
            self.bounded[(actor.worker, rid)] = (worker, model.clock[worker])
            if reply is not None:  # checked against the bound with the answers that come later
                self.harness.answers[(actor.worker, rid)] = reply
            self._check_bounds()
            if got is None or (got == "done" and model.done):
                return  # applied, its answer held back by the staleness bound (and answered "done" once done)
        if got != expected:
            self._disagree(
                f"worker {actor.worker}'s push was answered {got or 'later'}; the model says {expected or 'later'}"
            )
        if reply is not None and got == "applied" and not model.rounds and reply.fields.get("version") != model.version:
            self._disagree(f"a push applied at version {reply.fields.get('version')}; the model is at {model.version}")

    def _check_bounds(self) -> None:
        """Every push answered since the last look was answered within the staleness bound, by its reply's word."""
        for key, (worker, iterations) in list(self.bounded.items()):
            reply = self.harness.answers.get(key)
            if reply is None:
                continue
            del self.bounded[key]
            slowest = reply.fields.get("slowest")
            applied = reply.op == "params" and reply.fields.get("outcome") == "applied"
            if applied and isinstance(slowest, int) and self.model.beyond_bound(iterations, slowest):
                self._disagree(
                    f"worker {worker} may start iteration {iterations + 1} while the slowest worker has finished "
                    f"{slowest}: beyond the staleness bound {self.model.staleness}"
                )

    def _check_state(self, reply: Message) -> None:
        """A checkpoint's state, as the chief reads it, must be the model's."""
        slots = {str(name): reply.arrays[1 + i] for i, name in enumerate(reply.fields.get("slots", []))}
        problems = self.model.compare(
            int(reply.fields["version"]), reply.arrays[0], slots, int(reply.fields.get("rule_step", -1))
        )
        if problems:
            self._disagree("the checkpoint's state differs from the model: " + "; ".join(problems))

    def _disagree(self, what: str) -> None:
        self.harness.trace.extend(self.model.log[-8:])
        model = self.model
        rule = model.rule.spec if model.rule is not None else None
        self.harness._violation(
            f"the ps and the reference model disagree: {what} (rule {rule}, {model.mode} mode, version {model.version},"
            f" rule step {model.rule_step})"
        )

    def _push(self, actor: Actor, grad: np.ndarray, version: int, seq: int, epoch: int) -> Message:
        return Message("push_pull", actor.fields(version=version, seq=seq, epoch=epoch), [grad], actor.rid())

    def _store_version(self) -> int:
        return self.ps.server.store.version

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
    def init(self, who: int, mode: str, rule_index: int, steps: int, restore: bool, scale: float) -> None:
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
        must_fail = actor.worker != 0 or (math.isnan(scale) and not self.ps.server.store.initialized)
        self.send(actor, Message("init", fields, arrays, actor.rid()), must_fail=must_fail)

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
                self._follow_push(actor, rid, at, grad)
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

    def _checkpoint_arrays(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The saved checkpoint as a restore sends it: ``{version, rule_step, slots}``, variables, then slots."""
        assert self.saved is not None
        fields, flats = self.saved.fields, self.saved.arrays
        shapes = [tuple(shape) for shape in fields["shapes"]]
        cuts = np.cumsum([math.prod(shape) for shape in shapes])[:-1]
        arrays = [
            part.reshape(shape).copy()
            for flat in flats
            for part, shape in zip(np.split(flat, cuts), shapes, strict=True)
        ]
        restore = {"version": fields["version"], "rule_step": fields["rule_step"], "slots": fields["slots"]}
        return restore, arrays

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
        self.send(actor, Message(op, fields, grads, actor.rid()), must_fail=_ill_typed(op, key, value))

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


def _ill_typed(op: str, key: str, value: Any) -> bool:
    """Whether ``value`` breaks the type the protocol declares for ``op``'s field ``key`` (then it must be refused)."""
    if key == "worker":
        return not protocol.WORKER_FIELD.type.accepts(value)
    declared = {f.name: f for f in protocol.OPS[op].fields}.get(key)
    if declared is None:
        return False
    return not (value is None and declared.nullable) and not declared.type.accepts(value)


def machine(mode: Mode) -> type[PsMachine]:
    """The state machine over a ps in ``mode`` (a subclass per mode: hypothesis builds it without arguments)."""
    return type(
        f"PsMachine_{'curve' if mode.curve else 'plain'}_{'shm' if mode.shared_memory else 'frames'}",
        (PsMachine,),
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
    """The step that saw the first violation, counting every sequence's steps."""

    def line(self) -> str:
        outcome = "PASS" if self.failure is None else f"FAIL (caught at step {self.caught_at}): {self.failure}"
        return f"stateful ({self.mode.label}): {self.examples} sequences, {self.seconds:.1f} s: {outcome}"


def run(mode: Mode, examples: int, steps: int, seed: int | None = None, shrink: bool = True) -> StatefulReport:
    """Run ``examples`` sequences of up to ``steps`` steps each, each against a fresh ps in ``mode``.

    ``seed`` fixes the sequences (the same seed, the same sequences); ``None``
    derives them from the test itself, as the test suite does. ``shrink``:
    on a failure, look for the shortest sequence that fails too.
    """
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.stateful import get_state_machine_test

    report = StatefulReport(mode, examples, steps)
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
    test = get_state_machine_test(machine(mode), settings=options)
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
