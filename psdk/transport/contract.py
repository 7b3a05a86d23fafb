"""The transport contract: request/response of named-array messages between tasks.

A ps serves a :class:`ServerEndpoint`; a worker holds one
:class:`ClientEndpoint` that talks to every ps shard at once, so a step's
requests to all shards are in flight together. Request ids match replies to
requests: a reply that arrives after its request gave up is dropped, never
read as the answer to the next one. Fault-injecting transports for tests wrap
these classes rather than patching sockets.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from psdk.errors import PeerDeadError, PeerRestartedError, PeerTimeoutError, ProtocolError
from psdk.runtime.liveness import beat
from psdk.transport.wire import Message

# How often a waiting client wakes to check deadlines and peer liveness.
WAIT_SLICE_S = 0.05


def worker_name(index: int) -> str:
    """The user a transport that authenticates reports for worker ``index`` (see :attr:`Incoming.user`)."""
    return f"worker-{index}"


@dataclass
class Incoming:
    """A request as a server sees it: who sent it, and the message or why it was bad."""

    peer: bytes
    message: Message | None
    error: ProtocolError | None = None
    rid: int | None = None
    nbytes: int = 0
    user: str | None = None
    """Who the transport authenticated the sender as (:func:`worker_name`), if it authenticates."""


class ServerEndpoint(ABC):
    """The bound side, owned by one ps task."""

    address: str

    @abstractmethod
    def receive(self, timeout_s: float) -> Incoming | None:
        """The next request, or ``None`` when nothing came within ``timeout_s``.

        A request's float arrays may be :attr:`~psdk.transport.wire.Message.borrowed`:
        views of memory the sender lent, valid until it has the reply. Its
        integer arrays (ids, which the ps indexes with) are always its own.
        """

    def lent_memory(self, peer: bytes) -> bool:
        """Whether ``peer`` lent this endpoint memory that an ``in_place`` reply's array is written into.

        Then :meth:`reply` copies that array during the call and the caller
        need not keep it unchanged (see :attr:`~psdk.transport.wire.Message.in_place`).
        """
        return False

    def reply_room(self, peer: bytes, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays of ``shapes``, in ``peer``'s lent memory, for the arrays after the first of the
        ``in_place`` reply to request ``rid``; ``None``: this endpoint has none (build them anywhere).

        The ps fills them (a pull's rows gathered straight in) and replies
        with them before any other reply to ``peer``; :meth:`reply` then
        copies nothing of theirs. Unused, they cost nothing.
        """
        return None

    def connected(self, peer: bytes) -> bool | None:
        """Whether ``peer``'s connection is still open (its process is alive); ``None``: this transport cannot tell.

        A ps asks before it refuses a worker id held by another connection:
        a holder whose connection closed is a process that died (see :mod:`psdk.ps.sessions`).
        """
        return None

    def forget(self, peer: bytes) -> None:  # noqa: B027 - nothing to let go without lent memory
        """``peer`` is gone for good (finished, or replaced by a new process): let go what it lent."""

    @abstractmethod
    def reply(self, peer: bytes, message: Message) -> bool:
        """Send ``message`` to ``peer``; ``False`` when the peer is gone.

        Raises :class:`~psdk.errors.ProtocolError` when ``message`` cannot be
        put on the wire (a header over the reply limit): nothing was sent.
        """

    def limit_incoming(self, largest_message: int, total: int) -> None:  # noqa: B027 - unbounded peers only
        """Refuse messages over ``largest_message`` bytes, and hold at most ``total`` bytes for all peers together.

        A ps calls it once it knows its job's sizes; an endpoint whose peers
        cannot send it anything unbounded (threads of the same process) may
        ignore it.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the socket at once (linger 0)."""


