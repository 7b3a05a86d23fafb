"""The fuzzers' harness: a live ps on a thread, connections to it, and the books of what was sent and answered.

Both fuzzers that hold sessions use it: the state machine
(:mod:`psdk.fuzz.stateful`) and the intruder beside a real job
(:mod:`psdk.fuzz.alongside`). The ps is a thread of this process
rather than a subprocess so that the fuzzer can read its counters, its
store and its log after every step and compare them with its own record;
it still serves TCP on 127.0.0.1 (with CURVE and shared memory when
asked), so every request goes through the transport a deployed ps uses.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from psdk.config.options import TransportOptions
from psdk.protocol import ops as protocol
from psdk.protocol.numerics import all_finite
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport import security, shm
from psdk.transport.compact import Packer, Unpacker
from psdk.transport.lending import ATTACH, ATTACHED, PROBE, REFUSED, UNLENT
from psdk.transport.security import CurveKeys
from psdk.transport.wire import MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES, MalformedMessage, Message, decode, encode
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

WORKERS = 3
SIZE = 24
SETTLE_S = 10.0
# What the ps may answer comes from the protocol's declaration.
REPLY_OPS = frozenset(protocol.REPLIES)
ERROR_KINDS = frozenset(protocol.ERROR_KINDS)
ENDINGS: dict[str, tuple[int, str]] = {
    "shutdown": (0, "shut down by the chief"),
    "abort": (1, "the chief aborted the job"),
}
"""The chief's requests that end the ps: the exit code it must end with, and what it must log."""
assert set(ENDINGS) <= set(protocol.CHIEF_ONLY), "an ending the protocol does not declare"


@dataclass(frozen=True)
class Mode:
    """Which transport the fuzzed ps serves over."""

    curve: bool = False
    shared_memory: bool = True

    @property
    def label(self) -> str:
        return f"{'curve' if self.curve else 'plain'}, {'shared memory' if self.shared_memory else 'frames'}"


@dataclass
class Sent:
    op: str
    must_fail: bool = False
    """The protocol must refuse it: its reply has to be an error."""


@dataclass
class Books:
    """The fuzzer's side of the accounting, over one sequence."""

    requests: int = 0
    answerable: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


