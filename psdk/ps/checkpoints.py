"""Checkpoint coordination on a shard: pause at a version, hand out the state, resume.

A checkpoint is a consistent cut: the chief asks every shard to stop
applying pushes once it reaches one version (``pause_at``), reads their
state, and resumes them. The pause is the chief session's lease
(:mod:`psdk.ps.pause`): it ends by itself when that session goes silent,
and the pushes it held are then applied.
"""

from __future__ import annotations

import logging
import time

from psdk.errors import RefusedError
from psdk.protocol import BUSY
from psdk.ps.sessions import session_of
from psdk.ps.shard import MAX_WAITS_PER_WORKER, ServedShard
from psdk.ps.tables.chunks import state_chunk
from psdk.runtime.failpoints import PS_STATE, failpoint
from psdk.transport.wire import Message

log = logging.getLogger("psdk.ps.server")


class Checkpoints:
    def __init__(self, shard: ServedShard):
        self.shard, self.pause, self.outbox = shard, shard.pause, shard.outbox

    @property
    def paused(self) -> bool:
        return self.pause.covers(self.shard.store.version)

    def on_pause_at(self, peer: bytes, message: Message, worker: int) -> None:
        """Stop applying pushes once this shard reaches ``version``; answer when it has."""
        shard, store = self.shard, self.shard.store
        shard.require_init()
        if shard.failure:  # the job has failed: a pause would wait for versions that never come
            self.outbox.error(peer, message.rid, shard.failure, "failed")
            return
        target = message.fields["version"]
        if shard.done and store.version < target:
            self.outbox.send(peer, message.rid, "passed", {"version": store.version})
            return
        if store.version > target:
            # Past it: paused here, and the chief raises its target to this version. Answering "passed"
            # without holding let 8 busy async workers move a single shard on between every two of the
            # chief's requests, and the cut gave up after 50 rounds, failing the job.
            self.pause.hold(store.version, session_of(peer), time.monotonic())
            self.outbox.send(peer, message.rid, "passed", {"version": store.version})
            return
        self.pause.hold(target, session_of(peer), time.monotonic())
        if self.paused:
            self.outbox.send(peer, message.rid, "paused", {"version": store.version})
            return
        if len(self.pause.waiters) >= MAX_WAITS_PER_WORKER:
            raise RefusedError(f"{MAX_WAITS_PER_WORKER} pauses already wait for version {self.pause.version}", BUSY)
        self.pause.waiters.append((peer, message.rid))
        self.release_held()

    def end_pause(self, why: str) -> None:
        """The chief's pause ends without its resume: the shard goes on."""
        if not self.pause.held:
            return
        log.warning("%s: %s; the checkpoint pause at version %s ends, training goes on", self.shard.name, why,
                    self.pause.version)  # fmt: skip
        for peer, rid in self.pause.end():
            self.outbox.error(peer, rid, f"the checkpoint pause ended: {why}", "not_paused")
        self.release_held()

    def _refuse_unpaused(self, peer: bytes, message: Message) -> bool:
        """Answer ``not_paused`` (and say so) unless the pause holds: the chief's pause lapsed, or was never held."""
        self.shard.require_init()
        if self.paused or self.shard.done:
            return False
        # kind "not_paused": the chief skips this checkpoint
        self.outbox.error(peer, message.rid, "the shard is not paused (pause_at first, within ps.pause_lease_s)",
                          "not_paused")  # fmt: skip
        return True

    def on_state(self, peer: bytes, message: Message, worker: int) -> None:
        """The shard's variables, slots and rule step, for a checkpoint (only while paused)."""
        shard, store = self.shard, self.shard.store
        if self._refuse_unpaused(peer, message):
            return
        failpoint(PS_STATE)
        slots = store.slots()
        fields = {
            **shard.layout(),
            "slots": list(slots),
            "rule_step": store.rule_step,
            "rule": store.rule.to_json() if store.rule else {},
        }
        arrays = [store.snapshot(), *(slot.copy() for slot in slots.values())]
        self.outbox.send(peer, message.rid, "state", fields, arrays)

    def on_table_state(self, peer: bytes, message: Message, worker: int) -> None:
        """One chunk of one table, for a checkpoint (only while paused: the cursor is a slot position)."""
        if self._refuse_unpaused(peer, message):
            return
        store = self.shard.store
        name = message.fields["table"]
        table = store.tables.get(name)
        if table is None:
            raise RefusedError(f"this shard holds no table {name!r} (it holds {sorted(store.tables) or 'none'})")
        fields, arrays = state_chunk(table, message.fields["part"], message.fields["cursor"], message.fields["rows"])
        self.outbox.send(peer, message.rid, "table_state", {**fields, "version": store.version}, arrays)

    def on_resume(self, peer: bytes, message: Message, worker: int) -> None:
        for waiter_peer, waiter_rid in self.pause.end():  # a pause_at still waiting: the chief gave up on it
            self.outbox.error(waiter_peer, waiter_rid, "the chief resumed before the shard reached the version",
                              "failed")  # fmt: skip
        self.outbox.send(peer, message.rid, "ok", {})
        self.release_held()

    def release_held(self) -> None:
        """Apply the pushes the pause held, each on its own: a bug on one must not leave the others unanswered."""
        held, self.pause.pushes = self.pause.pushes, []
        for push in held:
            try:
                self.shard.submit(push)
            except Exception as exc:
                self.outbox.internal_error(push.peer, push.rid, "releasing a held push", exc)
