"""The shard a ps serves: its variables, the job they train in, and the requests that read or change them.

The chief configures the job (sync mode, target step, workers, update rule)
when it initialises the store, as TensorFlow's workers built the graph the
ps only served. Pushes go through the consistency policy of the job's mode
(:mod:`psdk.ps.consistency`), which decides when they are applied and
answered; while the chief holds a checkpoint pause they wait in
:class:`~psdk.ps.pause.PauseLease`. When the global step reaches the target,
every waiting and later push is answered "done"; plain pulls still work, so
the chief can read the final parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from functools import partial
from typing import Any

import numpy as np

from psdk.errors import ConfigError, NonFiniteError, ProtocolError, RefusedError
from psdk.plugins.registry import rule_from_json
from psdk.protocol import BUSY
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.numerics import magnitude
from psdk.protocol.sharding import largest_message_bytes
from psdk.ps.consistency import ConsistencyPolicy, Push, make_policy
from psdk.ps.membership import FINISHED, Membership
from psdk.ps.outbox import Outbox
from psdk.ps.pause import PauseLease
from psdk.ps.sessions import Sessions
from psdk.ps.stats import ShardStats
from psdk.ps.store import ParameterStore, RestoreState
from psdk.ps.tables.chunks import ChunkedRestore, chunk_bytes, restores_of
from psdk.ps.tables.requests import NamedPulls, TablePull, pulled_rows, pulled_shapes, table_request
from psdk.ps.tables.setup import fill_tables, place_tables, tables_bytes
from psdk.runtime.failpoints import PS_UPDATE, failpoint
from psdk.transport import ServerEndpoint
from psdk.transport.wire import MAX_HEADER_BYTES, Message

log = logging.getLogger("psdk.ps.server")

MAX_WAITS_PER_WORKER = 2
"""Requests one worker may leave waiting for the chief's init (or the chief for a pause): a real one sends one."""


def restore_state(data: Any, names: list[str], arrays: list[np.ndarray]) -> RestoreState | None:
    """The checkpoint state a message carries after its variables (``None``: it carries none)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProtocolError("restore must be an object")
    version, rule_step, slot_names = data.get("version"), data.get("rule_step"), data.get("slots")
    if not (isinstance(version, int) and isinstance(rule_step, int) and isinstance(slot_names, list)):
        raise ProtocolError("restore needs an integer version and rule_step and a list of slots")
    if len(arrays) != len(names) * (1 + len(slot_names)):
        raise ProtocolError("restore needs one array per variable and slot")
    slots = {}
    for i, slot in enumerate(slot_names):
        start = len(names) * (1 + i)
        slots[str(slot)] = dict(zip(names, arrays[start : start + len(names)], strict=True))
    return RestoreState(version, rule_step, slots)


def take_finished(membership: Membership, data: Any, num_workers: int) -> None:
    """A restore tells the shard who had finished, with their reports (the chief had collected them)."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise ProtocolError("finished must be an object {worker id: report}")
    for key, report in data.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < num_workers):
            raise RefusedError(f"finished names {key!r}, which is no worker of this job")
        membership.finish(int(key), report=report, collected=True)