class LogTap(logging.Handler):
    """Keeps the ps's log records (its exit reason is checked against them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def said(self, fragment: str) -> bool:
        return any(fragment in record.getMessage() for record in self.records)


class LivePs:
    """One ps as a thread serving TCP on 127.0.0.1, with CURVE keys when asked; how its serve() ended."""

    def __init__(self, mode: Mode, keys_dir: Path | None):
        self.keys_dir = keys_dir
        curve = security.load_server(keys_dir) if keys_dir is not None else None
        settings = TransportOptions(  # one transport.* group for the sockets and the server, as a ps task has
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=60.0,
            startup_timeout_s=600.0,
            shared_memory=mode.shared_memory,
            max_message_bytes=8 << 20,
        )
        self.transport = ZmqTransport(ZmqOptions(settings, curve=curve))
        endpoint = self.transport.serve("127.0.0.1:0", "ps 0")
        self.address = endpoint.address
        server_options = ServerOptions(
            transport=settings,
            poll_s=0.01,
            idle_timeout_s=None,
            max_workers=WORKERS,
            pause_lease_s=3600.0,
        )
        self.server = ParameterServer(endpoint, 0, server_options)
        self.crashed: BaseException | None = None
        self.exit_code: int | None = None
        self.tap = LogTap()
        self._logger = logging.getLogger("psdk.ps.server")
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)  # its exit reason is an INFO record
        self._logger.addHandler(self.tap)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fuzzed-ps", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.exit_code = self.server.serve(self._stop)
        except BaseException as exc:  # the fuzzer reports it: a ps must never end this way
            self.crashed = exc

    @property
    def serving(self) -> bool:
        return self.thread.is_alive() and self.server.exit_code is None

    def parked(self) -> int:
        """Requests the ps holds for a later answer (read while it is idle)."""
        return self.server.parked()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self._logger.removeHandler(self.tap)
        self._logger.setLevel(self._level)
        self.transport.close()


class Actor:
    """A connection to the ps: one worker's (its routing id, and CURVE key) or a stranger's, and its memory."""

    def __init__(self, context: zmq.Context[Any], address: str, worker: int | None, keys: CurveKeys | None):
        self.worker = worker
        self.sock = context.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTING_ID, f"fuzz-{worker}-{id(self)}".encode())
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.public, keys.secret
            self.sock.curve_serverkey = keys.servers[0]
        self.sock.connect(address)
        self.buffers: shm.WorkerBuffers | None = None
        self.attached = False
        self.rung = False
        self.knocks = False
        self.next_rid = 1
        self.next_seq = 1
        self.packer, self.unpacker = Packer(MAX_HEADER_BYTES), Unpacker(MAX_REPLY_HEADER_BYTES)
        self.last_rung = 0
        """The request whose reply was last read from memory: a late ring may find its header again, as a
        worker that asks again before reading can have a reply overwritten (the real client drops the repeat)."""
        self.outstanding: dict[int, Sent] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def rid(self) -> int:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        return rid

    def fields(self, **extra: Any) -> dict[str, Any]:
        return {"worker": self.worker, **extra} if self.worker is not None else dict(extra)

    def offer_memory(self, size: int = SIZE) -> dict[str, Any]:
        self.release()
        self.buffers = shm.WorkerBuffers(size)
        return self.buffers.offer(bell=True)

    def lent_push(self, rid: int, **fields: Any) -> Message:
        """A push whose gradient lies in this worker's memory (as the transport sends it once lent)."""
        return Message("push_pull", self.fields(**fields), [], rid, lent=["grads"])

    def knock_header(self, rid: int, **fields: Any) -> bytes:
        """The push's header as a worker's endpoint packs it into its memory to knock."""
        return self.packer.pack(self.lent_push(rid, **fields), ["grads"])

    def attached_as(self, reply: Message) -> None:
        self.attached = reply.op == ATTACHED
        if self.rung and self.buffers is not None:
            self.poller.unregister(self.buffers.bell)
        self.rung = self.attached and bool(reply.fields.get("bell")) and self.buffers is not None
        self.knocks = self.rung and bool(reply.fields.get("knock"))
        if self.rung and self.buffers is not None:
            self.poller.register(self.buffers.bell, zmq.POLLIN)
            if self.knocks:
                self.buffers.knocks_heard()

    def release(self) -> None:
        """Close this worker's memory: its knock pipe hangs up, and the ps lets it go."""
        if self.buffers is not None:
            if self.rung:
                self.poller.unregister(self.buffers.bell)
            self.buffers.close()
        self.buffers, self.attached, self.rung, self.knocks = None, False, False, False

    def replies(self, wait_s: float) -> list[Message]:
        got: list[Message] = []
        for item, _ in self.poller.poll(int(wait_s * 1000)):
            if item is self.sock:
                while self.sock.poll(0):
                    try:
                        got.append(decode(self.sock.recv_multipart()))
                    except MalformedMessage as exc:
                        got.append(Message("malformed", {"error": str(exc)}))
            elif self.buffers is not None:
                rung = self.buffers.take_reply()
                if rung is not None and rung[0] != self.last_rung:  # a ring for a header read already
                    self.last_rung = rung[0]
                    try:
                        got.append(self.unpacker.unpack(rung[1]))
                    except MalformedMessage as exc:
                        got.append(Message("malformed", {"error": str(exc)}))
        return got

    def close(self) -> None:
        self.release()
        self.sock.close(linger=0)


def _expects_reply(frames: list[bytes]) -> bool:
    """Whether a ps can read this message's request id (and so must answer it), as it decides."""
    try:
        header = json.loads(frames[0])
    except (ValueError, RecursionError, UnicodeDecodeError):
        return False
    rid = header.get("rid") if isinstance(header, dict) else None
    return isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**63


