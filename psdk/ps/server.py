"""The ps task: serves one shard of the variables until the chief ends the job.

One thread runs an event loop over the transport, so there are no locks: a
sync barrier is a parked request answered later, never a blocked thread.
:class:`ParameterServer` is the dispatcher: it checks each request against
the protocol (:mod:`psdk.protocol`) and the worker's session, then hands it
to the part that owns it:

* :mod:`psdk.ps.sessions`: which connection speaks for each worker, who is alive;
* :mod:`psdk.ps.shard`: the variables and the job (init, pull, push_pull, stop_at);
* :mod:`psdk.ps.checkpoints`: the chief's pause, state and resume;
* :mod:`psdk.ps.restore`: the chief's restore after a lost shard;

and every reply leaves through one :class:`~psdk.ps.outbox.Outbox`.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from psdk.config.options import TransportOptions
from psdk.errors import ProtocolError, RefusedError
from psdk.protocol import ops as protocol
from psdk.protocol.jobspec import JobSpec
from psdk.ps import restore
from psdk.ps.checkpoints import Checkpoints
from psdk.ps.consistency import ConsistencyPolicy
from psdk.ps.membership import FINISHED, Membership
from psdk.ps.outbox import Outbox
from psdk.ps.pause import PauseLease
from psdk.ps.sessions import Sessions, session_of
from psdk.ps.shard import ServedShard
from psdk.ps.stats import ShardStats
from psdk.ps.store import FlatStore, ParameterStore
from psdk.runtime.failpoints import PS_SERVE, PS_WRAP_UP, failpoint
from psdk.runtime.liveness import beat
from psdk.runtime.waits import WaitLog, seconds
from psdk.transport import Incoming, ServerEndpoint, worker_name
from psdk.transport.wire import Message

log = logging.getLogger(__name__)

CHIEF = protocol.CHIEF
HOUSEKEEPING_S = 0.05


@dataclass(frozen=True)
class ServerOptions:
    """A ps's serving settings; its heartbeat and start-up limits are the ``transport.*`` group, held as it is."""

    transport: TransportOptions = field(default_factory=TransportOptions)
    """``heartbeat_timeout_s``: a worker silent this long is dead; ``startup_timeout_s``: how long the ps waits
    for the job's workers to join."""
    log_every_s: float = 10.0
    poll_s: float = 0.1
    idle_timeout_s: float | None = 60.0  # a chief silent this long has vanished (ps.idle_timeout_s)
    recovery: bool = False  # dead tasks come back (recovery.enabled): wait for them instead of failing
    recovery_timeout_s: float = 120.0
    """With recovery, how long a sync round may wait for workers that left (dead, or finished early) to come
    back before the job fails naming them (recovery.timeout_s)."""
    chief_host: str | None = None  # named in messages about the chief
    max_workers: int = 1024
    """Worker ids a ps accepts, before and after init (a per-task ps: the length of worker_hosts)."""
    pause_lease_s: float = 3.0
    """How long a checkpoint pause outlives the last word from the chief's session (its heartbeats renew it)."""
    max_pushes_in_flight: int = 2
    """Pushes one worker may have waiting for their answer (parked, held) on one shard; a worker waits for
    each reply, so one is the norm and the second covers a push re-sent after a lost reply."""


