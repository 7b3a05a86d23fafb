"""The ps task: serves one shard of the variables until the chief ends the job.

One thread runs an event loop over the ROUTER socket, so there are no locks:
a sync barrier is a parked request answered later, never a blocked thread.
The chief configures the job (sync mode, target step, workers, update rule)
when it initialises the store, as TensorFlow's workers built the graph the
ps only served. When the global step reaches the target, every waiting and
later push is answered "done"; plain pulls still work, so the chief can read
the final parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from psdk.consistency import ConsistencyPolicy, Push, make_policy
from psdk.errors import ConfigError, NonFiniteError, ProtocolError
from psdk.jobspec import JobSpec
from psdk.logs import RateLimitedLog
from psdk.numerics import magnitude
from psdk.optim import rule_from_json
from psdk.ps.membership import FINISHED, Membership
from psdk.ps.pause import PauseLease
from psdk.ps.stats import ShardStats
from psdk.security import worker_name
from psdk.shm import AttachedBuffers
from psdk.store import FlatStore, ParameterStore, RestoreState
from psdk.transport import Incoming, ServerEndpoint
from psdk.wire import HEARTBEAT_SUFFIX, MAX_HEADER_BYTES, Message

log = logging.getLogger(__name__)

CHIEF = 0
MAX_WAITS_PER_WORKER = 2
"""Requests one worker may leave waiting for the chief's init (or the chief for a pause): a real one sends one."""
HOUSEKEEPING_S = 0.05
MAX_REPORT_CHARS = 16_384
"""A worker's report at the end, as the ps keeps it for the chief's summary (a real one is ~2 KB)."""
MAX_ERROR_CHARS = 1000
"""An error reply quotes at most this much (a refusal may quote what the peer sent)."""


@dataclass(frozen=True)
class ServerOptions:
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 600.0
    log_every_s: float = 10.0
    poll_s: float = 0.1
    idle_timeout_s: float | None = 60.0  # a chief silent this long has vanished (ps.idle_timeout_s)
    recovery: bool = False  # dead tasks come back (recovery.enabled): wait for them instead of failing
    chief_host: str | None = None  # named in messages about the chief
    max_workers: int = 1024
    """Worker ids a ps accepts, before and after init (a per-task ps: the length of worker_hosts)."""
    pause_lease_s: float = 3.0
    """How long a checkpoint pause outlives the last word from the chief's session (its heartbeats renew it)."""
    max_pushes_in_flight: int = 2
    """Pushes one worker may have waiting for their answer (parked, held) on one shard; a worker waits for
    each reply, so one is the norm and the second covers a push re-sent after a lost reply."""


def _epoch(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"bad epoch {value!r}")
    return value


def process_usage() -> dict[str, float]:
    """CPU seconds and peak memory of this process (all its threads), for benchmarks."""
    times = os.times()
    return {"cpu_s": times.user + times.system, "max_rss_mb": peak_rss_kb() / 1024.0}


def peak_rss_kb() -> int:
    """This process's peak resident memory since it started its program.

    VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss`` across ``exec``,
    so a process spawned (forked, then exec'd) from a large parent reports
    the parent's peak, e.g. a benchmark's client still holding its buffers.
    """
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux


def _restore_state(data: Any, names: list[str], arrays: list[np.ndarray]) -> RestoreState | None:
    """The checkpoint state an init message carries after its variables, if any."""
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


