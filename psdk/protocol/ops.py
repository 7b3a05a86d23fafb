"""The ps protocol, declared once: every operation, its fields and their types, who may send it, its replies.

The ps checks each request against this declaration before a handler sees
it (:func:`sender_of`, :func:`admit`), the client builds its requests from it
(:func:`request`), the stateful fuzzer draws its operations and its
mutations from it, and ``docs/protocol.md`` describes it (a test keeps the
page and this module in step). A handler therefore starts from fields of
the declared types; what it still checks is what depends on the shard's
state (a version ahead of the store, a gradient of the wrong size).

Fields not declared are ignored, so a newer worker may send more than an
older ps knows. Every request carries ``worker``, the sender's task index:
the ps binds it to the connection that first used it (see
:mod:`psdk.ps.sessions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from psdk.errors import NonFiniteError, ProtocolError, RefusedError
from psdk.transport.wire import Message

CHIEF = 0


class Sender(Enum):
    """Who may send an operation."""

    WORKER = "any worker of the job"
    CHIEF = "the chief (worker 0)"


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list(value: Any) -> bool:
    return isinstance(value, list)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _string(value: Any) -> bool:
    return isinstance(value, str)


def _anything(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class FieldType:
    """A JSON type a field must have, with the words a refusal and the docs use for it."""

    name: str
    accepts: Callable[[Any], bool]


NATURAL = FieldType("integer >= 0", _natural)
INTEGER = FieldType("integer", _integer)
LIST = FieldType("list", _list)
OBJECT = FieldType("object", _object)
BOOLEAN = FieldType("true or false", _boolean)
STRING = FieldType("string", _string)
ANY = FieldType("any JSON value", _anything)


@dataclass(frozen=True)
class Field:
    name: str
    type: FieldType
    doc: str
    required: bool = True
    nullable: bool = False
    """``null`` stands for "not given" (an optional field only)."""
    label: str = ""
    """How a refusal names the field ("bad <label> <value>"); the name itself when empty."""

    def check(self, fields: Mapping[str, Any]) -> None:
        if self.name not in fields:
            if self.required:
                raise ProtocolError(f"{self.name} is missing ({self.type.name} expected)")
            return
        value = fields[self.name]
        if value is None and self.nullable:
            return
        if not self.type.accepts(value):
            raise ProtocolError(f"bad {self.label or self.name} {_short(value)} ({self.type.name} expected)")


@dataclass(frozen=True)
class Op:
    """One operation a worker sends the ps."""

    name: str
    doc: str
    sender: Sender
    fields: tuple[Field, ...]
    arrays: str
    """What its array frames hold, in words."""
    replies: tuple[str, ...]
    """The replies it can get besides ``error`` (which any request can get)."""
    action: str = ""
    """What only the chief does, for the refusal "only the chief (worker 0) <action>"."""
    parks: str = ""
    """When the ps answers later rather than at once (a sync round, a pause): the request waits, bounded."""

    @property
    def field_names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields)


@dataclass(frozen=True)
class Reply:
    name: str
    doc: str
    fields: tuple[str, ...]
    arrays: str = "none"


WORKER_FIELD = Field("worker", NATURAL, "the sender's worker task index", label="worker id")
VERSION = Field("version", NATURAL, "the shard version the gradient was computed from")
LAYOUT_FIELDS = ("version", "done", "epoch", "boot", "job", "names", "shapes", "tables")
TABLES = Field(
    "tables", LIST, "the embedding tables this request pushes rows of or pulls rows from, in array order: "
    "[{table, push, pull, read, pulled}] (docs/tables.md; pulled: push_pull only)", required=False, nullable=True,
)  # fmt: skip
FINISHED = Field(
    "finished", OBJECT, "workers known to have finished, with their reports ({id: report}): a restored shard "
    "is told again who finished", required=False, nullable=True,
)  # fmt: skip

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("ping", "Liveness: a worker's heartbeat socket sends it every heartbeat interval.", Sender.WORKER,
           (), "none", ("pong",)),
        Op(
            "init",
            "Place the job on this shard: its variables, update rule and job spec (or the state to resume from).",
            Sender.CHIEF,
            (
                Field("job", OBJECT, "the job spec: sync mode, target step, workers, run id (jobspec.py)"),
                Field("rule", OBJECT, "the update rule the ps applies (psdk.ps.rules), e.g. {'name': 'sgd', 'lr': 0.1}",
                      required=False, nullable=True),
                Field("names", LIST, "this shard's variable names, unique non-empty strings, in frame order"),
                Field("epoch", NATURAL, "the job's restore epoch (0 for a new job)", required=False),
                Field("restore", OBJECT, "{version, rule_step, slots}: start from a checkpoint; with tables "
                      "(names) and chunk_rows, those tables are then restored by table_restore", required=False,
                      nullable=True),
                FINISHED,
                Field("tables", OBJECT, "the job's embedding tables: {shard: this ps's index, num_ps, specs: "
                      "[TableSpec]}; each shard creates its own rows", required=False, nullable=True),
            ),
            "one float32 array per variable; when restoring, then one per slot and variable (slot-major)",
            ("ok", "already"),
            action="initialises the store",
        ),
        Op("wait_init", "A worker other than the chief waits until the chief has initialised the shard.",
           Sender.WORKER, (), "none", ("layout",), parks="until the chief's init (at most 2 per worker)"),
        Op("pull", "The shard's current parameters (and the rows of the ids it names).", Sender.WORKER, (TABLES,),
           "per pulling tables entry, its ids (int64, strictly increasing)", ("params", "resync")),
        Op(
            "push_pull",
            "Apply one gradient (as the sync mode says) and answer with the fresh parameters.",
            Sender.WORKER,
            (
                VERSION,
                Field("seq", INTEGER, "this worker process's push counter: a repeat is refused",
                      label="sequence number"),
                Field("epoch", NATURAL, "the restore epoch the gradient belongs to (else: resync)", required=False),
                TABLES,
                Field("pulled", NATURAL, "the request of this worker whose pulled ids the tables entries marked "
                      "pulled push rows of (sent without them): its last answered training pull", required=False),
            ),
            "one flat float32 gradient of the shard's size (a frame, or memory the transport lent); then per "
            "tables entry: pushed ids (int64, strictly increasing; none if pulled) and their rows (float32), "
            "pulled ids",
            ("params", "resync"),
            parks="in a sync round, behind the staleness bound (ssp), or while a checkpoint pause holds it",
        ),
        Op("finish", "The worker is done training; it sends every shard its report for the chief's summary.",
           Sender.WORKER, (Field("report", ANY, "a small object (kept if at most 16 KiB)", required=False),
                           Field("stays", BOOLEAN, "the worker waits until it has seen its report collected "
                                 "(and the chief waits for that)", required=False)),
           "none", ("ok",)),
        Op("status", "Version, liveness of every worker, failure if any, whose reports the chief has.",
           Sender.WORKER, (Field("reports", BOOLEAN, "the chief only: also the finished workers' reports, which "
                                 "are then collected", required=False),), "none", ("status",)),
        Op("stats", "The shard's counters, for the summary and benchmarks.", Sender.WORKER, (), "none", ("stats",)),
        Op("shutdown", "End the job: the ps exits with code 0.", Sender.CHIEF, (), "none", ("ok",),
           action="shuts the job down"),
        Op("abort", "Fail the job: waiting requests get the reason, the ps exits with code 1.", Sender.CHIEF,
           (Field("reason", ANY, "why, in words", required=False),), "none", ("ok",), action="aborts the job"),
        Op("pause_at", "Stop applying pushes once the shard reaches version (a checkpoint's consistent cut).",
           Sender.CHIEF, (Field("version", NATURAL, "the version to pause at", label="pause version"),), "none",
           ("paused", "passed"), action="pauses the store", parks="until the shard reaches the version"),
        Op("state", "The shard's variables, slots and rule step, while paused.", Sender.CHIEF, (), "none",
           ("state",), action="reads the state"),
        Op(
            "table_state",
            "One chunk of this shard's part of a table, while paused: rows from a slot cursor, or sketch counters.",
            Sender.CHIEF,
            (
                Field("table", STRING, "the table's name"),
                Field("part", STRING, "rows (ids, rows, stamps, slots) or sketch (admission counters)"),
                Field("cursor", NATURAL, "where this chunk starts: 0, then the reply's next"),
                Field("rows", NATURAL, "the chunk size: at most this many slots (or rows x dim sketch counters)",
                      label="chunk rows"),
            ),
            "none",
            ("table_state",),
            action="reads the state",
        ),
        Op(
            "table_restore",
            "Load one chunk of a table into a staging table; commit swaps it in (after an init that restores it).",
            Sender.CHIEF,
            (
                Field("table", STRING, "the table's name, one the init's restore.tables named"),
                Field("part", STRING, "rows, sketch or commit"),
                Field("chunk", NATURAL, "the chunk's number in this restore: a number already taken is "
                      "acknowledged and not loaded again (a retry)"),
                Field("slots", LIST, "rows: the slot names, in the order of their arrays", required=False),
                Field("offset", NATURAL, "sketch: the first counter's position", required=False),
                Field("counters", LIST, "commit: [clock, evicted, created, rows], rows being how many were sent",
                      required=False),
            ),
            "rows: ids (int64, strictly increasing, this shard's), rows (float32, ids x dim), last_used (uint32), "
            "then one float32 ids x dim array per slot; sketch: one uint32 array; commit: none",
            ("chunk_taken",),
            action="restores the store",
        ),
        Op("resume", "End the checkpoint pause: held pushes are applied.", Sender.CHIEF, (), "none", ("ok",),
           action="resumes the store"),
        Op("stop_at", "End training early: the job is done once the shard reaches version.", Sender.CHIEF,
           (Field("version", NATURAL, "the last global step", label="stop version"),), "none", ("ok",),
           action="stops the job"),
        Op(
            "restore",
            "Roll the shard back to a checkpoint after another shard was lost; every waiting push gets resync.",
            Sender.CHIEF,
            (
                Field("names", LIST, "this shard's variable names, as it holds them"),
                Field("restore", OBJECT, "{version, rule_step, slots}; with tables and chunk_rows, as init's"),
                Field("epoch", NATURAL, "the new restore epoch"),
                FINISHED,
            ),
            "one float32 array per variable, then one per slot and variable (slot-major)",
            ("ok",),
            action="restores the store",
        ),
    )
}  # fmt: skip

REPLIES: dict[str, Reply] = {
    r.name: r
    for r in (
        Reply("pong", "to ping", ("version", "done", "boot", "epoch")),
        Reply("ok", "done; init and restore add the shard's layout, stop_at the new target", (*LAYOUT_FIELDS, "steps")),
        Reply("already", "init of a shard already initialised (a restarted chief): its layout", LAYOUT_FIELDS),
        Reply("layout", "to wait_init: the shard's layout", LAYOUT_FIELDS),
        Reply("params", "the parameters after a pull or push_pull", ("version", "done", "outcome", "slowest"),
              "one flat float32 array (a frame, or written into memory the worker's transport lent); then the "
              "rows of each pulling tables entry (float32, ids x dim)"),
        Reply("resync", "the push belongs to an abandoned timeline: wait for the chief's restore, pull again",
              ("why", "initialized", "epoch", "boot", "version")),
        Reply("status", "to status; reports when the chief asked for them",
              ("version", "done", "initialized", "restoring", "epoch", "boot", "failure", "workers", "collected",
               "leaving", "reports")),
        Reply("stats", "to stats", ("task", "version", "size", "variables", "stats", "workers", "reports", "job",
                                    "process", "tables", "time_per_push")),
        Reply("paused", "the shard stands at the pause version", ("version",)),
        Reply("passed", "the shard is already past the pause version (or done before it)", ("version",)),
        Reply("state", "a paused shard's state", (*LAYOUT_FIELDS, "slots", "rule_step", "rule"),
              "the flat variables, then one flat array per slot"),
        Reply("table_state", "one chunk of a paused shard's table",
              ("table", "part", "version", "config", "counters", "slots", "cursor", "next"),
              "rows: ids (int64), rows (float32), last_used (uint32), one float32 array per slot (in slots' "
              "order); sketch: one uint32 array of counters from cursor"),
        Reply("chunk_taken", "to table_restore: the chunk is loaded (or was already), or the table committed",
              ("table", "chunk", "rows", "again", "committed")),
        Reply("error", "a refusal or failure, any request", ("error", "kind")),
    )
}  # fmt: skip

ID_IN_USE = "in_use"
"""The error kind of a worker id refused because a live process holds it: the worker gives up at once."""
ID_HELD = "held"
"""The error kind of a worker id still held by a connection not yet taken for dead: a restarted worker retries."""
BUSY = "busy"
"""The error kind of a request refused because as many of its kind already wait as the ps holds for it."""
NON_FINITE = NonFiniteError.kind
"""The error kind of a push whose update would leave NaN or Inf in the store: refused, the store unchanged."""
PULL_NOT_HELD = "pull_not_held"
"""The error kind of a push naming a pull the shard does not hold: nothing applied; the worker sends it again
with its ids (same seq: the name is checked before the seq is recorded)."""

ERROR_KINDS: dict[str, str] = {
    "protocol": "the message could not be decoded",
    "rejected": "the request broke the protocol or the shard's rules (nothing changed)",
    ID_IN_USE: "the worker id is held by a running process: every worker needs its own task index",
    ID_HELD: "the worker id is held by a connection not yet taken for dead (heartbeat timeout): retry",
    BUSY: "as many such requests already wait as the ps holds (nothing changed; those waiting stay)",
    NON_FINITE: "the push's update would leave NaN or Inf in the store: refused, the store unchanged",
    PULL_NOT_HELD: "a push named a pull the shard does not hold (nothing applied): send it again with its ids",
    "failed": "the job has failed: the reason follows",
    "internal": "a bug in the ps (logged there); the ps goes on",
    "not_paused": "state or table_state without a held pause: the chief skips that checkpoint",
}

CHIEF_ONLY = frozenset(name for name, op in OPS.items() if op.sender is Sender.CHIEF)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def sender_of(message: Message) -> tuple[Op, int]:
    """The declared op and the worker id the request claims to come from (not yet checked against the job).

    Raises :class:`~psdk.errors.ProtocolError` (answered as a rejection) for
    an unknown op or a missing or ill-typed worker id. Whether the id
    belongs to the job and to this connection is the session's check.
    """
    op = OPS.get(message.op)
    if op is None:
        raise ProtocolError(f"unknown op {message.op!r}")
    if message.fields.get("worker") is None:  # nothing at all for a connection that is none of the job's workers
        raise ProtocolError(f"{op.name} needs the id of one of the job's workers")
    WORKER_FIELD.check(message.fields)
    return op, message.fields["worker"]


def admit(op: Op, worker: int, fields: Mapping[str, Any]) -> None:
    """Refuse a chief-only op from another worker, or a declared field that is missing or of the wrong type."""
    if op.sender is Sender.CHIEF and worker != CHIEF:
        raise RefusedError(f"only the chief (worker {CHIEF}) {op.action}")
    for field in op.fields:
        field.check(fields)


def request(op: str, worker: int, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message:
    """A request as the protocol declares it (a field it does not declare is a bug on this side)."""
    declared = OPS[op]
    unknown = fields.keys() - declared.field_names
    if unknown:
        raise ValueError(f"{op} declares no field {sorted(unknown)}")
    return Message(op, {"worker": worker, **fields}, arrays if arrays is not None else [])