class Harness:
    """One live ps in ``mode``, a connection per worker and a stranger's, and the fuzzer's record of the exchange.

    Every request goes through :meth:`send` (or :meth:`knock`), which waits
    until the ps has handled it and its replies have arrived, and every
    reply is checked as it arrives; the ``check_*`` methods compare the
    ps's books, store and exit with that record. A violation raises, and
    is kept in ``failures`` as first seen (hypothesis replays and shrinks
    it afterwards, and timing may not replay). ``coverage`` counts what
    the requests reached: ``request -> reply`` (outcome, or error kind).
    """

    def __init__(self, mode: Mode, coverage: Counter[str], failures: list[str]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="psdk-fuzz-")
        self.mode = mode
        self._keys_dir = security.generate(Path(self._tmp.name), WORKERS + 1) if mode.curve else None
        self._start()
        self.trace: list[str] = []
        self.epoch = 0
        """The latest epoch the ps answered with (a push names it)."""
        self.answers: dict[tuple[int | None, int], Message] = {}
        """Each reply by (worker, request id), for the reference model to follow (it takes them out)."""
        self.coverage = coverage
        self.failures = failures

    def _start(self) -> None:
        """A new, empty ps, and a connection to it for each worker and the stranger; fresh books."""
        keys_dir = self._keys_dir
        self.ps = LivePs(self.mode, keys_dir)
        context = self.ps.transport.context
        keys = [security.load_worker(keys_dir, i) if keys_dir else None for i in range(WORKERS + 1)]
        self.actors = [Actor(context, self.ps.address, i, keys[i]) for i in range(WORKERS)]
        # A stranger: no session, and under CURVE only a key the ps does not list as a worker of this job's.
        self.actors.append(Actor(context, self.ps.address, None, keys[WORKERS]))
        self.books = Books()

    def restart(self) -> None:
        """The ps is lost and a new one starts, empty, on a new port, as a restarted task would; the workers
        connect to it as new processes (what waited on the old ps is gone with it)."""
        self.trace.append("the ps is lost; a new one starts")
        for actor in self.actors:
            actor.close()
        self.ps.close()
        self.answers.clear()  # the new connections count their request ids from 1 again
        self._start()

    # ------------------------------------------------------------ sending
    def send(self, actor: Actor, message: Message, must_fail: bool = False, frames: list[bytes] | None = None) -> None:
        raw = frames if frames is not None else [bytes(memoryview(f)) for f in encode(message)]
        self.books.requests += 1
        if _expects_reply(raw):
            self.books.answerable += 1
            rid = json.loads(raw[0])["rid"]
            if rid in actor.outstanding:
                raise AssertionError(f"the fuzzer reused request id {rid}")
            actor.outstanding[rid] = Sent(message.op, must_fail)
        actor.sock.send_multipart(raw)
        self.trace.append(f"worker {actor.worker} sent {message.op} {message.fields} ({len(raw) - 1} arrays)"[:300])
        self.settle()

    def offer(self, actor: Actor, offer: dict[str, Any]) -> None:
        """Lend the ps ``actor``'s memory: the transport's own exchange, which the ps never sees or counts."""
        rid = actor.rid()
        actor.outstanding[rid] = Sent(ATTACH, False)
        actor.sock.send_multipart(encode(Message(ATTACH, offer, [], rid)))
        self.trace.append(f"worker {actor.worker} offered memory {rid}")
        deadline = time.monotonic() + SETTLE_S
        while rid in actor.outstanding and self.ps.thread.is_alive():  # its memory must outlive the offer
            if time.monotonic() > deadline:
                self._violation(f"the ps's transport did not answer an offer of memory within {SETTLE_S} s")
            self._collect(0.005)

    def knock(self, actor: Actor, version: int, seq: int, epoch: int) -> int | None:
        """Knock a push of the gradient in ``actor``'s memory; its request id (``None``: no knock was made)."""
        assert actor.buffers is not None
        rid = actor.rid()
        if not actor.buffers.knock(rid, actor.knock_header(rid, version=version, seq=seq, epoch=epoch)):
            return None  # the ps let go: no knock was made (the worker would push as a message)
        self.books.requests += 1
        self.books.answerable += 1
        actor.outstanding[rid] = Sent("knock", False)
        self.trace.append(f"worker {actor.worker} knocked {rid}: version {version} seq {seq} epoch {epoch}")
        self.settle()
        return rid

    def settle(self) -> None:
        """Wait (bounded) until the ps has handled every request sent and its replies have arrived."""
        deadline = time.monotonic() + SETTLE_S
        stats = self.ps.server.stats
        while stats.handled < self.books.requests and self.ps.thread.is_alive():
            if time.monotonic() > deadline:
                self._violation(f"the ps handled {stats.handled} of {self.books.requests} requests within {SETTLE_S} s")
                return
            self._collect(0.002)
        while sum(self.books.replies.values()) < sum(stats.replies.values()) and self.ps.thread.is_alive():
            if time.monotonic() > deadline:
                self._violation(
                    f"the ps sent {sum(stats.replies.values())} replies but {sum(self.books.replies.values())} arrived"
                )
                return
            self._collect(0.005)
        self._collect(0.0)

    def _collect(self, wait_s: float) -> None:
        for actor in self.actors:
            for reply in actor.replies(wait_s if actor is self.actors[0] else 0.0):
                self._take(actor, reply)

    def _take(self, actor: Actor, reply: Message) -> None:
        if reply.op in (ATTACHED, REFUSED):  # the transport's answer to an offer: not the ps's, not in its books
            self.coverage[f"offer -> {reply.op}"] += 1
            if actor.outstanding.pop(reply.rid, None) is None:
                self._violation(f"an answer ({reply.op}) to an offer of memory {reply.rid} never made")
            actor.attached_as(reply)
            return
        if reply.op == PROBE:  # the ps asks whether this connection is open (another claimed its id): ignored
            self.coverage[f"{reply.op} (from the ps's transport)"] += 1
            return
        if reply.op == UNLENT:  # a request naming memory the ps's transport holds no more: the ps never saw it
            sent = actor.outstanding.pop(reply.rid, None)
            self.coverage[f"{sent.op if sent else '?'} (lent) -> {reply.op}"] += 1
            if sent is None:
                self._violation(f"{reply.op} for request {reply.rid} of worker {actor.worker}, not waiting for one")
            self.answers[(actor.worker, reply.rid)] = reply
            self.books.requests -= 1
            self.books.answerable -= 1
            actor.attached = actor.knocks = False  # as a worker's transport: it would send the request whole
            return
        self.books.replies[reply.op] += 1
        self.trace.append(f"  worker {actor.worker} got {reply.op} {reply.rid} {reply.fields}"[:300])
        if reply.op not in REPLY_OPS:
            self._violation(f"an untyped reply {reply.op!r} to {actor.worker}: {reply.fields}")
            return
        sent = actor.outstanding.pop(reply.rid, None)
        if sent is not None:
            self.answers[(actor.worker, reply.rid)] = reply
        detail = reply.fields.get("outcome") or reply.fields.get("kind") or ""
        if reply.op == "error":
            detail += ": " + " ".join(str(reply.fields.get("error", "")).split()[:6])
        self.coverage[f"{sent.op if sent else '?'} -> {reply.op}{f' {detail}' if detail else ''}"] += 1
        if sent is None:
            self._violation(f"a reply ({reply.op}) to worker {actor.worker}'s request {reply.rid}, not waiting for one")
            return
        undeclared = reply.fields.keys() - set(protocol.REPLIES[reply.op].fields)
        if undeclared:
            self._violation(f"{reply.op} carries fields the protocol does not declare: {sorted(undeclared)}")
        if reply.op == "error" and reply.fields.get("kind") not in ERROR_KINDS:
            self._violation(f"an error of unknown kind {reply.fields.get('kind')!r}")
        if sent.must_fail and reply.op != "error":
            self._violation(f"{sent.op} from worker {actor.worker} had to be refused, got {reply.op} {reply.fields}")
        if reply.op == "error" and reply.fields.get("kind") == "internal":
            self._violation(f"an internal error answering {sent.op}: {reply.fields.get('error')}")
        if reply.op in ("ok", "already", "layout", "params", "resync") and isinstance(reply.fields.get("epoch"), int):
            self.epoch = max(self.epoch, int(reply.fields["epoch"]))

    def _violation(self, what: str) -> None:
        self.books.violations.append(what)
        message = what + "\nthe last steps:\n" + "\n".join(self.trace[-25:])
        self.failures.append(message)
        raise AssertionError(message)

    # ------------------------------------------------------------- checks
    def check_books(self) -> None:
        """The ps's books balance, and agree with the fuzzer's."""
        if self.ps.crashed is not None:
            self._violation(f"the ps's serve() raised {self.ps.crashed!r}")
        stats = self.ps.server.stats
        if self.ps.serving or self.ps.thread.is_alive():
            self.settle()
        parked = self.ps.parked()
        answered = sum(stats.replies.values())
        if stats.requests != self.books.requests and self.ps.serving:
            self._violation(f"the ps counted {stats.requests} requests, {self.books.requests} were sent")
        if answered + stats.unanswerable + parked != stats.requests:
            self._violation(
                f"requests {stats.requests} != replies {answered} + unanswerable {stats.unanswerable} + parked {parked}"
                f" (handled {stats.handled}, sent {self.books.requests}, replies {dict(stats.replies)})"
            )
        waiting = sum(len(actor.outstanding) for actor in self.actors)
        if self.ps.serving and waiting != parked:
            pending = [(a.worker, rid, sent.op) for a in self.actors for rid, sent in a.outstanding.items()]
            self._violation(f"{waiting} requests wait for a reply but the ps holds {parked}: {pending}")
        if self.books.answerable != self.books.requests - stats.unanswerable and self.ps.serving:
            self._violation(
                f"the ps found {stats.unanswerable} requests unanswerable, the fuzzer expected "
                f"{self.books.requests - self.books.answerable}"
            )

    def check_store(self) -> None:
        """The store is finite, parameters and slots."""
        store = self.ps.server.store
        if store.initialized:
            if not all_finite(store.params()):
                self._violation("the store holds NaN or Inf")
            for name, slot in store.slots().items():
                if not all_finite(slot):
                    self._violation(f"slot {name} holds NaN or Inf")
            for name, table in store.tables.items():
                ids, rows = table.rows.export()
                slots = table.rows.gather(ids)[1] if len(ids) else {}
                if not (all_finite(rows) and all(all_finite(values) for values in slots.values())):
                    self._violation(f"table {name!r} holds NaN or Inf in its rows or slots")

    def check_exit(self, ended: str | None) -> None:
        """The ps serves, or it exited as ``ended`` (the chief's shutdown or abort) asks, its reason logged."""
        if self.ps.serving:
            return
        self.ps.thread.join(timeout=SETTLE_S)
        if self.ps.thread.is_alive():
            self._violation("the ps neither serves nor exits")
        if ended not in ENDINGS:
            self._violation(f"the ps exited ({self.ps.exit_code}) though the chief never ended the job")
            return
        code, reason = ENDINGS[ended]
        if self.ps.exit_code != code or not self.ps.tap.said(reason):
            self._violation(f"after {ended} the ps exited {self.ps.exit_code} without logging {reason!r}")

    def probe(self) -> None:
        """The ps still answers a ping, if it serves."""
        if self.ps.serving:
            probe = self.actors[0]
            rid = probe.rid()
            probe.outstanding[rid] = Sent("ping")
            probe.sock.send_multipart(encode(Message("ping", {}, [], rid)))
            self.books.requests += 1
            self.books.answerable += 1
            self.settle()
            if rid in probe.outstanding:
                self._violation("the ps no longer answers a ping")

    def close(self) -> None:
        """The ps still answers a ping, if it serves; then the connections, the ps and its keys go."""
        try:
            self.probe()
        finally:
            for actor in self.actors:
                actor.close()
            self.ps.close()
            self._tmp.cleanup()
