"""Stateful fuzzing of a live ps: sequences of every operation, from workers holding real sessions.

A single mutated message from a stranger stops at the session check: every
operation that changes state needs a registered worker, so the validation
inside init, restore, push and attach is only reached by a sequence (init
first, then the worker's own requests on its own connection). Here
hypothesis's rule-based state machine drives one live ps, over TCP, from the
chief and two more workers, each on a connection of its own (under CURVE,
with its own key), plus a stranger. It sends every operation of the protocol
(init, wait_init, pull, push_pull over frames, over shared memory and as a
knock, attach, release, finish, ping, status, stats, pause_at, state,
resume, stop_at, restore, shutdown, abort), valid or with fields and arrays
mutated, and after every step checks, against its own record of what it
sent:

* every request gets exactly one typed reply, or is waiting for one
  (parked) and the ps knows it, or its request id could not be read and the
  ps counted it as unanswerable: ``requests == replies + unanswerable +
  parked`` on the ps, and the same numbers on the fuzzer's side;
* a request the protocol must refuse was refused (an error reply);
* the store is finite, parameters and slots;
* the ps is alive and answers a ping, or it exited on purpose (the chief's
  shutdown or abort), with its reason logged and the matching exit code,
  never with a traceback, and never hangs.

Run it through :func:`run` (``python -m psdk fuzz``, long budgets) or the
test suite (``tests/test_fuzz_stateful.py``, short ones).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from psdk import protocol, security, shm
from psdk.consistency import SyncSpec
from psdk.jobspec import JobSpec
from psdk.numerics import all_finite
from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.security import CurveKeys
from psdk.wire import MalformedMessage, Message, decode, encode
from psdk.zmq_transport import ZmqOptions, ZmqTransport

try:
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ImportError:  # pragma: no cover - the CLI says how to install it
    raise ImportError("the stateful fuzzer needs hypothesis: pip install 'psdk[test]'") from None

log = logging.getLogger(__name__)

WORKERS = 3
SIZE = 24
SETTLE_S = 10.0
# What the ps may answer, and who may ask what, come from the protocol's declaration.
REPLY_OPS = frozenset(protocol.REPLIES)
ERROR_KINDS = frozenset(protocol.ERROR_KINDS)
CHIEF_ONLY = tuple(sorted(protocol.CHIEF_ONLY))
MUTATED_OPS = sorted(name for name, op in protocol.OPS.items() if op.fields and name not in ("abort", "shutdown"))
"""Operations with fields of their own, each sent with one of them (or the worker id, or an unknown key) odd;
the ops that end the job have a rule of their own (``end``), which expects the ps to exit."""
MUTATED_KEYS = sorted({"worker", "x"} | {f.name for op in protocol.OPS.values() for f in op.fields})
ODD: list[Any] = [-1, 0, 1, 7, 2**31, 2**63 - 1, -(2**63), 1.5, True, False, None, "", "x" * 300, [], [1], {}, {"a": 1}]
FIRST_FAILURES: list[str] = []
"""Every violation as first seen, before hypothesis replays and shrinks it (timing may not replay)."""
COVERAGE: Counter[str] = Counter()
"""What the sequences reached, over every run in this process: ``request -> reply`` (outcome, or error kind)."""
RULES: list[UpdateRule] = [SGD(lr=0.1), SGD(lr=0.5, momentum=0.9), Adam(lr=0.01), Adagrad(lr=0.1), RMSProp(lr=0.01)]


@dataclass(frozen=True)
class Mode:
    """Which transport the sequences run over."""

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
        options = ZmqOptions(
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=60.0,
            curve=curve,
            shared_memory=mode.shared_memory,
            max_message_bytes=8 << 20,
        )
        self.transport = ZmqTransport(options)
        endpoint = self.transport.serve("127.0.0.1:0", "ps 0")
        self.address = endpoint.address
        server_options = ServerOptions(
            heartbeat_timeout_s=60.0, startup_timeout_s=600.0, poll_s=0.01, idle_timeout_s=None, max_workers=WORKERS
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

    def attached_as(self, reply: Message) -> None:
        self.attached = reply.op == "attached"
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
                reply = self.buffers.take_reply()
                if reply is not None:
                    got.append(reply)
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


class PsMachine(RuleBasedStateMachine):
    """Hypothesis's state machine over one live ps; :data:`MODE` picks the transport (set by :func:`machine`)."""

    MODE = Mode()

    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="psdk-fuzz-")
        keys_dir = security.generate(Path(self._tmp.name), WORKERS + 1) if self.MODE.curve else None
        self.ps = LivePs(self.MODE, keys_dir)
        context = self.ps.transport.context
        keys = [security.load_worker(keys_dir, i) if keys_dir else None for i in range(WORKERS + 1)]
        self.actors = [Actor(context, self.ps.address, i, keys[i]) for i in range(WORKERS)]
        # A stranger: no session, and under CURVE only a key the ps does not list as a worker of this job's.
        self.actors.append(Actor(context, self.ps.address, None, keys[WORKERS]))
        self.books = Books()
        self.trace: list[str] = []
        self.ended: str | None = None
        """"shutdown" or "abort" once the chief ended the job (the ps then exits on purpose)."""
        self.epoch = 0
        self.names = ["dense/kernel", "dense/bias"]
        self.shapes = [(4, 5), (4,)]

    @initialize(
        start=st.sampled_from(["nothing", "init", "init+attach"]),
        mode=st.sampled_from(["async", "sync", "ssp"]),
        rule_index=st.integers(0, len(RULES) - 1),
    )
    def start(self, start: str, mode: str, rule_index: int) -> None:
        """Most sequences begin with a job the chief initialised (and memory offered): the handlers past init."""
        if start == "nothing":
            return
        self.init(0, mode, rule_index, 10**6, False, 1.0)
        for who in range(1, WORKERS):
            self.wait_init(who)
        if start == "init+attach" and self.MODE.shared_memory and shm.available():
            for who in range(WORKERS):
                self.attach(who, None)

    # ------------------------------------------------------------ sending
    def _send(self, actor: Actor, message: Message, must_fail: bool = False, frames: list[bytes] | None = None) -> None:
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
        self._settle()

    def _knock(self, actor: Actor, version: int, seq: int, epoch: int, slot: str) -> None:
        assert actor.buffers is not None
        rid = actor.rid()
        if not actor.buffers.knock(rid, version, seq, epoch, slot):
            return  # the ps let go: no knock was made (the worker would push as a message)
        self.books.requests += 1
        self.books.answerable += 1
        actor.outstanding[rid] = Sent("knock", False)
        self.trace.append(f"worker {actor.worker} knocked {rid}: version {version} seq {seq} epoch {epoch}")
        self._settle()

    def _settle(self) -> None:
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
        self.books.replies[reply.op] += 1
        self.trace.append(f"  worker {actor.worker} got {reply.op} {reply.rid} {reply.fields}"[:300])
        if reply.op not in REPLY_OPS:
            self._violation(f"an untyped reply {reply.op!r} to {actor.worker}: {reply.fields}")
            return
        sent = actor.outstanding.pop(reply.rid, None)
        detail = reply.fields.get("outcome") or reply.fields.get("kind") or ""
        if reply.op == "error":
            detail += ": " + " ".join(str(reply.fields.get("error", "")).split()[:6])
        COVERAGE[f"{sent.op if sent else '?'} -> {reply.op}{f' {detail}' if detail else ''}"] += 1
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
        if sent.op == "attach":
            actor.attached_as(reply)
        if reply.op in ("ok", "already", "layout", "params", "resync") and isinstance(reply.fields.get("epoch"), int):
            self.epoch = max(self.epoch, int(reply.fields["epoch"]))

    def _violation(self, what: str) -> None:
        self.books.violations.append(what)
        message = what + "\nthe last steps:\n" + "\n".join(self.trace[-25:])
        FIRST_FAILURES.append(message)
        raise AssertionError(message)

    # ----------------------------------------------------------- messages
    def _variables(self, scale: float = 1.0) -> list[np.ndarray]:
        return [np.full(shape, 0.1 * scale, np.float32) for shape in self.shapes]

    def _flat_size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def _push(self, actor: Actor, grad: np.ndarray, version: int, seq: int, epoch: int) -> Message:
        return Message("push_pull", actor.fields(version=version, seq=seq, epoch=epoch), [grad], actor.rid())

    def _store_version(self) -> int:
        return self.ps.server.store.version

    # --------------------------------------------------------------- rules
    @precondition(lambda self: self.ps.serving)
    @rule(
        who=st.integers(0, WORKERS),
        mode=st.sampled_from(["async", "sync", "ssp"]),
        rule_index=st.integers(0, len(RULES) - 1),
        steps=st.sampled_from([3, 20, 10**6]),
        restore=st.booleans(),
        scale=st.sampled_from([1.0, 1e30, float("nan")]),
    )
    def init(self, who: int, mode: str, rule_index: int, steps: int, restore: bool, scale: float) -> None:
        actor = self.actors[who]
        rule = RULES[rule_index]
        sync = SyncSpec(mode, replicas_to_aggregate=2 if mode == "sync" else None, staleness=1)
        fields = actor.fields(job=JobSpec(sync.resolved(WORKERS), steps, WORKERS).to_json(), rule=rule.to_json())
        fields["names"] = self.names
        arrays = self._variables(scale)
        if restore:
            slots = list(rule.slot_names())
            fields["restore"] = {"version": 5, "rule_step": 5, "slots": slots}
            arrays += [np.full(shape, abs(scale) * 0.01, np.float32) for _ in slots for shape in self.shapes]
        must_fail = actor.worker != 0 or (math.isnan(scale) and not self.ps.server.store.initialized)
        self._send(actor, Message("init", fields, arrays, actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS))
    def wait_init(self, who: int) -> None:
        actor = self.actors[who]
        self._send(actor, Message("wait_init", actor.fields(), [], actor.rid()), must_fail=actor.worker is None)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS))
    def pull(self, who: int) -> None:
        actor = self.actors[who]
        must_fail = actor.worker is None or not self.ps.server.store.initialized
        self._send(actor, Message("pull", actor.fields(), [], actor.rid()), must_fail=must_fail)

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
        grad = np.full(self._flat_size(), fill, np.float32)
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
            self._knock(actor, at, number, self.epoch, "grads")
            return
        if channel == "shm" and actor.buffers is not None:
            actor.buffers.grads[...] = grad
            fields = actor.fields(version=at, seq=number, epoch=self.epoch, shm="grads")
            must_fail = must_fail or not actor.attached
            self._send(actor, Message("push_pull", fields, [], actor.rid()), must_fail=must_fail)
            return
        self._send(actor, self._push(actor, grad, at, number, self.epoch), must_fail=must_fail)

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
        self._send(actor, Message("attach", actor.fields(**offer), [], actor.rid()), must_fail=actor.worker is None)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS - 1))
    def release(self, who: int) -> None:
        """The worker closes its memory: the ps sees its knock pipe hang up and lets the memory go."""
        self.actors[who].release()
        self._settle()

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), report=st.sampled_from([None, {"local_steps": 3}, {"x": [[1]]}, "text"]))
    def finish(self, who: int, report: Any) -> None:
        actor = self.actors[who]
        self._send(
            actor, Message("finish", actor.fields(report=report), [], actor.rid()), must_fail=actor.worker is None
        )

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(["ping", "status", "stats"]))
    def query(self, who: int, op: str) -> None:
        actor = self.actors[who]
        self._send(actor, Message(op, actor.fields(), [], actor.rid()))

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), ahead=st.integers(-2, 3), op=st.sampled_from(["pause_at", "stop_at"]))
    def pause_or_stop(self, who: int, ahead: int, op: str) -> None:
        actor = self.actors[who]
        target = self._store_version() + ahead
        must_fail = actor.worker != 0 or not self.ps.server.store.initialized or target < 0
        self._send(actor, Message(op, actor.fields(version=target), [], actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(["state", "resume"]))
    def checkpoint_step(self, who: int, op: str) -> None:
        actor = self.actors[who]
        must_fail = actor.worker != 0 or (op == "state" and not self.ps.server.store.initialized)
        self._send(actor, Message(op, actor.fields(), [], actor.rid()), must_fail=must_fail)

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
        arrays = [np.full(shape, 0.2, np.float32) for _, shape in specs]
        arrays += [np.full(shape, fill, np.float32) for _ in slot_names for _, shape in specs]
        restore = {"version": version, "rule_step": version, "slots": slot_names}
        fields = actor.fields(names=[name for name, _ in specs], restore=restore, epoch=self.epoch + 1)
        wrong_slots = rule is not None and slots == "none" and bool(rule.slot_names())
        bad_values = bool(slot_names) and (
            slots == "nan" or (slots == "negative" and rule is not None and bool(rule.nonnegative_slots))
        )
        must_fail = actor.worker != 0 or not store.initialized or wrong_slots or bad_values
        self._send(actor, Message("restore", fields, arrays, actor.rid()), must_fail=must_fail)

    @precondition(lambda self: self.ps.serving)
    @rule(who=st.integers(0, WORKERS), op=st.sampled_from(["shutdown", "abort"]), now=st.integers(0, 2))
    def end(self, who: int, op: str, now: int) -> None:
        """The end of the job (one draw in three sends it, so most sequences run on)."""
        if now:
            return
        actor = self.actors[who]
        fields = actor.fields(reason="the fuzzer ends it") if op == "abort" else actor.fields()
        if actor.worker == 0:
            self.ended = op
        self._send(actor, Message(op, fields, [], actor.rid()), must_fail=actor.worker != 0)

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
            self._send(actor, self._push(actor, grad, self._store_version(), seq, self.epoch))

    @precondition(lambda self: self.ps.serving and self.ps.server.store.initialized)
    @rule()
    def checkpoint(self) -> None:
        """The chief's checkpoint: pause at the current version, read the state, resume."""
        chief = self.actors[0]
        self._send(chief, Message("pause_at", chief.fields(version=self._store_version()), [], chief.rid()))
        self._send(chief, Message("state", chief.fields(), [], chief.rid()))
        self._send(chief, Message("resume", chief.fields(), [], chief.rid()))

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
            epoch=self.epoch,
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
        self._send(actor, Message(op, fields, grads, actor.rid()), must_fail=_ill_typed(op, key, value))

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
        self._send(actor, Message(kind, {}, [], rid), must_fail=True, frames=frames)

    @rule()
    def idle(self) -> None:
        """Nothing sent: always possible, also after the chief ended the job."""
        if self.ps.serving:
            self._settle()

    # ---------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        if self.ps.crashed is not None:
            self._violation(f"the ps's serve() raised {self.ps.crashed!r}")
        stats = self.ps.server.stats
        if self.ps.serving or self.ps.thread.is_alive():
            self._settle()
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

    @invariant()
    def store_is_finite(self) -> None:
        store = self.ps.server.store
        if store.initialized:
            if not all_finite(store.params()):
                self._violation("the store holds NaN or Inf")
            for name, slot in store.slots().items():
                if not all_finite(slot):
                    self._violation(f"slot {name} holds NaN or Inf")

    @invariant()
    def alive_or_ended_on_purpose(self) -> None:
        if self.ps.serving:
            return
        self.ps.thread.join(timeout=SETTLE_S)
        if self.ps.thread.is_alive():
            self._violation("the ps neither serves nor exits")
        expected = {"shutdown": (0, "shut down by the chief"), "abort": (1, "the chief aborted the job")}
        if self.ended not in expected:
            self._violation(f"the ps exited ({self.ps.exit_code}) though the chief never ended the job")
            return
        code, reason = expected[self.ended]
        if self.ps.exit_code != code or not self.ps.tap.said(reason):
            self._violation(f"after {self.ended} the ps exited {self.ps.exit_code} without logging {reason!r}")

    def teardown(self) -> None:
        try:
            if self.ps.serving:  # it still answers a ping
                probe = self.actors[0]
                rid = probe.rid()
                probe.outstanding[rid] = Sent("ping")
                probe.sock.send_multipart(encode(Message("ping", {}, [], rid)))
                self.books.requests += 1
                self.books.answerable += 1
                self._settle()
                if rid in probe.outstanding:
                    self._violation("the ps no longer answers a ping")
        finally:
            for actor in self.actors:
                actor.close()
            self.ps.close()
            self._tmp.cleanup()


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

    def line(self) -> str:
        outcome = "PASS" if self.failure is None else f"FAIL: {self.failure}"
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
    return report


@dataclass
class AlongsideReport:
    """How a real job fared while one of its workers' keys was fuzzed."""

    intruder_requests: int = 0
    intruder_replies: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    honest_steps: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    global_step: int = 0
    target: int = 0
    store_finite: bool = False
    ps_exit: int | None = None

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and not self.errors
            and self.global_step >= self.target
            and all(steps > 0 for steps in self.honest_steps.values())
            and self.store_finite
            and self.ps_exit == 0
        )

    def line(self) -> str:
        outcome = "PASS" if self.ok else f"FAIL: {(self.violations + self.errors)[:2]}"
        replies = ", ".join(f"{op} {n}" for op, n in self.intruder_replies.most_common())
        return (
            f"alongside a real job: worker 2's key sent {self.intruder_requests} requests ({replies}); workers "
            f"{sorted(self.honest_steps)} trained {self.honest_steps} local steps to global step {self.global_step} "
            f"of {self.target}; store finite: {self.store_finite}; ps exit {self.ps_exit}: {outcome}"
        )


