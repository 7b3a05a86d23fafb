"""Which connection speaks for each worker id, and which workers are alive.

A worker's sockets carry a random routing id (its heartbeat socket the same
one plus ``/hb``). The ps binds each worker id to the connection that first
used it and refuses the id from any other, so a request that claims to come
from a worker but arrives on another connection, such as a replayed or
forged one, is refused before it can touch the store. A worker that died
may come back on a new connection: :meth:`Sessions.bind` says so, and the ps
forgets what belonged to the old process (its push counter, what it lent
the transport, a pause its chief held).

A second process started with an id in use is refused at once, with the
error kind :data:`~psdk.protocol.ID_IN_USE`, while the holder is alive: its
connection is open and it was heard from lately. A holder that died is not:
its connection closed with it (a host that died leaves it open, but silent),
and the new process is refused with :data:`~psdk.protocol.ID_HELD`, which
tells it to retry until the heartbeat timeout makes the old one dead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from psdk.errors import RefusedError
from psdk.protocol import ID_HELD, ID_IN_USE
from psdk.ps.membership import Membership
from psdk.transport.wire import HEARTBEAT_SUFFIX

log = logging.getLogger("psdk.ps.server")

IN_USE = "is in use by a running process"
"""What the refusal of an id whose holder is alive says, in words for the user (the worker reads its kind)."""


def session_of(peer: bytes) -> bytes:
    """The worker connection a peer id belongs to (its heartbeat socket's id names the same session)."""
    return peer.removesuffix(HEARTBEAT_SUFFIX)


class Sessions:
    def __init__(
        self,
        name: str,
        membership: Membership,
        max_workers: int,
        connected: Callable[[bytes], bool | None] = lambda peer: None,
    ):
        self.name = name
        self.connected = connected
        """Whether a peer's connection is still open (the transport's ``connected``)."""
        self.membership = membership
        self.max_workers = max_workers
        """Worker ids this ps accepts, before and after init (a per-task ps: the length of worker_hosts)."""
        self.by_worker: dict[int, bytes] = {}

    def check_id(self, worker: int, num_workers: int | None) -> None:
        """Refuse an id outside the job (once known) or beyond what this ps serves."""
        if num_workers is not None and worker >= num_workers:
            raise RefusedError(f"worker {worker} is not in this job ({num_workers} workers)")
        if worker >= self.max_workers:
            raise RefusedError(f"worker {worker} is beyond the {self.max_workers} workers this ps serves")

    def bind(self, worker: int, peer: bytes, now: float) -> bytes | None:
        """Accept ``peer`` as ``worker``'s connection; the old one's when it is a new process of a worker that died."""
        session = session_of(peer)
        known = self.by_worker.get(worker)
        if known == session:
            return None
        if known is not None and not self.membership.gone(worker, now):
            raise self._refusal(worker, known, now)
        self.by_worker[worker] = session
        if known is not None:
            log.info("%s: worker %d is back on a new connection", self.name, worker)
        return known

    def _refusal(self, worker: int, holder: bytes, now: float) -> RefusedError:
        """Why ``worker``'s id is refused to a new connection: in use (give up), or held by a process that died."""
        silent = self.membership.silent_for(worker, now)
        timeout = self.membership.heartbeat_timeout_s
        if silent is not None and silent < timeout / 2 and self.connected(holder):
            return RefusedError(
                f"worker {worker} is already connected from another session: not accepted; worker index {worker} "
                f"{IN_USE} (its connection is open and it was heard from {silent:.1f} s ago): every worker needs "
                "its own task index",
                ID_IN_USE,
            )
        heard = "never heard from" if silent is None else f"silent for {silent:.1f} s"
        return RefusedError(
            f"worker {worker} is already connected from another session: not accepted until that one ({heard}) "
            f"has been silent for transport.heartbeat_timeout_s={timeout:g} s",
            ID_HELD,
        )

    def current(self, worker: int, peer: bytes) -> bool:
        """Whether ``peer`` is the connection of ``worker``'s current process."""
        return self.by_worker.get(worker) == session_of(peer)

    def forget_beyond(self, num_workers: int) -> None:
        """Ids claimed before the chief said how many workers the job has."""
        for stray in [w for w in self.by_worker if w >= num_workers]:
            del self.by_worker[stray]
            self.membership.forget(stray)
