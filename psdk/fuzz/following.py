"""How the stateful fuzzer follows the ps with its reference model: each reply moves the model, or disagrees.

A mixin of :class:`psdk.fuzz.stateful.PsMachine`: the rules send
through :meth:`ModelFollowing.send`, which lets the harness deliver the
request and then feeds the model (:mod:`psdk.fuzz.model`) what the ps
did with it, in the order its replies show; any difference is a violation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psdk import protocol
from psdk.fuzz.harness import Actor, Harness, LivePs
from psdk.fuzz.model import ATOL, RTOL, Model, Pushed
from psdk.fuzz.rows import RowRequest, TableState, row_request
from psdk.transport.wire import Message


class ModelFollowing:
    """The machine's half that keeps the reference model in step with the ps (see the module docstring)."""

    harness: Harness
    ps: LivePs
    model: Model
    saved: Message | None
    bounded: dict[tuple[int | None, int], tuple[int, int]]
    naming: dict[str, np.ndarray] | None = None
    """By table, the ids of the pull the next push names (a ``pulled`` entry carries its rows only)."""
    last_answer: Message | None = None
    """The reply to the last request sent, if it came while the fuzzer waited (a push may be held)."""

    def send(self, actor: Actor, message: Message, must_fail: bool = False) -> None:
        """Send ``message`` through the harness, then let the reference model follow what the ps did with it."""
        grad, rows = None, row_request(message.fields.get("tables"), message.arrays[1:], self.naming)
        if message.op == "push_pull":
            if message.arrays:
                grad = message.arrays[0]
            elif actor.buffers is not None:
                grad = actor.buffers.grads.copy()
        pauses_ended = self._pauses_ended()
        self.harness.send(actor, message, must_fail=must_fail)
        self.last_answer = self.harness.answers.get((actor.worker, message.rid))
        if self._pauses_ended() > pauses_ended:  # the chief's id from a new connection: the ps resumed by itself
            self.model.resume()
        if message.op == "push_pull":
            if grad is not None:
                worker = message.fields.get("worker")
                self._follow_push(actor, message.rid, message.fields.get("version"), grad, worker, rows)
        elif message.op == "pull":
            self._follow_pull(actor, message)
        else:
            self._follow(actor, message)
        self._check_replied()

    def _follow_pull(self, actor: Actor, message: Message) -> None:
        """A pull answered with parameters read (and, for a training pull, created) the rows it names."""
        reply = self.harness.answers.pop((actor.worker, message.rid), None)
        if reply is not None and reply.op == "error" and reply.fields.get("kind") == "failed":
            self.model.fail()
        if reply is None or reply.op != "params" or not self.model.initialized:
            return  # refused (a bad table part, a stranger, ...): nothing changed
        rows = row_request(message.fields.get("tables"), message.arrays)
        if rows is None:
            self._disagree(f"the ps answered a pull whose tables the model cannot read: {message.fields}")
            return
        self._check_rows(rows, self.model.pull_rows(rows), reply)

    def _check_replied(self) -> None:
        """The rows every push the model answered this step carries, where its reply came; then forgotten.

        A reply that did not come in the step the model answered it (a
        staleness bound holds it) reads its rows at a time the model does not
        know: it is not compared (the fuzzer sends no training pulls there).
        """
        for key, (request, want) in self.model.replied.items():
            reply = self.harness.answers.get(key)
            if reply is not None and reply.op == "params":
                self._check_rows(request, want, reply)
        self.model.replied.clear()

    def _check_rows(self, request: RowRequest, want: list[np.ndarray | None], reply: Message) -> None:
        got = reply.arrays[1:]
        if len(got) != len(want):
            self._disagree(f"a reply carried {len(got)} tables' rows, the request pulled {len(want)}")
            return
        problems = [
            problem
            for (name, _, _), rows, expected in zip(request.pulls, got, want, strict=True)
            for problem in self.model.tables[name].check_reply(rows, expected, RTOL, ATOL)
        ]
        if problems:
            self._disagree("; ".join(problems))

    def refused_table_chunks(self, chief: Actor) -> None:
        """A table no job declares: its chunk is refused whether paused or not, and so is a restore no init
        announced (tests/test_table_checkpoints.py covers both with tables)."""
        chunk = chief.fields(table="t", part="rows", cursor=0, rows=16)
        self.send(chief, Message("table_state", chunk, [], chief.rid()), must_fail=True)
        restore = chief.fields(table="t", part="commit", chunk=0, counters=[0, 0, 0, 0])
        self.send(chief, Message("table_restore", restore, [], chief.rid()), must_fail=True)

    def table_states(self) -> dict[str, TableState]:
        """The rows, slots and counters of every table the ps's shard holds (read while it is idle)."""
        held = {}
        for name, table in self.ps.server.store.tables.items():
            ids, rows = table.rows.export()
            slots = table.rows.gather(ids)[1] if len(ids) else {}
            held[name] = TableState(ids, rows, slots, table.rows.evicted, table.dropped_rows)
        return held

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
            busy = reply is not None and reply.fields.get("kind") == protocol.BUSY
            if said in (None, "paused", "passed") or busy:  # the ps holds the pause then
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

    def _follow_push(
        self, actor: Actor, rid: int, version: Any, grad: np.ndarray, worker: Any = None, rows: RowRequest | None = None
    ) -> None:
        """A push the ps handled: if its checks let it through, the model submits it and must agree on the outcome."""
        model = self.model
        reply = self.harness.answers.pop((actor.worker, rid), None)
        if reply is not None and reply.op == "error" and reply.fields.get("kind") == "failed":
            model.fail()
            return
        overflow = reply is not None and reply.fields.get("kind") == protocol.NON_FINITE
        if reply is not None and reply.op not in ("params",) and not overflow:
            return  # refused by the checks before the policy (a resync, a repeat, a stranger...): nothing changed
        worker = actor.worker if worker is None else worker  # the id the push claims is the one the ps counts
        if not model.initialized or not isinstance(worker, int) or not isinstance(version, int) or rows is None:
            self._disagree(f"the ps took a push the model cannot place: {reply.op if reply else 'parked'}")
            return
        pushed = Pushed(worker, version, np.asarray(grad, np.float64).copy(), rows, (actor.worker, rid))
        outcomes = dict(model.submit(pushed))
        answered = model.replied.pop(pushed.key, None)  # its own reply was taken out of the answers above
        if answered is not None and reply is not None and reply.op == "params":
            self._check_rows(*answered, reply)
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
