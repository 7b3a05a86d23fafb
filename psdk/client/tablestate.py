"""The chief's side of tables in checkpoints: chunks streamed into the file while paused, restored by placement.

**Checkpoint.** While every shard holds the checkpoint pause, the chief
asks each for its tables one chunk at a time (``table_state``: rows from a
slot cursor, then the admission sketch) and writes each chunk into the
checkpoint file at once (:class:`~psdk.client.tablefile.CheckpointWriter`):
it holds at most one chunk per shard, never a table.

**Restore.** After the ``init`` that announced them, each saved chunk is
cut by the *new* placement (:func:`~psdk.protocol.tables.shard_of_ids` with
the new number of ps), sorted, and sent to the shards in pieces of at most
``chunk_rows`` rows (``table_restore``); each shard commits once it has all
its rows. So a job resumed on another number of ps re-shards its rows. The
admission sketch counts ids, not shards: with the same placement each shard
gets its own sketch back; otherwise every shard gets the sum of the saved
shards' sketches (each id was counted on one shard only, so the sum's
estimate of any id is still at least its count), and the counters restart
(clock: the largest saved, evicted: 0, created: the rows it holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from psdk.client.checkpoint import Checkpoint
from psdk.client.options import ClientOptions
from psdk.client.tablefile import SLOT, CheckpointWriter, TableChunks
from psdk.errors import CheckpointAbandoned, PeerTimeoutError, PsdkError
from psdk.protocol.chunks import SKETCH_DEPTH, SKETCH_WIDTH, as_wire, from_wire, sketch_piece
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.transport.wire import Message

log = logging.getLogger("psdk.client.client")


class Asking(Protocol):
    """What the chief's table steps use of the client (both :class:`Requests` and the recovery's view have it)."""

    names: list[str]

    def message(self, op: str, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message: ...

    def request(
        self, messages: Mapping[int, Message], what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]: ...


DEFAULT_CHUNK_ROWS = 1 << 14
"""Rows per chunk unless ``ClientOptions.table_chunk_rows`` says otherwise: 16384 rows of dim 64 with two
slots are 12 MiB."""


def read_tables(
    client: Asking,
    shards: Sequence[int],
    tables: Mapping[str, TableSpec],
    writer: CheckpointWriter,
    version: int,
    chunk_rows: int,
) -> None:
    """Every table's chunks from every shard into ``writer``; each shard must still be paused at ``version``."""
    for name, spec in tables.items():
        for part in ("rows", "sketch"):
            cursors: dict[int, int] = {index: 0 for index in shards}
            while cursors:
                messages = {
                    index: client.message("table_state", table=name, part=part, cursor=cursor, rows=chunk_rows)
                    for index, cursor in cursors.items()
                }
                replies = client.request(messages, f"table {name!r} for a checkpoint")
                for index, reply in replies.items():
                    fields = reply.fields
                    if int(fields["version"]) != version:  # a pause lapsed between the reads
                        raise CheckpointAbandoned(
                            f"{client.names[index]} was at version {fields['version']}, not {version}, when "
                            f"table {name!r} was read: the checkpoint would not be a consistent cut"
                        )
                    if name not in writer.tables:
                        writer.table(spec, len(shards), [str(s) for s in fields["slots"]], chunk_rows)
                    _take(writer, name, index, part, fields, reply.arrays, cursors[index])
                    following = fields["next"]
                    if following is None:
                        del cursors[index]
                    else:
                        cursors[index] = int(following)


def _take(
    writer: CheckpointWriter, name: str, shard: int, part: str, fields: Mapping[str, Any], arrays: list[np.ndarray],
    cursor: int,
) -> None:  # fmt: skip
    if part == "rows":
        if cursor == 0:
            writer.header(name, shard, fields["config"], fields["counters"])
        keys = ["ids", "rows", "last_used", *(SLOT + str(s) for s in fields["slots"])]
        if len(arrays) != len(keys):
            raise PsdkError(f"a ps sent {len(arrays)} arrays for a chunk of table {name!r}, not {len(keys)}")
        if len(arrays[0]):
            chunk = dict(zip(keys, arrays, strict=True))
            writer.rows(name, shard, {**chunk, "last_used": from_wire(chunk["last_used"])})
    elif len(arrays) == 1 and len(arrays[0]):
        writer.sketch(name, shard, cursor, from_wire(arrays[0]))