class ServedShard:
    def __init__(
        self,
        name: str,
        store: ParameterStore,
        endpoint: ServerEndpoint,
        outbox: Outbox,
        stats: ShardStats,
        sessions: Sessions,
        pause: PauseLease,
        recovery: bool,
        max_pushes_in_flight: int,
        index: int = 0,
    ):
        self.index = index
        """This ps's task index: the shard of each table whose rows it holds."""
        self.name, self.store, self.endpoint, self.outbox, self.stats = name, store, endpoint, outbox, stats
        self.sessions, self.pause = sessions, pause
        self.recovery = recovery
        """Dead tasks come back (recovery.enabled): a restarted, empty shard answers "resync", not an error."""
        self.max_pushes_in_flight = max_pushes_in_flight
        self.job: JobSpec | None = None
        self.policy: ConsistencyPolicy | None = None
        # A restarted ps has a new boot id; every restore by the chief starts a new epoch, and a
        # push computed in an older epoch is answered "resync" instead of being applied.
        self.boot = secrets.token_hex(4)
        self.epoch = 0
        self.failure: str | None = None
        self.init_waiters: list[tuple[bytes, int, int]] = []  # peer, rid, worker
        self._reply_buffers: dict[int, np.ndarray] = {}
        self.named_pulls = NamedPulls()
        """Each worker's last training pull per table: its next push may name the ids instead of sending them."""
        self.table_restores: dict[str, ChunkedRestore] = {}
        """Tables the chief's init announced it restores (``table_restore``): ``wait_init`` waits for them."""
        self._grad_copy = np.zeros(0, np.float32)
        """A borrowed gradient (in a worker's memory) is copied here when the rule must read it twice."""

    @property
    def membership(self) -> Membership:
        return self.sessions.membership

    @property
    def done(self) -> bool:
        return self.job is not None and self.store.version >= self.job.steps

    def require_init(self) -> None:
        if not self.store.initialized or self.job is None:
            raise RefusedError("the store is not initialised yet (the chief initialises it)")

    def layout(self) -> dict[str, Any]:
        assert self.job is not None
        return {
            "version": self.store.version,
            "done": self.done,
            "epoch": self.epoch,
            "boot": self.boot,
            "job": self.job.to_json(),
            "names": [s.name for s in self.store.specs],
            "shapes": [list(s.shape) for s in self.store.specs],
            "tables": [table.spec.to_json() for table in self.store.tables.values()],
        }

    def largest_message_bytes(self) -> int:
        """The largest message a peer of this job can legitimately send this shard: the chief's restore.

        It carries every variable and every slot of the shard (a push carries
        the variables' size once), and a header.
        """
        dense = largest_message_bytes(self.store.size, len(self.store.slots()))
        restores = self.table_restores.values()
        chunk = max((chunk_bytes([r.table], r.chunk_rows) for r in restores), default=0)
        return max(dense, self.largest_push_bytes(), chunk)

    def limit_incoming(self) -> None:
        """Cap what peers may send: the largest legitimate message, and what every worker's pushes hold at once."""
        assert self.job is not None
        largest, push = self.largest_message_bytes(), self.largest_push_bytes()
        self.endpoint.limit_incoming(largest, largest + self.job.num_workers * push)

    def largest_push_bytes(self) -> int:
        """A push: the flat gradient, and for every table its most ids with their rows, and as many ids to pull."""
        return 4 * self.store.size + tables_bytes(self.store.tables.values()) + MAX_HEADER_BYTES

    # ------------------------------------------------------------- replies
    def resync(self, peer: bytes, rid: int, why: str) -> None:
        """Tell a worker to wait for the chief's restore and pull again: a typed reply, not an error."""
        fields = {
            "why": why,
            "initialized": self.store.initialized,
            "epoch": self.epoch,
            "boot": self.boot,
            "version": self.store.version,
        }
        self.outbox.send(peer, rid, "resync", fields)

    def reply_params(
        self, peer: bytes, rid: int, outcome: str, worker: int, pulls: list[TablePull] | None = None
    ) -> None:
        """The parameters (and the rows ``pulls`` name), to a worker's session only (never a stranger's)."""
        fields: dict[str, Any] = {"version": self.store.version, "done": self.done, "outcome": outcome}
        if self.policy is not None and self.job is not None and not self.job.sync.waits_for_rounds:
            fields["slowest"] = self.policy.slowest()  # lets a worker check the staleness bound
        rows: list[np.ndarray] = []
        lent = self.endpoint.lent_memory(peer)
        if pulls:
            # Gathered straight into the worker's memory where it lent room for them: no copy after.
            room = self.endpoint.reply_room(peer, rid, pulled_shapes(pulls)) if lent else None
            looking = time.perf_counter()
            rows = pulled_rows(pulls, room)
            if outcome != "pulled":  # a step's pull (a plain pull's, evaluation's, is no push's)
                self.stats.index_s += time.perf_counter() - looking
                if self.sessions.current(worker, peer):  # not a dead process's parked push, answered late
                    self.named_pulls.answered(worker, peer, rid, pulls)  # the next step's push may name them
        if lent:  # written into the worker's memory (rows too): no copy of ours
            self.outbox.deliver(peer, Message("params", fields, [self.store.params(), *rows], rid, in_place=True))
            return
        # Each worker has a reply buffer of its own, sent zero-copy with a frame built once. It is
        # safe to refill on the worker's next request: the worker only sends one once it has this reply.
        buffer = self._reply_buffers.get(worker)
        if buffer is None or buffer.shape != (self.store.size,):
            buffer = self._reply_buffers[worker] = np.empty(self.store.size, np.float32)
        np.copyto(buffer, self.store.params())
        self.outbox.deliver(peer, Message("params", fields, [buffer, *rows], rid, stable=True))

    def release_parked(self, outcome: str = "done") -> None:
        """Answer every push the mode holds back with ``outcome`` (the job reached its target)."""
        assert self.policy is not None
        for push in self.policy.release_parked():
            self.reply_params(push.peer, push.rid, outcome, push.worker, push.tables.pulls)

    # ------------------------------------------------------------ handlers
    def on_init(self, peer: bytes, message: Message, worker: int) -> None:
        if self.store.initialized:
            self.outbox.send(peer, message.rid, "already", self.layout())
            return
        job = JobSpec.from_json(message.fields["job"])
        if job.num_workers > self.sessions.max_workers:
            raise RefusedError(
                f"the job has {job.num_workers} workers but this ps serves at most {self.sessions.max_workers}"
            )
        try:
            rule = rule_from_json(message.fields.get("rule") or {})
        except (ConfigError, TypeError, ValueError) as exc:
            raise RefusedError(f"bad update rule: {exc}") from None
        names = message.fields["names"]
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ProtocolError("variable names must be unique non-empty strings")
        restore = restore_state(message.fields.get("restore"), names, message.arrays)
        if len(message.arrays) != len(names) * (1 + (len(restore.slots) if restore else 0)):
            raise ProtocolError("init needs one array per variable (and per slot when restoring)")
        tables = place_tables(message.fields.get("tables"), self.index, rule)  # checked before anything changes
        table_restores = restores_of(message.fields.get("restore"), tables)
        self.store.initialize(dict(zip(names, message.arrays, strict=False)), rule, restore)
        self.store.place_tables(tables)
        fill_tables(tables, table_restores)
        self.table_restores = table_restores
        self.epoch = message.fields.get("epoch") or 0
        self.job = job
        self.limit_incoming()
        self.policy = make_policy(self.store, job.sync, self.membership.live)
        self.membership.expect(job.num_workers)
        if self.epoch > 0:  # restored after a ps was lost: the workers were running, their heartbeats come at once
            self.membership.unseen_are_dead_after(time.monotonic(), self.membership.heartbeat_timeout_s)
        take_finished(self.membership, message.fields.get("finished"), job.num_workers)
        self.sessions.forget_beyond(job.num_workers)
        log.info(
            "%s: initialised %d variables (%d floats), %s, %s mode, %d steps, %d workers%s",
            self.name,
            len(names),
            self.store.size,
            rule.name,
            job.sync.mode,
            job.steps,
            job.num_workers,
            f", restored at version {self.store.version}" if restore else "",
        )
        self.outbox.send(peer, message.rid, "ok", self.layout())
        if not self.table_restores:
            self.release_init_waiters()

    def release_init_waiters(self) -> None:
        """The job is placed (and its tables restored): the workers waiting for it get the layout."""
        for waiter_peer, rid, _ in self.init_waiters:
            self.outbox.send(waiter_peer, rid, "layout", self.layout())
        self.init_waiters.clear()

    def on_wait_init(self, peer: bytes, message: Message, worker: int) -> None:
        if self.failure:
            self.outbox.error(peer, message.rid, self.failure, "failed")
        elif self.store.initialized and not self.table_restores:
            self.outbox.send(peer, message.rid, "layout", self.layout())
        elif sum(1 for waiter in self.init_waiters if waiter[2] == worker) >= MAX_WAITS_PER_WORKER:
            raise RefusedError(f"worker {worker} already waits for the chief {MAX_WAITS_PER_WORKER} times", BUSY)
        else:
            self.init_waiters.append((peer, message.rid, worker))

    def on_pull(self, peer: bytes, message: Message, worker: int) -> None:
        if not self.store.initialized and self.recovery:
            self.resync(peer, message.rid, f"{self.name} has restarted and waits for the chief to restore it")
            return
        self.require_init()
        tables = table_request(message.fields.get("tables"), message.arrays, self.store.tables, pushes=False)
        self.reply_params(peer, message.rid, "pulled", worker, tables.pulls)

    def on_push_pull(self, peer: bytes, message: Message, worker: int) -> None:
        if not self.store.initialized and self.recovery:
            self.resync(peer, message.rid, f"{self.name} has restarted and waits for the chief to restore it")
            return
        self.require_init()
        version, seq = message.fields["version"], message.fields["seq"]
        if not message.arrays:
            raise ProtocolError("push_pull carries one flat gradient (then its tables' arrays)")
        if message.fields.get("epoch", 0) != self.epoch:  # computed before the chief's last restore
            self.resync(peer, message.rid, f"the chief restored the job (epoch {self.epoch}); pull again")
            return
        grad, rest, checking = message.arrays[0], message.arrays[1:], time.perf_counter()
        if message.borrowed and self._keeps_pushes():  # rows read in place: copied before they are checked
            rest = [array.copy() if array.dtype == np.float32 else array for array in rest]
        pulled = message.fields.get("pulled")
        named = None if pulled is None else partial(self.named_pulls.ids, worker, peer, pulled)
        tables = table_request(message.fields.get("tables"), rest, self.store.tables, pushes=True, named=named)
        self.stats.index_s += time.perf_counter() - checking
        if message.borrowed and self.store.needs_stable_gradient():
            grad = self._stable(grad)
        if grad.dtype != np.float32 or grad.shape != (self.store.size,):
            raise RefusedError(f"gradient is {grad.dtype}{list(grad.shape)}, expected float32[{self.store.size}]")
        if version > self.store.version:
            raise RefusedError(f"gradient computed from version {version}, but this shard is at {self.store.version}")
        if self.membership.status(worker) == FINISHED and not self.done:  # once done, every push is told "done"
            raise RefusedError(f"worker {worker} has finished: its pushes are refused (a new process may rejoin)")
        counters = self.stats.worker(worker)
        if seq <= counters.last_seq:
            raise RefusedError(f"duplicate push (seq {seq}) from worker {worker}: not applied")
        waiting = self._pushes_waiting(worker)
        if waiting >= self.max_pushes_in_flight:
            raise RefusedError(
                f"worker {worker} already has {waiting} pushes waiting for their answer on {self.name} "
                f"(at most {self.max_pushes_in_flight}): not applied",
                BUSY,
            )
        bound = magnitude(grad)
        if not math.isfinite(bound):
            counters.last_seq = seq
            counters.refused += 1
            self.stats.refused += 1
            raise RefusedError(f"gradient from worker {worker} holds NaN or Inf: not applied")
        counters.last_seq = seq
        if self.failure:
            self.outbox.error(peer, message.rid, self.failure, "failed")
            return
        self.submit(Push(peer, message.rid, worker, version, grad, bound=bound, tables=tables))

    def _keeps_pushes(self) -> bool:
        """Whether a push now is kept past its reply (a sync round's, one a checkpoint pause holds): its rows,
        which a worker lends only until the reply, must be copied (the dense gradient is, in :meth:`submit`)."""
        return bool(self.policy is not None and self.policy.waits_for_rounds) or self.pause.covers(self.store.version)

    def _stable(self, grad: np.ndarray) -> np.ndarray:
        """A copy of a borrowed gradient, for a rule that reads it twice (to check it, then to apply it).

        The worker may rewrite its memory during the apply (it computes the
        next gradient into it), and the two reads must see the same values.
        """
        if self._grad_copy.shape != grad.shape or self._grad_copy.dtype != grad.dtype:
            self._grad_copy = np.empty(grad.shape, grad.dtype)
        np.copyto(self._grad_copy, grad)
        return self._grad_copy

    def _pushes_waiting(self, worker: int) -> int:
        """This worker's pushes not answered yet (parked by the mode, held by a pause), from its current process."""
        assert self.policy is not None
        return sum(
            1
            for push in [*self.policy.parked(), *self.pause.pushes]
            if push.worker == worker and self.sessions.current(worker, push.peer)
        )

    def submit(self, push: Push) -> None:
        """Hand a checked push to the consistency policy (or hold it while paused)."""
        assert self.policy is not None
        if self.done:
            self.reply_params(push.peer, push.rid, "done", push.worker, push.tables.pulls)
            return
        if self.pause.covers(self.store.version):  # a copy: a gradient in shared memory is only lent until the reply
            self.pause.pushes.append(dataclasses.replace(push, grad=push.grad.copy()))  # rows: see _keeps_pushes
            return
        counters = self.stats.worker(push.worker)
        counters.pushed += 1
        self.stats.timed_pushes += 1
        applying = time.perf_counter()
        try:
            decision = self.policy.submit(push)
        except NonFiniteError as exc:  # nothing changed: the worker is told, and counted
            self.stats.apply_s += time.perf_counter() - applying
            counters.refused += 1
            self.stats.refused += 1
            self.outbox.reject(push.peer, "push_pull", push.rid, f"worker {push.worker}: {exc}", exc.kind)
            return
        self.stats.apply_s += time.perf_counter() - applying
        if decision.updates:
            now = time.time()
            if self.stats.first_update is None:
                self.stats.first_update = now
            self.stats.last_update = now
            self.stats.updates += decision.updates
            self.stats.applied += len(decision.applied_workers)
            failpoint(PS_UPDATE)
        for refused in decision.refused:
            self.stats.worker(refused.worker).refused += 1
        if decision.refused:
            self.stats.refused += 1
            self.outbox.rejections.warning("%s: the mean of a sync round would be non-finite: dropped", self.name)
        for answered in decision.answer:
            c = self.stats.worker(answered.worker)
            if answered.outcome.value == "applied":
                c.applied += 1
                c.record_staleness(answered.staleness)
            elif not any(answered is refused for refused in decision.refused):
                c.dropped += 1
                self.stats.dropped += 1
            self.reply_params(
                answered.peer, answered.rid, answered.outcome.value, answered.worker, answered.tables.pulls
            )
        if self.done:
            self.release_parked()
        if decision.updates and self.pause.covers(self.store.version):
            for waiter_peer, waiter_rid in self.pause.waiters:
                self.outbox.send(waiter_peer, waiter_rid, "paused", {"version": self.store.version})
            self.pause.waiters.clear()

    def time_per_push(self) -> dict[str, float | int]:
        """Where this shard's time per push went: its index and its rule (:mod:`psdk.jobs.timesplit`)."""
        return self.stats.time_per_push(sum(table.find_s for table in self.store.tables.values()))

    def on_stop_at(self, peer: bytes, message: Message, worker: int) -> None:
        """The chief ends training early: the job is done once this shard reaches ``version``."""
        self.require_init()
        assert self.job is not None and self.policy is not None
        target = message.fields["version"]
        self.job = dataclasses.replace(self.job, steps=min(self.job.steps, max(target, self.store.version)))
        self.outbox.send(peer, message.rid, "ok", {"steps": self.job.steps})
        if self.done:
            self.release_parked()

    def fail(self, reason: str) -> None:
        """Stop the job: answer every waiting request with ``reason``; new pushes are refused from now on."""
        self.failure = reason
        if self.policy is not None:
            for push in self.policy.release_parked():
                self.outbox.error(push.peer, push.rid, reason, "failed")
        for push in self.pause.pushes:
            self.outbox.error(push.peer, push.rid, reason, "failed")
        for peer, rid, *_ in self.init_waiters + self.pause.waiters:
            self.outbox.error(peer, rid, reason, "failed")
        self.init_waiters.clear()
        self.pause.waiters.clear()
        self.pause.pushes.clear()