class ParameterServer:
    """Serves one shard over ``endpoint`` until shutdown, abort or a fatal loss."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        task_index: int = 0,
        options: ServerOptions | None = None,
        store: ParameterStore | None = None,
    ):
        self.endpoint = endpoint
        self.task_index = task_index
        self.name = f"ps {task_index}"
        self.options = options or ServerOptions()
        self.store = store or FlatStore()
        self.job: JobSpec | None = None
        self.policy: ConsistencyPolicy | None = None
        self.stats = ShardStats()
        self.membership = Membership(self.options.heartbeat_timeout_s, self.options.startup_timeout_s, time.monotonic())
        self.reports: dict[int, dict[str, Any]] = {}
        self.sessions: dict[int, bytes] = {}
        # A restarted ps has a new boot id; every restore by the chief starts a new epoch, and a
        # push computed in an older epoch is answered "resync" instead of being applied.
        self.boot = secrets.token_hex(4)
        self.epoch = 0
        self._rejections = RateLimitedLog(log)
        self._refusals = RateLimitedLog(log)  # shared memory turned down: the worker goes on over frames
        self._internal_errors = RateLimitedLog(log)
        self._grad_copy = np.zeros(0, np.float32)
        """A gradient in a worker's shared memory is copied here before it is measured (see psdk.store)."""
        self.failure: str | None = None
        self.exit_code: int | None = None
        self._init_waiters: list[tuple[bytes, int, int]] = []  # peer, rid, worker
        # Checkpoints: pushes beyond the paused version wait in _held until the chief resumes.
        self.pause = PauseLease(self.options.pause_lease_s)
        self._held: list[Push] = []
        self._reply_buffers: dict[int, np.ndarray] = {}
        self._shared: dict[int, AttachedBuffers] = {}  # workers on this host: their memory, mapped
        self._last_log = time.monotonic()
        self._next_housekeeping = 0.0
        self._handlers = {
            "ping": self._on_ping,
            "init": self._on_init,
            "wait_init": self._on_wait_init,
            "pull": self._on_pull,
            "push_pull": self._on_push_pull,
            "attach": self._on_attach,
            "finish": self._on_finish,
            "status": self._on_status,
            "stats": self._on_stats,
            "shutdown": self._on_shutdown,
            "abort": self._on_abort,
            "pause_at": self._on_pause_at,
            "state": self._on_state,
            "resume": self._on_resume,
            "stop_at": self._on_stop_at,
            "restore": self._on_restore,
        }

    # ----------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        return self.job is not None and self.store.version >= self.job.steps

    def serve(self, stop: threading.Event | None = None) -> int:
        """Run until the job ends; the exit code says how (0: shut down by the chief)."""
        log.info("%s: serving at %s", self.name, self.endpoint.address)
        try:
            while self.exit_code is None and not (stop and stop.is_set()):
                try:
                    incoming = self.endpoint.receive(self.options.poll_s)
                except Exception as exc:  # the transport itself broke: nothing more can be served
                    log.exception("%s: the transport failed", self.name)
                    self.fail(f"{self.name}'s transport failed: {exc!r}")
                    self.exit_code = 1
                    break
                if incoming is not None:
                    self.handle(incoming)
                    # Dropped before the next receive: a pushed gradient's frame is freed now, not once the
                    # next push (allocated by ZeroMQ's I/O thread meanwhile) has arrived: one model less.
                    incoming = None
                now = time.monotonic()
                if now >= self._next_housekeeping:  # not per message: a busy ps has better things to do
                    self._next_housekeeping = now + HOUSEKEEPING_S
                    self._housekeeping(now)
        finally:
            for worker in list(self._shared):
                self._let_go(worker)
            self.endpoint.close()
        return self.exit_code if self.exit_code is not None else 0

    def handle(self, incoming: Incoming) -> None:
        """Answer one request exactly once (now, or when what it waits for happens), or drop it, counted.

        Nothing a request holds or causes escapes from here: a refusal is an
        error reply, and anything else (a bug) is logged, rate-limited, and
        answered as an internal error, so the serving loop goes on.
        """
        self.stats.requests += 1
        try:
            self._handle(incoming)
        finally:
            self.stats.handled += 1

    def _handle(self, incoming: Incoming) -> None:
        message = incoming.message
        if message is None:
            self.stats.rejected += 1
            self._rejections.warning("%s: rejected a malformed message: %s", self.name, incoming.error)
            if incoming.rid is not None:
                self._error(incoming.peer, incoming.rid, str(incoming.error), "protocol")
            else:
                self.stats.unanswerable += 1
            return
        try:
            handler = self._handlers.get(message.op)
            if handler is None:
                raise ProtocolError(f"unknown op {message.op!r}")
            worker = self._worker_of(message)
            if worker is None:  # nothing at all for a connection that is none of the job's workers
                raise ProtocolError(f"{message.op} needs the id of one of the job's workers")
            if incoming.user is not None and incoming.user != worker_name(worker):
                raise ProtocolError(f"the key of {incoming.user} cannot speak for worker {worker}")
            self._check_session(worker, incoming.peer)
            now = time.monotonic()
            self.membership.seen(worker, now)
            if worker == CHIEF:
                self.pause.renew(incoming.peer.removesuffix(HEARTBEAT_SUFFIX), now)
            handler(incoming.peer, message, worker)
        except ProtocolError as exc:
            self._reject(incoming.peer, message, str(exc))
        except Exception as exc:  # a bug must not take the shard down with it
            self._internal_errors.exception("%s: internal error handling %s", self.name, message.op)
            self._error(incoming.peer, message.rid, f"internal error in {self.name}: {exc!r}", "internal")

    def _housekeeping(self, now: float) -> None:
        for worker, reason in self.membership.check(now):
            self._on_worker_lost(worker, reason)
        if self.pause.lapsed(now):
            self._end_pause(f"nothing heard from the chief's session for {self.pause.lease_s:g} s (ps.pause_lease_s)")
        self._check_chief_idle(now)
        if self.job is None and now - self.membership.started > self.options.startup_timeout_s:
            log.error(
                "%s: no chief initialised the job within %.0f s; exiting (raise "
                "transport.startup_timeout_s to wait longer)",
                self.name,
                self.options.startup_timeout_s,
            )
            self.exit_code = 1
        if now - self._last_log >= self.options.log_every_s and self.job is not None:
            self._last_log = now
            log.info(
                "%s: version %d, applied %d, dropped %d",
                self.name,
                self.store.version,
                self.stats.applied,
                self.stats.dropped,
            )

    def _check_chief_idle(self, now: float) -> None:
        """Exit once the chief has been silent for ``idle_timeout_s``, even after it finished.

        Heartbeat deaths only cover a chief still training: one that finished
        and then vanished without a shutdown would leave this ps running for
        ever, the classic lingering ps of a Kubernetes job. The chief shuts
        the job down only after it wrote its results (final checkpoint,
        summary), so a chief gone before that is a failure too, even once
        training is done: an exit code of 0 would pass a lost result off as
        success.
        """
        limit, silent = self.options.idle_timeout_s, self.membership.silent_for(CHIEF, now)
        if not limit or silent is None or silent <= limit or self.exit_code is not None:
            return
        chief = self._chief_label()
        if self.done and self.membership.status(CHIEF) == FINISHED:
            self.fail(
                f"{chief} finished training, then went silent for {silent:.0f} s (ps.idle_timeout_s={limit:g}) "
                "without shutting the job down: its results (final checkpoint, summary.json) may not have been written"
            )
        else:
            self.fail(f"nothing heard from {chief} for {silent:.0f} s (ps.idle_timeout_s={limit:g}): it has vanished")
        self.exit_code = 1

    def _chief_label(self) -> str:
        host = self.options.chief_host
        return f"the chief (worker 0{f' at {host}' if host else ''})"

    def _on_worker_lost(self, worker: int, reason: str) -> None:
        if worker == CHIEF and not self.options.recovery:
            self.fail(f"{self._chief_label()} is gone: {reason}; stopping this ps")
            self.exit_code = 1
            return
        if worker == CHIEF:
            log.warning("%s: %s is gone (%s); waiting for it to come back", self.name, self._chief_label(), reason)
            self._end_pause(f"{self._chief_label()} is gone")
        log.warning("%s: worker %d is gone: %s", self.name, worker, reason)
        if self.policy is not None:
            for push in self.policy.release_ready():  # bounded staleness: the dead leave the minimum
                self._reply_params(push.peer, push.rid, push.outcome.value, push.worker)
        if self.policy is not None and not self.done:
            blocked = self.policy.blocked_round(self.membership.live())
            if blocked and self.options.recovery:
                log.warning("%s: %s until worker %d comes back", self.name, blocked, worker)
            elif blocked:
                self.fail(f"{blocked}; dead: worker {worker} ({reason})")

    def fail(self, reason: str) -> None:
        """Stop the job: answer every parked request with ``reason`` and refuse new pushes."""
        log.error("%s: %s", self.name, reason)
        self.failure = reason
        if self.policy is not None:
            for push in self.policy.release_parked():
                self._error(push.peer, push.rid, reason, "failed")
        for push in self._held:
            self._error(push.peer, push.rid, reason, "failed")
        for peer, rid, *_ in self._init_waiters + self.pause.waiters:
            self._error(peer, rid, reason, "failed")
        self._init_waiters.clear()
        self.pause.waiters.clear()
        self._held.clear()

    # ------------------------------------------------------------- helpers
    def _worker_of(self, message: Message) -> int | None:
        worker = message.fields.get("worker")
        if worker is None:
            return None
        if not isinstance(worker, int) or isinstance(worker, bool) or worker < 0:
            raise ProtocolError(f"bad worker id {worker!r}")
        if self.job is not None and worker >= self.job.num_workers:
            raise ProtocolError(f"worker {worker} is not in this job ({self.job.num_workers} workers)")
        if worker >= self.options.max_workers:
            raise ProtocolError(f"worker {worker} is beyond the {self.options.max_workers} workers this ps serves")
        return worker

    def _check_session(self, worker: int, peer: bytes) -> None:
        """Bind each worker id to the connection that first used it; refuse it from any other.

        A worker's sockets carry a random routing id (its heartbeat socket
        the same one plus ``/hb``), so a request that claims to come from a
        worker but arrives on another connection, such as a replayed or forged
        one, is refused before it can touch the store. A worker that died may
        come back on a new connection.
        """
        session = peer.removesuffix(HEARTBEAT_SUFFIX)
        known = self.sessions.get(worker)
        if known == session:
            return
        if known is not None and not self.membership.gone(worker, time.monotonic()):
            raise ProtocolError(f"worker {worker} is already connected from another session: not accepted")
        if known is not None:
            log.info("%s: worker %d is back on a new connection", self.name, worker)
            if worker == CHIEF:
                self._end_pause("the chief is back as a new process")
            self.stats.worker(worker).last_seq = -1  # a new process counts its pushes from 1 again
            self._let_go(worker)  # the old process's memory; the new one offers its own
        self.sessions[worker] = session

    def _send(self, peer: bytes, rid: int, op: str, fields: dict[str, Any], arrays: list[Any]) -> None:
        self._deliver(peer, Message(op, fields, arrays, rid))

    def _deliver(self, peer: bytes, message: Message) -> None:
        """The one way a reply leaves (as a message), so every reply is counted, and each request gets one."""
        try:
            self.endpoint.reply(peer, message)
        except ProtocolError as exc:  # too big to send (say, stats of very many workers): say so instead
            self._internal_errors.warning("%s: the %s reply could not be sent: %s", self.name, message.op, exc)
            text = f"{self.name} could not send its {message.op} reply: {exc}"[:MAX_ERROR_CHARS]
            message = Message("error", {"error": text, "kind": "internal"}, [], message.rid)
            self.endpoint.reply(peer, message)
        self.stats.replies[message.op] += 1

    def _error(self, peer: bytes, rid: int, text: str, kind: str = "error") -> None:
        if len(text) > MAX_ERROR_CHARS:
            text = text[:MAX_ERROR_CHARS] + "…"
        self._send(peer, rid, "error", {"error": text, "kind": kind}, [])

    def _reject(self, peer: bytes, message: Message, text: str) -> None:
        self.stats.rejected += 1
        self._rejections.warning("%s: rejected %.64s: %.300s", self.name, message.op, text)
        self._error(peer, message.rid, text, "rejected")

    def _reply_params(self, peer: bytes, rid: int, outcome: str, worker: int) -> None:
        """The parameters, to a worker's session only (a stranger's request never gets this far)."""
        fields: dict[str, Any] = {"version": self.store.version, "done": self.done, "outcome": outcome}
        if self.policy is not None and self.job is not None and not self.job.sync.waits_for_rounds:
            fields["slowest"] = self.policy.slowest()  # lets a worker check the staleness bound
        shared = self._shared.get(worker)
        # Written into the worker's own memory, the reply only a header; never for a request of an earlier
        # process of this worker (a late answer to a dead one's parked push), whose memory is not this one.
        if shared is not None and shared.session == peer.removesuffix(HEARTBEAT_SUFFIX):
            if shared.write_params(self.store.params(), rid, fields):
                self.stats.replies["params"] += 1
                return  # the worker's doorbell rang: no message at all
            fields["shm"] = True
            self._deliver(peer, Message("params", fields, [], rid))
            return
        # Each worker has a reply buffer of its own, sent zero-copy with a frame built once. It is
        # safe to refill on the worker's next request: the worker only sends one once it has this reply.
        buffer = self._reply_buffers.get(worker)
        if buffer is None or buffer.shape != (self.store.size,):
            buffer = self._reply_buffers[worker] = np.empty(self.store.size, np.float32)
        np.copyto(buffer, self.store.params())
        self._deliver(peer, Message("params", fields, [buffer], rid, stable=True))

    def _layout(self) -> dict[str, Any]:
        assert self.job is not None
        return {
            "version": self.store.version,
            "done": self.done,
            "epoch": self.epoch,
            "boot": self.boot,
            "job": self.job.to_json(),
            "names": [s.name for s in self.store.specs],
            "shapes": [list(s.shape) for s in self.store.specs],
        }

    def _require_init(self) -> None:
        if not self.store.initialized or self.job is None:
            raise ProtocolError("the store is not initialised yet (the chief initialises it)")

    # ------------------------------------------------------------ handlers
    def _on_ping(self, peer: bytes, message: Message, worker: int | None) -> None:
        fields = {"version": self.store.version, "done": self.done, "boot": self.boot, "epoch": self.epoch}
        self._send(peer, message.rid, "pong", fields, [])

    def _resync(self, peer: bytes, rid: int, why: str) -> None:
        """Tell a worker to wait for the chief's restore and pull again: a typed reply, not an error."""
        fields = {
            "why": why,
            "initialized": self.store.initialized,
            "epoch": self.epoch,
            "boot": self.boot,
            "version": self.store.version,
        }
        self._send(peer, rid, "resync", fields, [])

    def _on_init(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) initialises the store")
        if self.store.initialized:
            self._send(peer, message.rid, "already", self._layout(), [])
            return
        job = JobSpec.from_json(message.fields.get("job"))
        if job.num_workers > self.options.max_workers:
            raise ProtocolError(
                f"the job has {job.num_workers} workers but this ps serves at most {self.options.max_workers}"
            )
        epoch = _epoch(message.fields.get("epoch", 0))
        try:
            rule = rule_from_json(message.fields.get("rule") or {})
        except (ConfigError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad update rule: {exc}") from None
        names = message.fields.get("names")
        if not isinstance(names, list):
            raise ProtocolError("init needs a list of variable names")
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ProtocolError("variable names must be unique non-empty strings")
        restore = _restore_state(message.fields.get("restore"), names, message.arrays)
        if len(message.arrays) != len(names) * (1 + (len(restore.slots) if restore else 0)):
            raise ProtocolError("init needs one array per variable (and per slot when restoring)")
        self.store.initialize(dict(zip(names, message.arrays, strict=False)), rule, restore)
        self.epoch = epoch
        self.job = job
        largest, push = self.largest_message_bytes(), 4 * self.store.size + MAX_HEADER_BYTES
        self.endpoint.limit_incoming(largest, largest + job.num_workers * push)
        self.policy = make_policy(self.store, job.sync, self.membership.live)
        self.membership.expect(job.num_workers)
        for stray in [w for w in self.sessions if w >= job.num_workers]:  # ids claimed before the job was known
            del self.sessions[stray]
            self.membership.forget(stray)
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
        self._send(peer, message.rid, "ok", self._layout(), [])
        for waiter_peer, rid, _ in self._init_waiters:
            self._send(waiter_peer, rid, "layout", self._layout(), [])
        self._init_waiters.clear()

    def largest_message_bytes(self) -> int:
        """The largest message a peer of this job can legitimately send this shard: the chief's restore.

        It carries every variable and every slot of the shard (a push carries
        the variables' size once), and a header.
        """
        return (1 + len(self.store.slots())) * 4 * self.store.size + MAX_HEADER_BYTES

    def _on_wait_init(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker is None:
            raise ProtocolError("wait_init needs a worker id")
        if self.failure:
            self._error(peer, message.rid, self.failure, "failed")
        elif self.store.initialized:
            self._send(peer, message.rid, "layout", self._layout(), [])
        elif sum(1 for waiter in self._init_waiters if waiter[2] == worker) >= MAX_WAITS_PER_WORKER:
            raise ProtocolError(f"worker {worker} already waits for the chief {MAX_WAITS_PER_WORKER} times")
        else:
            self._init_waiters.append((peer, message.rid, worker))

    def _on_pull(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker is None:  # parameters go to the job's workers only (and cost a stranger nothing to ask)
            raise ProtocolError("pull needs a worker id")
        if not self.store.initialized and self.options.recovery:
            self._resync(peer, message.rid, f"{self.name} has restarted and waits for the chief to restore it")
            return
        self._require_init()
        self._reply_params(peer, message.rid, "pulled", worker)

    def _on_attach(self, peer: bytes, message: Message, worker: int | None) -> None:
        """Map a worker's shared memory (see :mod:`psdk.shm`); a refusal leaves it on ZeroMQ frames."""
        if worker is None:
            raise ProtocolError("attach needs a worker id")
        self._require_init()
        self._let_go(worker)
        try:
            if not self.endpoint.shares_memory:
                raise ProtocolError(f"{self.name} does not take shared memory (transport.shared_memory=false)")
            shared = AttachedBuffers(message.fields, self.store.size, pipes=self.endpoint.knocks)
        except Exception as exc:  # not an attack on the store (nor a reason to fail): the worker goes on with frames
            self._refusals.info("%s: worker %d stays on ZeroMQ frames: %.300s", self.name, worker, exc)
            self._send(peer, message.rid, "refused", {"error": str(exc)}, [])
            return
        shared.session = peer.removesuffix(HEARTBEAT_SUFFIX)
        self._shared[worker] = shared
        knock = shared.knock >= 0 and self.endpoint.knocks
        if knock:
            self.endpoint.listen(shared.knock, lambda: self._knocked(worker, shared))
        self._send(peer, message.rid, "attached", {"bell": shared.bell >= 0, "knock": knock}, [])

    def _knocked(self, worker: int, shared: AttachedBuffers) -> Incoming | None:
        """A knock, as the ``push_pull`` message it stands for, from the session that attached."""
        try:
            taken = shared.take_knock()
        except Exception:  # a bug here must not end the serving loop, which called this outside handle()
            self._internal_errors.exception("%s: internal error reading worker %d's knock", self.name, worker)
            shared.hung_up = True
            taken = None
        if shared.hung_up:  # the worker closed its buffers or is gone (membership notices that on its own)
            if self._shared.get(worker) is shared:
                self._let_go(worker)
            else:
                self.endpoint.unlisten(shared.knock)
                shared.close()
            return None
        if taken is None:
            return None
        rid, fields = taken
        return Incoming(shared.session, Message("push_pull", {"worker": worker, **fields}, [], rid))

    def _let_go(self, worker: int) -> None:
        shared = self._shared.pop(worker, None)
        if shared is not None:
            if shared.knock >= 0:
                self.endpoint.unlisten(shared.knock)
            shared.close()

    def _on_push_pull(self, peer: bytes, message: Message, worker: int | None) -> None:
        if not self.store.initialized and worker is not None and self.options.recovery:
            self._resync(peer, message.rid, f"{self.name} has restarted and waits for the chief to restore it")
            return
        self._require_init()
        assert self.job is not None and self.policy is not None
        if worker is None:
            raise ProtocolError("push_pull needs a worker id")
        version, seq = message.fields.get("version"), message.fields.get("seq")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ProtocolError(f"bad version {version!r}")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ProtocolError(f"bad sequence number {seq!r}")
        slot = message.fields.get("shm")
        if len(message.arrays) != (0 if slot is not None else 1):
            raise ProtocolError("push_pull carries exactly one flat gradient (in a frame or in shared memory)")
        if message.fields.get("epoch", 0) != self.epoch:  # computed before the chief's last restore
            self._resync(peer, message.rid, f"the chief restored the job (epoch {self.epoch}); pull again")
            return
        stable = True  # a frame is this process's own memory: nobody changes it under the apply
        if slot is None:
            grad = message.arrays[0]
            # A worker pushing in frames is not reading its shared memory (e.g. another shard refused its
            # offer and it gave up sharing altogether): answer it in frames too, never through its doorbell.
            self._let_go(worker)
        elif worker in self._shared:
            grad = self._shared[worker].gradient(slot)
            stable = not self.store.needs_stable_gradient()
            if not stable:  # the worker can rewrite its memory during the apply: check and apply a copy
                if self._grad_copy.shape != grad.shape:
                    self._grad_copy = np.empty(grad.shape, np.float32)
                np.copyto(self._grad_copy, grad)
                grad, stable = self._grad_copy, True
        else:
            raise ProtocolError(f"worker {worker} pushed through shared memory it has not offered to {self.name}")
        if grad.dtype != np.float32 or grad.shape != (self.store.size,):
            raise ProtocolError(f"gradient is {grad.dtype}{list(grad.shape)}, expected float32[{self.store.size}]")
        if version > self.store.version:
            raise ProtocolError(f"gradient computed from version {version}, but this shard is at {self.store.version}")
        counters = self.stats.worker(worker)
        if seq <= counters.last_seq:
            raise ProtocolError(f"duplicate push (seq {seq}) from worker {worker}: not applied")
        waiting = self._pushes_waiting(worker)
        if waiting >= self.options.max_pushes_in_flight:
            raise ProtocolError(
                f"worker {worker} already has {waiting} pushes waiting for their answer on {self.name} "
                f"(at most {self.options.max_pushes_in_flight}): not applied"
            )
        bound = magnitude(grad)
        if not math.isfinite(bound):
            counters.last_seq = seq
            counters.refused += 1
            self.stats.refused += 1
            raise ProtocolError(f"gradient from worker {worker} holds NaN or Inf: not applied")
        counters.last_seq = seq
        if self.failure:
            self._error(peer, message.rid, self.failure, "failed")
            return
        self._submit(peer, message.rid, worker, version, grad, bound if stable else None)

    def _pushes_waiting(self, worker: int) -> int:
        """This worker's pushes not answered yet (parked by the mode, held by a pause), from its current process."""
        assert self.policy is not None
        session = self.sessions.get(worker)
        return sum(
            1
            for push in [*self.policy.parked(), *self._held]
            if push.worker == worker and push.peer.removesuffix(HEARTBEAT_SUFFIX) == session
        )

    def _submit(self, peer: bytes, rid: int, worker: int, version: int, grad: np.ndarray, bound: float | None) -> None:
        """Hand a checked push to the consistency policy (or hold it while paused)."""
        assert self.policy is not None
        if self.done:
            self._reply_params(peer, rid, "done", worker)
            return
        if self._paused():  # a copy: a gradient in a worker's shared memory is only lent until the reply
            self._held.append(Push(peer, rid, worker, version, grad.copy(), bound=bound))
            return
        counters = self.stats.worker(worker)
        counters.pushed += 1
        try:
            decision = self.policy.submit(Push(peer, rid, worker, version, grad, bound=bound))
        except NonFiniteError as exc:  # nothing changed: the worker is told, and counted
            counters.refused += 1
            self.stats.refused += 1
            self._reject(peer, Message("push_pull", {}, [], rid), f"worker {worker}: {exc}")
            return
        if decision.updates:
            now = time.time()
            if self.stats.first_update is None:
                self.stats.first_update = now
            self.stats.last_update = now
            self.stats.updates += decision.updates
            self.stats.applied += len(decision.applied_workers)
        for push in decision.refused:
            self.stats.worker(push.worker).refused += 1
        if decision.refused:
            self.stats.refused += 1
            self._rejections.warning("%s: the mean of a sync round would be non-finite: dropped", self.name)
        for push in decision.answer:
            c = self.stats.worker(push.worker)
            if push.outcome.value == "applied":
                c.applied += 1
                c.record_staleness(push.staleness)
            elif not any(push is refused for refused in decision.refused):
                c.dropped += 1
                self.stats.dropped += 1
            self._reply_params(push.peer, push.rid, push.outcome.value, push.worker)
        if self.done:
            for push in self.policy.release_parked():
                self._reply_params(push.peer, push.rid, "done", push.worker)
        if decision.updates and self._paused():
            for waiter_peer, waiter_rid in self.pause.waiters:
                self._send(waiter_peer, waiter_rid, "paused", {"version": self.store.version}, [])
            self.pause.waiters.clear()

    # ---------------------------------------------------------- checkpoints
    def _paused(self) -> bool:
        return self.pause.covers(self.store.version)

    def _on_pause_at(self, peer: bytes, message: Message, worker: int | None) -> None:
        """Stop applying pushes once this shard reaches ``version``; answer when it has.

        The pause is the chief session's lease (:mod:`psdk.ps.pause`): it ends
        by itself when that session goes silent.
        """
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) pauses the store")
        self._require_init()
        target = message.fields.get("version")
        if not isinstance(target, int) or isinstance(target, bool) or target < 0:
            raise ProtocolError(f"bad pause version {target!r}")
        if self.store.version > target or (self.done and self.store.version < target):
            self._send(peer, message.rid, "passed", {"version": self.store.version}, [])
            return
        self.pause.hold(target, peer.removesuffix(HEARTBEAT_SUFFIX), time.monotonic())
        if self._paused():
            self._send(peer, message.rid, "paused", {"version": self.store.version}, [])
            return
        if len(self.pause.waiters) >= MAX_WAITS_PER_WORKER:
            raise ProtocolError(f"{MAX_WAITS_PER_WORKER} pauses already wait for version {self.pause.version}")
        self.pause.waiters.append((peer, message.rid))
        self._release_held()

    def _end_pause(self, why: str) -> None:
        """The chief's pause ends without its resume (see :mod:`psdk.ps.pause`): the shard goes on."""
        if not self.pause.held:
            return
        log.warning("%s: %s; the checkpoint pause at version %s ends, training goes on", self.name, why,
                    self.pause.version)  # fmt: skip
        for peer, rid in self.pause.end():
            self._error(peer, rid, f"the checkpoint pause ended: {why}", "not_paused")
        self._release_held()

    def _on_state(self, peer: bytes, message: Message, worker: int | None) -> None:
        """The shard's variables, slots and rule step, for a checkpoint (only while paused)."""
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) reads the state")
        self._require_init()
        if not self._paused() and not self.done:
            # kind "not_paused": the chief's pause lapsed (or was never held); it skips this checkpoint
            self._error(peer, message.rid, "the shard is not paused (pause_at first, within ps.pause_lease_s)",
                        "not_paused")  # fmt: skip
            return
        slots = self.store.slots()
        fields = {
            **self._layout(),
            "slots": list(slots),
            "rule_step": self.store.rule_step,
            "rule": self.store.rule.to_json() if self.store.rule else {},
        }
        arrays = [self.store.snapshot(), *(slot.copy() for slot in slots.values())]
        self._send(peer, message.rid, "state", fields, arrays)

    def _on_resume(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) resumes the store")
        for waiter_peer, waiter_rid in self.pause.end():  # a pause_at still waiting: the chief gave up on it
            self._error(waiter_peer, waiter_rid, "the chief resumed before the shard reached the version", "failed")
        self._send(peer, message.rid, "ok", {}, [])
        self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for push in held:  # each on its own: a bug on one must not leave the others unanswered
            try:
                self._submit(push.peer, push.rid, push.worker, push.version, push.grad, push.bound)
            except Exception as exc:
                self._internal_errors.exception("%s: internal error releasing a held push", self.name)
                self._error(push.peer, push.rid, f"internal error in {self.name}: {exc!r}", "internal")

    def _on_finish(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker is None:
            raise ProtocolError("finish needs a worker id")
        self.membership.finish(worker)
        self._let_go(worker)  # its last pulls are answered in frames; its memory is let go
        report = message.fields.get("report")
        if isinstance(report, dict):  # kept for the chief's summary: one small report per worker
            size = len(json.dumps(report))
            self.reports[worker] = report if size <= MAX_REPORT_CHARS else {"report_too_large": size}
        self._send(peer, message.rid, "ok", {}, [])
        if self.policy is not None and not self.done:
            blocked = self.policy.blocked_round(self.membership.live())
            if blocked:
                self.fail(f"{blocked}; worker {worker} finished early")

    def _on_status(self, peer: bytes, message: Message, worker: int | None) -> None:
        fields = {
            "version": self.store.version,
            "done": self.done,
            "initialized": self.store.initialized,
            "epoch": self.epoch,
            "boot": self.boot,
            "failure": self.failure,
            "workers": self.membership.summary(),
        }
        self._send(peer, message.rid, "status", fields, [])

    def _on_stats(self, peer: bytes, message: Message, worker: int | None) -> None:
        fields = {
            "task": self.task_index,
            "version": self.store.version,
            "size": self.store.size,
            "variables": [s.name for s in self.store.specs],
            "stats": self.stats.to_json(),
            "workers": self.membership.summary(),
            "reports": {str(k): v for k, v in self.reports.items()},
            "job": self.job.to_json() if self.job else None,
            "process": process_usage(),
        }
        self._send(peer, message.rid, "stats", fields, [])

    def _on_stop_at(self, peer: bytes, message: Message, worker: int | None) -> None:
        """The chief ends training early: the job is done once this shard reaches ``version``."""
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) stops the job")
        self._require_init()
        assert self.job is not None and self.policy is not None
        target = message.fields.get("version")
        if not isinstance(target, int) or isinstance(target, bool) or target < 0:
            raise ProtocolError(f"bad stop version {target!r}")
        self.job = dataclasses.replace(self.job, steps=min(self.job.steps, max(target, self.store.version)))
        self._send(peer, message.rid, "ok", {"steps": self.job.steps}, [])
        if self.done:
            for push in self.policy.release_parked():
                self._reply_params(push.peer, push.rid, "done", push.worker)

    def _on_restore(self, peer: bytes, message: Message, worker: int | None) -> None:
        """The chief rolls this shard back to a checkpoint after another shard was lost.

        Every push waiting here (a sync round, a pause, bounded staleness) is
        answered "resync": its gradient belongs to the abandoned timeline.
        """
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) restores the store")
        self._require_init()
        assert self.job is not None and self.policy is not None
        names = [s.name for s in self.store.specs]
        if message.fields.get("names") != names:
            raise ProtocolError(f"restore must name this shard's variables {names}")
        restore = _restore_state(message.fields.get("restore"), names, message.arrays)
        if restore is None:
            raise ProtocolError("restore needs the checkpoint's state")
        epoch = _epoch(message.fields.get("epoch"))  # checked before anything changes
        self.store.reset(dict(zip(names, message.arrays, strict=False)), restore)
        self.epoch = epoch
        why = f"the chief restored the job at version {restore.version} (epoch {self.epoch})"
        stale = [(p.peer, p.rid) for p in [*self.policy.release_parked(), *self._held]]
        self._held.clear()
        stale += self.pause.end()
        self.policy = make_policy(self.store, self.job.sync, self.membership.live)
        log.warning("%s: %s", self.name, why)
        self._send(peer, message.rid, "ok", self._layout(), [])
        for stale_peer, rid in stale:
            self._resync(stale_peer, rid, why)

    def _on_shutdown(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) shuts the job down")
        log.info("%s: shut down by the chief at version %d", self.name, self.store.version)
        self._send(peer, message.rid, "ok", {}, [])
        self.exit_code = 0

    def _on_abort(self, peer: bytes, message: Message, worker: int | None) -> None:
        if worker != CHIEF:
            raise ProtocolError("only the chief (worker 0) aborts the job")
        reason = str(message.fields.get("reason", "no reason given"))
        self._send(peer, message.rid, "ok", {}, [])
        self.fail(f"the chief aborted the job: {reason}")
        self.exit_code = 1