# ------------------------------------------------------------------ restore
def check_tables(restore: Checkpoint | None, tables: Sequence[TableSpec], slot_names: Sequence[str]) -> list[TableSpec]:
    """The tables to restore; a resume whose tables do not fit the checkpoint's is refused before anything is sent."""
    saved = restore.tables if restore is not None else None
    if saved is None:
        return []
    declared = {spec.name: spec for spec in tables}
    missing = sorted(set(saved.names) - set(declared))
    if missing:
        raise PsdkError(
            f"the checkpoint holds embedding tables {missing} that this job does not declare: declare them "
            "(tables=) to resume their rows"
        )
    for name in saved.names:
        old, new = saved.specs[name], declared[name]
        if old.dim != new.dim:
            raise PsdkError(f"table {name!r} has dim {old.dim} in the checkpoint but {new.dim} in this job")
        if sorted(saved.slots(name)) != sorted(slot_names):
            raise PsdkError(
                f"table {name!r} keeps slots {saved.slots(name)} in the checkpoint but this job's update rule "
                f"keeps {sorted(slot_names)}: resume with the checkpoint's optimizer"
            )
    return [spec for spec in tables if spec.name in saved.names]


def announce(messages: Mapping[int, Message], restored: Sequence[TableSpec], chunk_rows: int) -> None:
    """The init names the tables its restore goes on with: the shards hold their workers until they commit."""
    if restored:
        for message in messages.values():
            message.fields["restore"].update(tables=[spec.name for spec in restored], chunk_rows=chunk_rows)


def same_placement(old: TableSpec, old_num_ps: int, new: TableSpec, new_num_ps: int) -> bool:
    """Whether every id lands on the shard it was saved from."""
    if old.sharding != new.sharding or old_num_ps != new_num_ps:
        return False
    return old.sharding == "hash" or old.shard_capacity(old_num_ps) == new.shard_capacity(new_num_ps)


class ChunkSender:
    """One table's ``table_restore`` requests, numbered per shard; a round lost to a timeout is sent once more."""

    def __init__(self, client: Asking, name: str, num_ps: int, slots: list[str], chunk_rows: int) -> None:
        self.client, self.name, self.num_ps, self.slots, self.chunk_rows = client, name, num_ps, slots, chunk_rows
        self.numbers = [0] * num_ps
        self.sent = [0] * num_ps
        """Rows sent to each shard."""

    def send(self, pieces: Mapping[int, list[tuple[dict[str, Any], list[np.ndarray]]]]) -> None:
        """Each shard's pieces (fields, arrays), one per shard per round trip."""
        queues = {shard: list(queue) for shard, queue in pieces.items() if queue}
        while queues:
            batch = {shard: queue.pop(0) for shard, queue in queues.items()}
            numbers = {shard: self.numbers[shard] for shard in batch}

            def build(batch: dict[int, Any] = batch, numbers: dict[int, int] = numbers) -> dict[int, Message]:
                return {
                    shard: self.client.message(
                        "table_restore", list(arrays), table=self.name, chunk=numbers[shard], **fields
                    )
                    for shard, (fields, arrays) in batch.items()
                }

            _with_retry(self.client, build, f"restoring table {self.name!r}")
            for shard in batch:
                self.numbers[shard] += 1
            queues = {shard: queue for shard, queue in queues.items() if queue}

    def rows(self, spec: TableSpec, chunk: Mapping[str, np.ndarray]) -> None:
        """One saved chunk, cut by the new placement, sorted by id, in pieces of at most ``chunk_rows``."""
        order = np.argsort(chunk["ids"], kind="stable")
        ids = chunk["ids"][order]
        try:
            where = shard_of_ids(spec, ids, self.num_ps)
        except ValueError as exc:
            raise PsdkError(f"the checkpoint's rows do not fit this job's table {self.name!r}: {exc}") from None
        keys = ["rows", "last_used", *(SLOT + slot for slot in self.slots)]
        pieces: dict[int, list[tuple[dict[str, Any], list[np.ndarray]]]] = {}
        for shard in range(self.num_ps):
            mine = order[where == shard]
            for start in range(0, len(mine), self.chunk_rows):
                take = mine[start : start + self.chunk_rows]
                arrays = [np.ascontiguousarray(chunk[k][take]) for k in ("ids", *keys)]
                arrays[2] = as_wire(arrays[2])
                pieces.setdefault(shard, []).append(({"part": "rows", "slots": self.slots}, arrays))
                self.sent[shard] += len(take)
        self.send(pieces)

    def commit(self, counters: Mapping[int, list[int]]) -> None:
        commits: dict[int, list[tuple[dict[str, Any], list[np.ndarray]]]] = {
            shard: [({"part": "commit", "counters": counters[shard]}, [])] for shard in range(self.num_ps)
        }
        self.send(commits)