class Intruder:
    """Worker ``worker``'s key in the hands of a fuzzer: random requests on its own session, each reply checked."""

    OPS = (
        "push-nan", "push-inf", "push-future", "push-repeat", "push-small", "push-shape", "pull", "attach",
        "attach-tampered", "knock", "release", "pause_at", "state", "resume", "stop_at", "restore", "init",
        "shutdown", "abort", "garbage", "other-id", "stats",
    )  # fmt: skip

    def __init__(self, actor: Actor, server: ParameterServer, seed: int):
        import random

        self.actor, self.server, self.rng = actor, server, random.Random(seed)
        self.report = AlongsideReport()

    def step(self) -> None:
        op = self.rng.choice(self.OPS)
        actor, version = self.actor, self.server.store.version
        seq = actor.next_seq
        actor.next_seq += 1
        size = self.server.store.size
        if op.startswith("push"):
            kind = op.split("-", 1)[1]
            # What it pushes is refused, or too small to matter: a worker's key can always push finite nonsense
            # (the ps keeps the store finite, not the training sound), and this run is about the others' survival.
            fill = {"nan": np.nan, "inf": np.inf, "small": 1e-6}.get(kind, 1e-6)
            grad = np.full(size if kind != "shape" else size + 1, fill, np.float32)
            at = version + 10**9 if kind == "future" else version
            number = 1 if kind == "repeat" else seq
            counters = self.server.stats.workers.get(self.actor.worker or 0)
            repeated = kind == "repeat" and counters is not None and counters.last_seq >= 1
            must_fail = kind in ("nan", "inf", "future", "shape") or repeated
            self._send(Message("push_pull", actor.fields(version=at, seq=number, epoch=0), [grad]), must_fail)
        elif op in ("attach", "attach-tampered") and shm.available():
            offer = actor.offer_memory(size)
            if op == "attach-tampered":
                offer["token"] = "00" * 16
            self._send(Message("attach", actor.fields(**offer)), False)
            rid, deadline = actor.next_rid - 1, time.monotonic() + 5.0
            while rid in actor.outstanding and time.monotonic() < deadline:  # its memory must outlive the offer
                self.collect(0.01)
        elif op == "knock" and actor.knocks and actor.buffers is not None:
            actor.buffers.grads[...] = 1e-6
            rid = actor.rid()
            if actor.buffers.knock(rid, version, seq, 0, "grads"):
                self.report.intruder_requests += 1
                actor.outstanding[rid] = Sent("knock")
        elif op == "release":
            actor.release()
        elif op in CHIEF_ONLY:
            self._send(Message(op, actor.fields(version=version, names=["w"], job={}, reason="x")), True)
        elif op == "garbage":
            rid = actor.rid()
            frames = [b'{"op":"pull","rid":%d,"a":[],"f":{"x":' % rid + b"[" * 5000 + b"]" * 5000 + b"}}"]
            self.report.intruder_requests += 1
            actor.sock.send_multipart(frames)
        elif op == "other-id":  # the key of this worker claims the chief's id
            self._send(Message("pull", {"worker": 0}), True)
        else:
            self._send(Message(op if op in ("pull", "stats") else "ping", actor.fields()), False)
        self.collect(0.0)

    def _send(self, message: Message, must_fail: bool) -> None:
        message.rid = self.actor.rid()
        self.actor.outstanding[message.rid] = Sent(message.op, must_fail)
        self.report.intruder_requests += 1
        self.actor.sock.send_multipart(encode(message))

    def collect(self, wait_s: float) -> None:
        for reply in self.actor.replies(wait_s):
            self.report.intruder_replies[reply.op] += 1
            sent = self.actor.outstanding.pop(reply.rid, None)
            if reply.op not in REPLY_OPS:
                self.report.violations.append(f"an untyped reply {reply.op}")
            elif sent is None:
                self.report.violations.append(f"an unexpected reply {reply.op} to request {reply.rid}")
            elif sent.must_fail and reply.op != "error":
                self.report.violations.append(f"{sent.op} had to be refused, got {reply.op} {reply.fields}")
            elif reply.op == "error" and reply.fields.get("kind") == "internal":
                self.report.violations.append(f"an internal error: {reply.fields.get('error')}")
            if sent is not None and sent.op == "attach":
                self.actor.attached_as(reply)


