"""A push-and-pull between its start and its finish, and its push sent again with ids to a shard that asks.

A step's push names the pull its ids came from instead of sending them
(:mod:`psdk.client.rows`). A shard that does not hold that pull refuses the
push whole, applying nothing (kind ``pull_not_held``), while the other
shards may have applied theirs: the worker sends that shard the same push
again, with its ids, under the same seq and version (the shard checks the
name before it records the seq), so the step lands everywhere once. No path
is known that leads there; were one found, it costs a resend, not the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from psdk.client.rows import ShardTables, with_tables, without_names
from psdk.client.view import ClientView
from psdk.errors import PeerTimeoutError, PsdkError, RemoteError
from psdk.protocol.ops import PULL_NOT_HELD
from psdk.transport import Pending
from psdk.transport.wire import Message

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class InFlight:
    """What a started push-and-pull sent each shard: enough to build its request again."""

    pending: Pending
    grads: dict[int, np.ndarray]
    """Each shard's dense gradient as it left (its long-lived buffer, or the outbox its copy went to)."""
    fields: dict[int, dict[str, Any]]
    """Each shard's version, seq and epoch."""
    parts: dict[int, ShardTables]


def refused_names(replies: dict[int, Message]) -> list[int]:
    """The shards whose reply refused a push for naming a pull they do not hold."""
    return [i for i, reply in replies.items() if reply.op == "error" and reply.fields.get("kind") == PULL_NOT_HELD]


def collect_step(client: ClientView, step: InFlight, wait: Callable[[], T]) -> T | dict[int, Message]:
    """What ``wait`` collects of the step's replies; if one is a ``pull_not_held`` refusal, the replies once the
    refusing shards answered the push sent again with its ids (:func:`resend_with_ids`)."""
    try:
        return wait()
    except RemoteError as exc:
        if exc.kind != PULL_NOT_HELD:
            raise
        return resend_with_ids(client, step)


def resend_with_ids(client: ClientView, step: InFlight) -> dict[int, Message]:
    """The step's replies, with each ``pull_not_held`` refusal replaced by the answer to the push sent again
    with its ids. Any other refusal is raised, as the first collect would have."""
    names, replies = client.names, dict(step.pending.replies)
    refused = refused_names(replies)
    for i, reply in replies.items():
        if reply.op == "error" and i not in refused:
            raise RemoteError(names[i], str(reply.fields.get("error")), str(reply.fields.get("kind")))
    again = {}
    for i in refused:
        log.warning("%s: %s; sending the push again with its ids", names[i], replies[i].fields.get("error"))
        request = client.message("push_pull", [step.grads[i]], **step.fields[i])
        again[i] = with_tables(request, without_names(step.parts.get(i)))
        again[i].stable = True
    options = client.options
    timeout_s = options.transport.request_timeout_s + (options.recovery_timeout_s or 0.0)
    try:  # one wait, as long as a timeout and its wait after: the step's own timeout path has waited already
        replies.update(client.collect(client.endpoint.start_many(again), "a push sent again with its ids", timeout_s))
    except PeerTimeoutError as exc:
        raise PsdkError(f"{exc}: the push sent again with its ids was not answered; nothing was rolled back") from exc
    return replies
