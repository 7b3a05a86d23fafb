"""Rolling a shard back to a checkpoint, as the chief does after another shard was lost.

When a ps is lost, the chief restores every shard from its latest
checkpoint so the job goes on from one consistent cut (see
:mod:`psdk.client.recovery`). A restore starts a new epoch: a push computed in an
older one belongs to the abandoned timeline and is answered "resync".
"""

from __future__ import annotations

import logging

from psdk.errors import RefusedError
from psdk.ps.consistency import make_policy
from psdk.ps.shard import ServedShard, restore_state, take_finished
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
    store.reset(dict(zip(names, message.arrays, strict=False)), restore)
    take_finished(shard.membership, message.fields.get("finished"), shard.job.num_workers)
    shard.epoch = message.fields["epoch"]
    why = f"the chief restored the job at version {restore.version} (restore epoch {shard.epoch})"
    stale = [(p.peer, p.rid) for p in [*shard.policy.release_parked(), *pause.pushes]]
    pause.pushes.clear()
    stale += pause.end()
    shard.policy = make_policy(store, shard.job.sync, shard.membership.live)
    log.warning("%s: %s", shard.name, why)
    shard.outbox.send(peer, message.rid, "ok", shard.layout())
    for stale_peer, rid in stale:
        shard.resync(stale_peer, rid, why)