def run_alongside(steps: int = 400, seed: int = 0, curve: bool = True, timeout_s: float = 120.0) -> AlongsideReport:
    """A real async job (chief and worker 1 training) while worker 2's key is fuzzed, until the job ends."""
    import psdk
    from psdk.backends.numpy_backend import NumpyBackend
    from psdk.client import ClientOptions
    from psdk.cluster import ClusterSpec
    from psdk.models import ModelSpec, init_weights

    tmp = tempfile.TemporaryDirectory(prefix="psdk-alongside-")
    keys_dir = security.generate(Path(tmp.name), WORKERS) if curve else None
    ps = LivePs(Mode(curve=curve), keys_dir)
    spec = ModelSpec(hidden=(16,), input_dim=32, num_classes=10)
    rng = np.random.default_rng(seed)
    xs, ys = rng.random((20, 16, 32), dtype=np.float32), rng.integers(0, 10, (20, 16))
    cluster = ClusterSpec({"ps": [ps.address.split("://", 1)[1]], "worker": ["127.0.0.1"] * WORKERS})
    options = ClientOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, request_timeout_s=60.0)
    report = AlongsideReport(target=steps)
    lock = threading.Lock()

    def train(task: int) -> None:
        try:
            backend = NumpyBackend()
            model = backend.build_model(spec, init_weights(spec, seed))
            keys = security.load_worker(keys_dir, task) if keys_dir is not None else None
            with psdk.connect(cluster, task, steps=steps, options=options, keys=keys, secure=curve) as session:
                opt = psdk.DistributedOptimizer(SGD(lr=0.1), model, session, backend=backend)
                opt.broadcast_parameters()
                local = 0
                while not session.should_stop():
                    backend.forward_backward(model, xs[local % 20], ys[local % 20])
                    opt.step()
                    local += 1
                with lock:
                    report.honest_steps[task] = local
                    if task == 0:
                        report.global_step = session.global_step
                        report.store_finite = all_finite(ps.server.store.params())
                session.finish(wait_s=timeout_s)
        except Exception as exc:  # reported: the test fails naming it
            with lock:
                report.errors.append(f"worker {task}: {exc!r}")

    trainers = [threading.Thread(target=train, args=(task,), daemon=True) for task in (0, 1)]
    intruder_keys = security.load_worker(keys_dir, 2) if keys_dir is not None else None
    actor = Actor(ps.transport.context, ps.address, 2, intruder_keys)
    intruder = Intruder(actor, ps.server, seed)
    try:
        for thread in trainers:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while not ps.server.store.initialized and time.monotonic() < deadline:
            time.sleep(0.01)
        while trainers[1].is_alive() and ps.serving and time.monotonic() < deadline:
            intruder.step()
        # The job is over: worker 2 says so too (the chief waits for it), and collects its last answers.
        finish = Message("finish", actor.fields(report={"fuzzed": True}))
        intruder._send(finish, False)
        while trainers[0].is_alive() and time.monotonic() < deadline:
            intruder.collect(0.05)
        for thread in trainers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in trainers):
            report.errors.append(f"the job did not end within {timeout_s:.0f} s")
        ps.thread.join(timeout=10)
        report.ps_exit = ps.exit_code
        if ps.crashed is not None:
            report.errors.append(f"the ps's serve() raised {ps.crashed!r}")
        report.intruder_requests, report.intruder_replies = (
            intruder.report.intruder_requests,
            intruder.report.intruder_replies,
        )
        report.violations = intruder.report.violations
    finally:
        actor.close()
        ps.close()
        tmp.cleanup()
    return report