def _with_retry(client: Asking, build: Callable[[], dict[int, Message]], what: str) -> dict[int, Message]:
    """One round of requests, sent again once if it timed out: the ps takes a chunk number only once."""
    try:
        return client.request(build(), what)
    except PeerTimeoutError:
        return client.request(build(), what + " (again, after a timeout)")


def restore_tables(
    client: Asking, saved: TableChunks, tables: Sequence[TableSpec], num_ps: int, chunk_rows: int
) -> dict[str, list[int]]:
    """Every saved table's rows, slots, stamps and sketch onto the shards by the new placement; rows per shard."""
    restored: dict[str, list[int]] = {}
    for spec in tables:
        name = spec.name
        if name not in saved.names:
            continue
        old, old_num_ps, shards = saved.specs[name], saved.num_ps(name), saved.shards(name)
        same = same_placement(old, old_num_ps, spec, num_ps)
        sender = ChunkSender(client, name, num_ps, saved.slots(name), chunk_rows)
        for _, chunk in saved.rows(name):
            sender.rows(spec, chunk)
        if spec.admit_after:
            _send_sketch(sender, saved, name, spec, same)
        clock = max((int(shard["counters"][0]) for shard in shards), default=0)
        counters = {}
        for shard in range(num_ps):
            rows = sender.sent[shard]
            if same:
                clock_s, evicted, created = (int(c) for c in shards[shard]["counters"][:3])
                counters[shard] = [clock_s, evicted, created, rows]
            else:
                counters[shard] = [clock, 0, rows, rows]
        sender.commit(counters)
        restored[name] = list(sender.sent)
    log.info("worker 0: tables restored from the checkpoint (rows per shard): %s", restored)
    return restored


def finish_restore(
    client: Asking, saved: TableChunks, tables: Sequence[TableSpec], fresh: bool, num_ps: int, options: ClientOptions
) -> None:
    """After the ``init`` that announced them, the tables' chunks; also for a chief restarted mid-restore.

    That chief's ``init`` is answered "already", and the shards still wait
    for the rest of the restore (their status names the tables): the chunks
    go again (a shard acknowledges a chunk number it has) and the commit ends
    it, instead of the workers waiting out their timeout.
    """
    if not fresh:
        replies = client.request({i: client.message("status") for i in range(num_ps)}, "the shards' restores")
        if not any(reply.fields.get("restoring") for reply in replies.values()):
            return
        log.warning("worker 0: the shards wait for the rest of a table restore (a chief died in it): sending it")
    restore_tables(client, saved, tables, num_ps, options.table_chunk_rows)


def _send_sketch(sender: ChunkSender, saved: TableChunks, name: str, spec: TableSpec, same: bool) -> None:
    """Each shard's admission counts: its own when the placement is unchanged, else the sum of every saved shard's."""
    shards = saved.shards(name)
    saved_shape = [(int(s["config"][1]), int(s["config"][2])) for s in shards]
    has_sketch = any(depth for depth, _ in saved_shape)
    if has_sketch and saved_shape[0] != (SKETCH_DEPTH, SKETCH_WIDTH):
        raise PsdkError(f"table {name!r} was saved with a {saved_shape[0]} sketch, this job's is "
                        f"{(SKETCH_DEPTH, SKETCH_WIDTH)}")  # fmt: skip
    size = SKETCH_DEPTH * SKETCH_WIDTH
    step = sketch_piece(spec.dim, len(sender.slots), sender.chunk_rows)
    pieces: dict[int, list[tuple[dict[str, Any], list[np.ndarray]]]] = {}
    if same and has_sketch:
        for shard in range(sender.num_ps):
            for offset, piece in saved.sketch(name, shard):
                for start in range(0, len(piece), step):
                    part = as_wire(np.ascontiguousarray(piece[start : start + step]))
                    pieces.setdefault(shard, []).append(({"part": "sketch", "offset": offset + start}, [part]))
            sender.send(pieces)
            pieces = {}
        return
    total = np.zeros(size, np.uint64)  # fixed: the sketch's size, whatever the rows
    if has_sketch:
        for shard in range(len(shards)):
            for offset, piece in saved.sketch(name, shard):
                total[offset : offset + len(piece)] += piece
    summed = np.minimum(total, np.iinfo(np.uint32).max).astype(np.uint32)
    for start in range(0, size, step):
        part = as_wire(summed[start : start + step])
        sender.send({shard: [({"part": "sketch", "offset": start}, [part])] for shard in range(sender.num_ps)})