@dataclass(frozen=True)
class ShardBuffers:
    """A client's float32 buffers for one server's arrays: a transport may lend them to that server.

    ``grads`` is where a gradient is computed; ``outbox`` holds a copy sent
    while the next is computed into ``grads``; ``params`` is where replies'
    arrays land when the transport writes them in place. A request whose
    one array *is* ``grads`` or ``outbox`` may then travel without it, and
    a reply's array may arrive as ``params`` itself.
    """

    grads: np.ndarray
    outbox: np.ndarray
    params: np.ndarray

    @classmethod
    def private(cls, size: int) -> ShardBuffers:
        return cls(*(np.zeros(size, np.float32) for _ in range(3)))


class ClientEndpoint(ABC):
    """The connecting side: one logical link to each of several servers."""

    peers: Sequence[str]
    """Human-readable names of the servers, by index, for error messages."""

    def __init__(self) -> None:
        self._next_rid = 1
        self._waiting: weakref.WeakSet[Pending] = weakref.WeakSet()
        self._strays: dict[tuple[int, int], Message] = {}
        """Replies that arrived while another request was waited for, kept for the pending that still waits for
        them (a slow step's reply during the status check after its timeout); none for an abandoned one."""

    def keep_stray(self, index: int, message: Message) -> None:
        """A reply the current wait did not ask for: kept if a pending still alive waits for it, else dropped."""
        awaited = {(i, rid) for p in self._waiting for i, rid in p.expected.items() if i not in p.replies}
        self._strays = {key: kept for key, kept in self._strays.items() if key in awaited}
        if (index, message.rid) in awaited:
            self._strays[(index, message.rid)] = message

    def take_strays(self, pending: Pending) -> None:
        """Into ``pending``, the replies it waits for that arrived while another request was waited for."""
        if not self._strays:  # the usual case: every wait takes its own replies
            return
        for index, rid in pending.expected.items():
            if index not in pending.replies and (index, rid) in self._strays:
                pending.replies[index] = self._strays.pop((index, rid))

    def buffers(self, index: int, size: int, extra_bytes: int = 0, extra_arrays: int = 0) -> ShardBuffers:
        """Buffers for server ``index``'s arrays of ``size`` floats, replacing any it had.

        A transport that can lends them to the server (memory it maps,
        on the same host); any other gets private ones. ``extra_bytes`` and
        ``extra_arrays``: what a request's arrays after its first (a push's
        table ids and rows) take at most, and its reply's: a transport may
        lend room for those too.
        """
        return ShardBuffers.private(size)

    def room(self, index: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays of ``shapes`` in memory lent to server ``index``, for the next push's arrays after its
        first (its row gradients) to be written where they travel from: sent in it, they are not copied. ``None``:
        nothing to lend just now (write them anywhere). Theirs until the next push from the shard's long-lived
        buffers (a ``stable`` message: a step's) leaves for that server, whether it sends them or not."""
        return None

    def renew(self, index: int) -> None:  # noqa: B027 - nothing was lent
        """Server ``index`` is a new process: lend it again what its old self had."""

    def sharing(self, index: int) -> str:
        """How arrays travel to server ``index`` just now, in words (for logs and tests)."""
        return "frames"

    def diagnose(self, index: int) -> str | None:
        """Why server ``index`` may not answer, in words (nothing listening, a key mismatch); ``None``: no known
        reason. Asked when a wait has lasted a while (see :mod:`psdk.runtime.waits`), never on a hot path."""
        return None

    def new_rid(self) -> int:
        rid = self._next_rid
        self._next_rid += 1
        return rid

    @abstractmethod
    def send(self, index: int, message: Message, wait_s: float | None = None) -> None:
        """Queue ``message`` (with its rid already set) for server ``index``.

        With no connection to that server just now, wait for one at most
        ``wait_s`` (default: the transport's own patience) before raising
        :class:`~psdk.errors.PeerTimeoutError`.
        """

    @abstractmethod
    def receive(self, timeout_s: float) -> list[tuple[int, Message]]:
        """Replies that arrived within ``timeout_s``, tagged with their server index."""

    @abstractmethod
    def close(self) -> None:
        """Release the sockets at once (linger 0)."""

    def request_many(
        self,
        requests: Mapping[int, Message],
        timeout_s: float,
        what: str,
        silence_s: Callable[[int], float | None] | None = None,
        dead_after_s: float | None = None,
    ) -> dict[int, Message]:
        """Send one request to each server in ``requests`` and wait for every reply.

        Gives up after ``timeout_s``, or as soon as a server we still wait
        for has been silent (per ``silence_s``, fed by heartbeats) for longer
        than ``dead_after_s``; either way the error names that server.
        """
        return self.start_many(requests).wait(timeout_s, what, silence_s, dead_after_s)

    def start_many(self, requests: Mapping[int, Message]) -> Pending:
        """Send the requests now; collect the replies later with :meth:`Pending.wait`."""
        expected: dict[int, int] = {}
        for index, message in requests.items():
            message.rid = self.new_rid()
            expected[index] = message.rid
            self.send(index, message)
        pending = Pending(self, expected)
        self._waiting.add(pending)
        return pending

    def request(self, index: int, message: Message, timeout_s: float, what: str) -> Message:
        return self.request_many({index: message}, timeout_s, what)[index]

    def _names(self, indices: Sequence[int]) -> str:
        return ", ".join(self.peers[i] for i in indices)


class Pending:
    """Requests in flight, one per server, whose replies have not been collected yet."""

    def __init__(self, endpoint: ClientEndpoint, expected: dict[int, int]):
        self.endpoint = endpoint
        self.expected = expected
        self.replies: dict[int, Message] = {}
        """Replies collected so far: a wait that gave up can be waited on again without losing them."""

    def wait(
        self,
        timeout_s: float,
        what: str,
        silence_s: Callable[[int], float | None] | None = None,
        dead_after_s: float | None = None,
        restarted: Callable[[int], bool] | None = None,
        report: Callable[[list[int], float], None] | None = None,
    ) -> dict[int, Message]:
        """Every reply, or an error naming the server that did not answer (see ``request_many``).

        ``restarted(index)`` tells when a server came back as a new process:
        a request to its old self will never be answered. ``report(pending,
        waited_s)`` is called on every turn of the wait, to say what it waits
        for once that lasts (see :mod:`psdk.runtime.waits`).
        """
        endpoint, expected, replies = self.endpoint, self.expected, self.replies
        endpoint.take_strays(self)
        start = time.monotonic()
        deadline = start + timeout_s
        while len(replies) < len(expected):
            beat()  # waiting on the network is not being hung (psdk.runtime.liveness)
            now = time.monotonic()
            pending = [i for i in expected if i not in replies]
            if now >= deadline:
                raise PeerTimeoutError(endpoint._names(pending), what, now - start)
            if silence_s is not None and dead_after_s is not None:
                for index in pending:
                    silent = silence_s(index)
                    if silent is not None and silent > dead_after_s:
                        raise PeerDeadError(endpoint.peers[index], what, silent)
            if restarted is not None:
                for index in pending:
                    if restarted(index):
                        raise PeerRestartedError(endpoint.peers[index], what)
            if report is not None:
                report(pending, now - start)
            for index, message in endpoint.receive(min(WAIT_SLICE_S, deadline - now)):
                if expected.get(index) == message.rid and index not in replies:
                    replies[index] = message
                else:
                    endpoint.keep_stray(index, message)
        return replies


class Transport(ABC):
    """Makes endpoints; one instance per process (it may own an I/O context)."""

    @abstractmethod
    def serve(self, bind: str, name: str) -> ServerEndpoint:
        """Bind ``bind`` (``host:port``, port 0 for a free one) for task ``name``."""

    @abstractmethod
    def connect(self, addresses: Sequence[str], names: Sequence[str], identity: bytes | None = None) -> ClientEndpoint:
        """One client linked to every address, named for error messages.

        ``identity`` is how the servers tell this client's connection apart
        (random if not given); a ps binds each worker to one.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release shared resources."""
