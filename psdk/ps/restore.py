"""Rolling a shard back to a checkpoint, as the chief does after another shard was lost.

When a ps is lost, the chief restores every shard from its latest
checkpoint so the job goes on from one consistent cut (see
:mod:`psdk.client.recovery`). A restore starts a new epoch: a push computed in an
older one belongs to the abandoned timeline and is answered "resync".
"""

from __future__ import annotations

import logging

from psdk.errors import ProtocolError, RefusedError
from psdk.ps.consistency import make_policy
from psdk.ps.shard import ServedShard, restore_state, take_finished
from psdk.ps.tables.chunks import restores_of
from psdk.transport.wire import Message

log = logging.getLogger("psdk.ps.server")


def on_restore(shard: ServedShard, peer: bytes, message: Message) -> None:
    """The chief rolls ``shard`` back to a checkpoint after another shard was lost.

    Every push waiting there (a sync round, a pause, bounded staleness) is
    answered "resync": its gradient belongs to the abandoned timeline.
    """
    shard.require_init()
    assert shard.job is not None and shard.policy is not None
    store, pause = shard.store, shard.pause
    names = [s.name for s in store.specs]
    if message.fields["names"] != names:
        raise RefusedError(f"restore must name this shard's variables {names}")
    restore = restore_state(message.fields["restore"], names, message.arrays)
    assert restore is not None  # the protocol declares the field an object
    table_restores = restores_of(message.fields["restore"], store.tables)  # checked before anything changes
    store.reset(dict(zip(names, message.arrays, strict=False)), restore)
    for pending in table_restores.values():
        # The rows roll back too, and nothing reads them until the commit: dropped now, the restore stages the
        # checkpoint's rows beside an empty table, not beside these (one table's memory at a time, not two).
        pending.table.rows.clear()
    shard.table_restores = table_restores
    shard.limit_incoming()
    take_finished(shard.membership, message.fields.get("finished"), shard.job.num_workers)
    shard.epoch = message.fields["epoch"]
    shard.named_pulls.forget()  # pulled from the abandoned timeline: no push after the restore names them
    why = f"the chief restored the job at version {restore.version} (restore epoch {shard.epoch})"
    stale = [(p.peer, p.rid) for p in [*shard.policy.release_parked(), *pause.pushes]]
    pause.pushes.clear()
    stale += pause.end()
    shard.policy = make_policy(store, shard.job.sync, shard.membership.live)
    log.warning("%s: %s", shard.name, why)
    shard.outbox.send(peer, message.rid, "ok", shard.layout())
    for stale_peer, rid in stale:
        shard.resync(stale_peer, rid, why)


def on_table_restore(shard: ServedShard, peer: bytes, message: Message) -> None:
    """One chunk of a table restore the chief's init announced, or its commit (see :mod:`psdk.ps.tables.chunks`).

    A chunk number already taken is acknowledged (``again``) and not loaded
    twice: the chief may send a chunk again when a reply was lost. Once the
    last announced table commits, the workers waiting for the job get it.
    """
    shard.require_init()
    fields = message.fields
    name = fields["table"]
    pending = shard.table_restores.get(name)
    if pending is None:
        raise RefusedError(
            f"table {name!r} is not being restored: table_restore follows an init whose restore.tables names it"
        )
    reply = {"table": name, "chunk": fields["chunk"], "again": False, "committed": False}
    if fields["part"] == "commit":
        if message.arrays:
            raise ProtocolError("a commit carries no arrays")
        rows = pending.commit(fields.get("counters"))
        del shard.table_restores[name]
        log.info("%s: table %r restored: %d rows", shard.name, name, rows)
        shard.outbox.send(peer, message.rid, "chunk_taken", {**reply, "rows": rows, "committed": True})
        if not shard.table_restores:
            shard.limit_incoming()  # back to what pushes need: no more chunks come
            shard.release_init_waiters()
        return
    if fields["chunk"] in pending.taken:
        reply["again"] = True
    else:
        pending.take(fields, message.arrays, shard.store.rule)
        pending.taken.add(fields["chunk"])
    shard.outbox.send(peer, message.rid, "chunk_taken", {**reply, "rows": len(pending.staging)})
