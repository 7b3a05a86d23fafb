"""The one way a reply leaves a ps: each counted, errors capped, a reply too big to send answered in words.

Every part of the ps answers through one :class:`Outbox`, so the ps's books
(``requests == replies + unanswerable + parked``, which the stateful fuzzer
checks after every step) hold whichever part answered.
"""

from __future__ import annotations

import logging
from typing import Any

from psdk.errors import ProtocolError
from psdk.ps.stats import ShardStats
from psdk.runtime.logs import RateLimitedLog
from psdk.transport import ServerEndpoint
from psdk.transport.wire import Message

log = logging.getLogger("psdk.ps.server")

MAX_ERROR_CHARS = 1000
"""An error reply quotes at most this much (a refusal may quote what the peer sent)."""


class Outbox:
    def __init__(self, endpoint: ServerEndpoint, stats: ShardStats, name: str):
        self.endpoint, self.stats, self.name = endpoint, stats, name
        self.rejections = RateLimitedLog(log)
        self.internal_errors = RateLimitedLog(log)

    def send(self, peer: bytes, rid: int, op: str, fields: dict[str, Any], arrays: list[Any] | None = None) -> None:
        self.deliver(peer, Message(op, fields, arrays if arrays is not None else [], rid))

    def deliver(self, peer: bytes, message: Message) -> None:
        """Send ``message``; one too big for the wire (say, stats of very many workers) becomes an error saying so."""
        try:
            self.endpoint.reply(peer, message)
        except ProtocolError as exc:
            self.internal_errors.warning("%s: the %s reply could not be sent: %s", self.name, message.op, exc)
            text = f"{self.name} could not send its {message.op} reply: {exc}"[:MAX_ERROR_CHARS]
            message = Message("error", {"error": text, "kind": "internal"}, [], message.rid)
            self.endpoint.reply(peer, message)
        self.stats.replies[message.op] += 1

    def error(self, peer: bytes, rid: int, text: str, kind: str = "error") -> None:
        if len(text) > MAX_ERROR_CHARS:
            text = text[:MAX_ERROR_CHARS] + "…"
        self.send(peer, rid, "error", {"error": text, "kind": kind})

    def reject(self, peer: bytes, op: str, rid: int, text: str, kind: str = "rejected") -> None:
        """A request that broke the protocol or the shard's rules: nothing changed, the sender is told (as ``kind``)."""
        self.stats.rejected += 1
        self.rejections.warning("%s: rejected %.64s: %.300s", self.name, op, text)
        self.error(peer, rid, text, kind)

    def internal_error(self, peer: bytes, rid: int, what: str, exc: BaseException) -> None:
        """A bug met while answering: logged (rate-limited) and answered, so the serving loop goes on."""
        self.internal_errors.exception("%s: internal error %s", self.name, what)
        self.error(peer, rid, f"internal error in {self.name}: {exc!r}", "internal")
