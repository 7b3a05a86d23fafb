"""What a worker's waits on its ps say while they last, and how it gets its worker id back after a restart.

A wait for replies logs, at most every :func:`psdk.runtime.waits.log_every_s`
seconds, which ps it waits for, at which address, for what, how long of how
long, and the likely cause: the transport's diagnosis (nothing listening, a
key mismatch) or, if it has none, what the heartbeats say. Kept apart from
:mod:`psdk.client.client`, whose class is about talking to the shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from psdk.client.view import ClientView
from psdk.errors import ConfigError, PeerTimeoutError, RemoteError
from psdk.protocol import ID_HELD, ID_IN_USE
from psdk.runtime.waits import WaitLog, seconds

log = logging.getLogger("psdk.client.client")
T = TypeVar("T")

QUIET_S = 0.2
"""A wait shorter than this never reads the clock for its lines, so none comes sooner (tests ask for 0.3 s)."""


class ReplyWait:
    """Called on every turn of a wait for replies (``Pending.wait``'s ``report``); logs a line when one is due."""

    def __init__(self, client: ClientView, what: str, timeout_s: float):
        self.client, self.what, self.timeout_s = client, what, timeout_s
        self.clock: WaitLog | None = None  # made at the first turn that matters: most waits end within one
        self.causes: dict[int, str] = {}
        """The cause each line named, by shard: the timeout's error names it again."""

    def __call__(self, pending: list[int], waited_s: float) -> None:
        if self.clock is None:
            if waited_s < QUIET_S:  # nearly every wait: a step's reply is in within milliseconds
                return
            self.clock = WaitLog()
        if self.clock.due(waited_s) is None:
            return
        client = self.client
        for index in pending:
            cause = client.endpoint.diagnose(index)
            if cause:
                self.causes[index] = cause
            else:
                self.causes.pop(index, None)
            level = logging.WARNING if cause else logging.INFO
            log.log(
                level,
                "worker %d: waiting for ps %d at %s (%s): no reply for %s of %s; %s",
                client.task_index,
                index,
                client.addresses[index],
                self.what,
                seconds(waited_s),
                seconds(self.timeout_s),
                cause or self._heartbeats(index),
            )

    def explained(self, timeout: PeerTimeoutError, missing: list[int]) -> PeerTimeoutError:
        """``timeout``, naming the cause the lines named for the shards that did not answer, if any."""
        causes = sorted({self.causes[i] for i in missing if i in self.causes})
        if not causes:
            return timeout
        return PeerTimeoutError(timeout.peer, timeout.what, timeout.waited_s, "; ".join(causes))

    def _heartbeats(self, index: int) -> str:
        heartbeat = self.client.heartbeat
        if heartbeat is None:
            return "it is reachable"
        silence = heartbeat.silence(index)
        if silence is None:
            return "it is reachable, but has not answered a heartbeat yet"
        return f"it answers heartbeats (the last {silence:.1f} s ago)"


def rejoining(client: ClientView, request: Callable[[], T]) -> T:
    """``request``, retried while a ps still holds this worker's previous (dead) connection.

    A restarted worker gets in once the ps has declared its old process
    dead, which takes at most a heartbeat timeout. An id whose holder is
    alive (a second worker started with the same index) is refused at once.
    The ps's error kind tells the two apart (:data:`~psdk.protocol.ID_HELD`,
    :data:`~psdk.protocol.ID_IN_USE`), never the words of its message.
    """
    deadline = time.monotonic() + client.options.transport.heartbeat_timeout_s + 10.0
    clock: WaitLog | None = None
    while True:
        try:
            return request()
        except RemoteError as exc:
            if exc.kind == ID_IN_USE:
                raise ConfigError("task_index", f"{exc.peer} refused this worker: {exc.remote_message}") from None
            if exc.kind != ID_HELD or time.monotonic() > deadline:
                raise
            if clock is None or clock.due() is not None:
                clock = clock or WaitLog()
                log.info(
                    "worker %d: %s still holds this worker's old connection; retrying (%s)",
                    client.task_index,
                    exc.peer,
                    exc.remote_message,
                )
            time.sleep(0.5)
