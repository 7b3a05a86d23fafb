"""A worker's side of shared memory: its shard buffers offered to a ps on the same host (see :mod:`psdk.shm`).

A shard whose ps takes the offer gets its gradient read in place and its
parameters written back, and, with doorbells, its push and reply never cross
the socket; a refusal (another host, a ps with ``transport.shared_memory=false``,
no memfd) leaves that shard on plain frames.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from psdk.client.shards import Requests, Shard
from psdk.errors import RemoteError
from psdk.shm import WorkerBuffers
from psdk.transport import ClientEndpoint

log = logging.getLogger("psdk.client")


def new_buffers(endpoint: ClientEndpoint, size: int, worker: int) -> WorkerBuffers | None:
    if not (endpoint.shares_memory and size):
        return None
    try:
        return WorkerBuffers(size)
    except OSError as exc:  # e.g. a memfd limit: plain frames work as well, only slower
        log.info("worker %d: no shared memory for a shard (%s); its arrays go over ZeroMQ", worker, exc)
        return None


def offer_memory(client: Requests, endpoint: ClientEndpoint, shards: Sequence[Shard]) -> None:
    """Offer every ps the shard buffers it can map (it must be on this host); the rest use frames.

    Called again after a recovery: a restarted ps has to map them anew.
    """
    bell = endpoint.doorbells
    offers = {
        i: client.message("attach", **shard.buffers.offer(bell))
        for i, shard in enumerate(shards)
        if shard.buffers is not None and shard.size
    }
    if not offers:
        return
    try:
        replies = client.request(offers, "sharing memory with the ps")
    except RemoteError as exc:  # e.g. a ps of an older psdk that does not know the request
        log.info("worker %d: no shared memory (%s); arrays go over ZeroMQ", client.task_index, exc)
        replies = {}
    for index in offers:
        shards[index].shared = shards[index].knocks = False
        endpoint.ring_off(index)
    for index, reply in replies.items():
        shard = shards[index]
        shard.shared = reply.op == "attached"
        if shard.shared and bell and reply.fields.get("bell") and shard.buffers is not None:
            endpoint.ring_on(index, shard.buffers.bell, shard.buffers.take_reply)
            shard.knocks = bool(reply.fields.get("knock"))
            if shard.knocks:
                shard.buffers.knocks_heard()
        if not shard.shared:
            log.info(
                "worker %d: %s does not share memory (%s); arrays go over ZeroMQ",
                client.task_index,
                client.names[index],
                reply.fields.get("error"),
            )


def release_buffers(endpoint: ClientEndpoint, shards: Sequence[Shard]) -> None:
    for index, shard in enumerate(shards):
        if shard.buffers is not None:
            endpoint.ring_off(index)
            shard.buffers.close()
            shard.shared = shard.knocks = False