def process_usage() -> dict[str, float]:
    """CPU seconds and peak memory of this process (all its threads), for benchmarks.

    ``time.process_time``, not ``os.times``: the latter counts in clock ticks
    (10 ms), coarser than a benchmark's whole run of small round trips.
    """
    return {"cpu_s": time.process_time(), "max_rss_mb": peak_rss_kb() / 1024.0}


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
        self.stats = ShardStats()
        self.outbox = Outbox(endpoint, self.stats, self.name)
        transport = self.options.transport
        membership = Membership(transport.heartbeat_timeout_s, transport.startup_timeout_s, time.monotonic())
        self.sessions = Sessions(self.name, membership, self.options.max_workers, endpoint.connected)
        self.pause = PauseLease(self.options.pause_lease_s)
        self.shard = ServedShard(
            self.name,
            self.store,
            endpoint,
            self.outbox,
            self.stats,
            self.sessions,
            self.pause,
            recovery=self.options.recovery,
            max_pushes_in_flight=self.options.max_pushes_in_flight,
            index=task_index,
        )
        self.checkpoints = Checkpoints(self.shard)
        self.exit_code: int | None = None
        self._blocked_since: float | None = None
        """When a sync round became unable to fill (workers left); ``None`` while it can."""
        self._last_log = time.monotonic()
        self._startup_wait = WaitLog()
        self._next_housekeeping = 0.0
        shard, checkpoints = self.shard, self.checkpoints
        self._handlers: dict[str, Callable[[bytes, Message, int], None]] = {
            "ping": self._on_ping,
            "init": shard.on_init,
            "wait_init": shard.on_wait_init,
            "pull": shard.on_pull,
            "push_pull": shard.on_push_pull,
            "finish": self._on_finish,
            "status": self._on_status,
            "stats": self._on_stats,
            "shutdown": self._on_shutdown,
            "abort": self._on_abort,
            "pause_at": checkpoints.on_pause_at,
            "state": checkpoints.on_state,
            "resume": checkpoints.on_resume,
            "stop_at": shard.on_stop_at,
            "restore": lambda peer, message, worker: restore.on_restore(shard, peer, message),
            "table_state": checkpoints.on_table_state,
            "table_restore": lambda peer, message, worker: restore.on_table_restore(shard, peer, message),
        }
        assert self._handlers.keys() == protocol.OPS.keys(), "every declared op has one handler"

    # The shard's state, as tests, benchmarks and the fuzzer read it.
    @property
    def membership(self) -> Membership:
        return self.sessions.membership

    @property
    def job(self) -> JobSpec | None:
        return self.shard.job

    @property
    def policy(self) -> ConsistencyPolicy | None:
        return self.shard.policy

    @property
    def epoch(self) -> int:
        return self.shard.epoch

    @property
    def failure(self) -> str | None:
        return self.shard.failure

    @property
    def done(self) -> bool:
        return self.shard.done

    def parked(self) -> int:
        """Requests waiting for their answer: for the chief's init, a pause, a sync round or a staleness bound."""
        policy = len(self.policy.parked()) if self.policy is not None else 0
        return len(self.shard.init_waiters) + len(self.pause.waiters) + len(self.pause.pushes) + policy

    # ----------------------------------------------------------------- loop
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
                beat()  # the launcher takes a ps whose loop stops turning for hung (psdk.runtime.liveness)
                failpoint(PS_SERVE)
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
            self.outbox.rejections.warning("%s: rejected a malformed message: %s", self.name, incoming.error)
            if incoming.rid is not None:
                self.outbox.error(incoming.peer, incoming.rid, str(incoming.error), "protocol")
            else:
                self.stats.unanswerable += 1
            return
        try:
            op, worker = protocol.sender_of(message)
            self.sessions.check_id(worker, self.job.num_workers if self.job is not None else None)
            if incoming.user is not None and incoming.user != worker_name(worker):
                raise RefusedError(f"the key of {incoming.user} cannot speak for worker {worker}")
            now = time.monotonic()
            replaced = self.sessions.bind(worker, incoming.peer, now)
            if replaced is not None:
                self._forget_old_process(worker, replaced)
            self.membership.seen(worker, now)
            if worker == CHIEF:
                self.pause.renew(session_of(incoming.peer), now)
            protocol.admit(op, worker, message.fields)
            self._handlers[op.name](incoming.peer, message, worker)
        except ProtocolError as exc:  # decoded, but not a request of the protocol
            self.outbox.reject(incoming.peer, message.op, message.rid, str(exc))
        except RefusedError as exc:  # a request the shard will not carry out; its kind tells the worker which
            self.outbox.reject(incoming.peer, message.op, message.rid, str(exc), exc.kind)
        except Exception as exc:  # a bug must not take the shard down with it
            self.outbox.internal_error(incoming.peer, message.rid, f"handling {message.op[:64]}", exc)

    def _forget_old_process(self, worker: int, old: bytes) -> None:
        """A worker that died is back as a new process: what belonged to the old one goes."""
        if worker == CHIEF:
            self.checkpoints.end_pause("the chief is back as a new process")
        if not self.done:  # a worker that left early and is started again trains again
            self.membership.rejoin(worker)
        self.stats.worker(worker).last_seq = -1  # a new process counts its pushes from 1 again
        self.shard.named_pulls.forget(worker)  # the old process's pulls: no push of the new one names them
        self.endpoint.forget(old)  # what the old process lent the transport; the new one lends its own

    def _housekeeping(self, now: float) -> None:
        for worker, reason in self.membership.check(now):
            self._on_worker_lost(worker, reason)
        if self.pause.lapsed(now):
            self.checkpoints.end_pause(
                f"nothing heard from the chief's session for {self.pause.lease_s:g} s (ps.pause_lease_s)"
            )
        self._check_chief_idle(now)
        self._check_blocked_round(now)
        if self.job is None and (waited := self._startup_wait.due(now - self.membership.started)) is not None:
            self._waiting_for_the_chief(waited)
        if self.job is None and now - self.membership.started > self.options.transport.startup_timeout_s:
            log.error(
                "%s: no chief initialised the job within %.0f s; exiting (raise "
                "transport.startup_timeout_s to wait longer)",
                self.name,
                self.options.transport.startup_timeout_s,
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

    def _waiting_for_the_chief(self, waited_s: float) -> None:
        """Before the job starts: what this ps waits for, how long of how long, and who has reached it."""
        here = sorted(i for i, state in self.membership.workers.items() if state.status == "alive")
        log.info(
            "%s: waiting at %s for the chief (worker 0) to initialise the variables: %s of %s "
            "(transport.startup_timeout_s); %s",
            self.name,
            self.endpoint.address,
            seconds(waited_s),
            seconds(self.options.transport.startup_timeout_s),
            f"connected: {', '.join(f'worker {i}' for i in here)}" if here else "no worker has connected yet",
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
            self.checkpoints.end_pause(f"{self._chief_label()} is gone")
        log.warning("%s: worker %d is gone: %s", self.name, worker, reason)
        self._on_worker_left(worker, time.monotonic())

    def _on_worker_left(self, worker: int, now: float) -> None:
        """A worker stopped pushing (dead, or finished early): the rounds and the staleness bound go on without it.

        Backup workers cover it in a sync round. A round that can no longer
        fill fails the job at once without recovery, and with recovery once
        the worker has stayed away ``recovery.timeout_s`` (housekeeping).
        """
        if self.policy is None:
            return
        for push in self.policy.release_ready():  # bounded staleness: those who left leave the minimum
            self.shard.reply_params(push.peer, push.rid, push.outcome.value, push.worker, push.tables.pulls)
        if self.done:
            return
        blocked = self.policy.blocked_round(self.membership.live())
        if blocked is None:
            return
        if not self.options.recovery:
            self.fail(f"{blocked}; {self.membership.departed()}")
            return
        log.warning(
            "%s: %s; waiting up to %.0f s (recovery.timeout_s) for worker %d to come back",
            self.name,
            blocked,
            self.options.recovery_timeout_s,
            worker,
        )
        if self._blocked_since is None:
            self._blocked_since = now

    def _check_blocked_round(self, now: float) -> None:
        """Fail the job once a round has waited ``recovery.timeout_s`` for workers that left; or forget the wait."""
        if self._blocked_since is None or self.policy is None or self.failure:
            return
        blocked = None if self.done else self.policy.blocked_round(self.membership.live())
        if blocked is None:
            self._blocked_since = None
        elif now - self._blocked_since > self.options.recovery_timeout_s:
            waited = now - self._blocked_since
            self.fail(
                f"{blocked}; {self.membership.departed()}, and none came back in {waited:.0f} s "
                f"(recovery.timeout_s={self.options.recovery_timeout_s:g})"
            )

    def fail(self, reason: str) -> None:
        """Stop the job: answer every waiting request with ``reason`` and refuse new pushes."""
        log.error("%s: %s", self.name, reason)
        self.shard.fail(reason)

    # --------------------------------------------------- queries, the end
    def _on_ping(self, peer: bytes, message: Message, worker: int) -> None:
        fields = {"version": self.store.version, "done": self.done, "boot": self.shard.boot, "epoch": self.epoch}
        self.outbox.send(peer, message.rid, "pong", fields)

    def _on_finish(self, peer: bytes, message: Message, worker: int) -> None:
        if worker == CHIEF and self.done:
            failpoint(PS_WRAP_UP)
        # A shard that holds no variable (more ps tasks than variables) gets no pushes: nobody leaves it early.
        early = bool(self.store.size) and not self.done and self.membership.status(worker) != FINISHED
        reason = f"at version {self.store.version}, before the job's end" if early else ""
        stays = message.fields.get("stays") is True
        self.membership.finish(worker, reason, message.fields.get("report"), stays=stays)  # for the chief's summary
        self.endpoint.forget(peer)  # its last pulls are answered in frames; what it lent is let go
        self.outbox.send(peer, message.rid, "ok", {}, [])
        if early:  # as if it had left: only the chief's shutdown or abort ends the job
            log.warning("%s: worker %d finished at version %d, before the job's end", self.name, worker,
                        self.store.version)  # fmt: skip
            self._on_worker_left(worker, time.monotonic())

    def _on_status(self, peer: bytes, message: Message, worker: int) -> None:
        if worker != CHIEF:
            self.membership.acknowledge(worker)  # if its report was collected, this answer tells it: it may go
        fields = {
            "version": self.store.version,
            "done": self.done,
            "initialized": self.store.initialized,
            "restoring": sorted(self.shard.table_restores),
            "epoch": self.epoch,
            "boot": self.shard.boot,
            "failure": self.failure,
            "workers": self.membership.summary(),
            "collected": self.membership.collected(),
            "leaving": self.membership.leaving(time.monotonic()),
        }
        if message.fields.get("reports"):  # the chief collects the finished workers' reports
            if worker != CHIEF:
                raise RefusedError("only the chief (worker 0) collects the workers' reports")
            fields["reports"] = {str(i): report for i, report in self.membership.collect().items()}
        self.outbox.send(peer, message.rid, "status", fields, [])

    def _on_stats(self, peer: bytes, message: Message, worker: int) -> None:
        fields = {
            "task": self.task_index,
            "version": self.store.version,
            "size": self.store.size,
            "variables": [s.name for s in self.store.specs],
            "stats": self.stats.to_json(),
            "workers": self.membership.summary(),
            "reports": {str(k): v for k, v in self.membership.reports().items()},
            "job": self.job.to_json() if self.job else None,
            "process": process_usage(),
            "tables": {name: table.stats() for name, table in self.store.tables.items()},
            "time_per_push": self.shard.time_per_push(),
        }
        self.outbox.send(peer, message.rid, "stats", fields, [])

    def _on_shutdown(self, peer: bytes, message: Message, worker: int) -> None:
        log.info("%s: shut down by the chief at version %d", self.name, self.store.version)
        self.outbox.send(peer, message.rid, "ok", {}, [])
        self.exit_code = 0

    def _on_abort(self, peer: bytes, message: Message, worker: int) -> None:
        reason = str(message.fields.get("reason", "no reason given"))
        self.outbox.send(peer, message.rid, "ok", {}, [])
        self.fail(f"the chief aborted the job: {reason}")
        self.exit_code = 1
