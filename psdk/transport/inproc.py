"""An in-process transport: ps tasks and workers as threads of one process, no sockets.

It exists to prove that :mod:`psdk.transport` is the boundary: a
:class:`~psdk.ps.server.ParameterServer` and its :class:`~psdk.client.ParameterClient`
work over it unchanged, and it passes the same conformance suite
(:mod:`psdk.testing.transport_conformance`) as ZeroMQ. It is also a transport
for tests and notebooks that need no ports.

Addresses are ``host:port`` (``tcp://`` in front is allowed) or
``inproc://name``. One process is one host, so only the port tells ps tasks
apart: ``localhost:5000`` reaches what ``0.0.0.0:5000`` bound. Port 0 takes a
free port of the :class:`InprocHub` (counting up from 49152); the endpoint's
``address`` is then ``host:port`` with the real port. Transports share the
process's hub unless given their own, so a ps served from one transport
instance is reached from another, as over TCP.

What crosses is what would cross a socket: each message is encoded with
:func:`psdk.transport.wire.encode` and its arrays copied to bytes at send, then decoded
with :func:`psdk.transport.wire.decode` by the receiver, with the same header limits.
A receiver never shares memory with its sender (``volatile`` and ``stable``
need nothing more), its arrays are read-only, and malformed or oversized
requests reach the ps as :class:`~psdk.transport.Incoming` with an error, as
they do over ZeroMQ.

As ZeroMQ does, a client may send before anyone serves its address: up to
:data:`SEND_QUEUE_MESSAGES` messages wait for a server to bind and are
delivered then (a worker may start before its ps). A message a closed server
had not taken yet is lost. Nothing is lent: a client's ``buffers`` are private
arrays and an ``in_place`` reply travels as a copy, like any other.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

from psdk.errors import PeerTimeoutError, PortInUseError, TransportError
from psdk.runtime.logs import RateLimitedLog
from psdk.transport import ClientEndpoint, Incoming, ServerEndpoint, Transport
from psdk.transport.wire import (
    MAX_HEADER_BYTES,
    MAX_REPLY_HEADER_BYTES,
    MalformedMessage,
    Message,
    decode,
    decode_reply,
    encode,
)

log = logging.getLogger(__name__)

Frames = list[bytes]
SEND_QUEUE_MESSAGES = 1000
"""Messages a client holds for an address nobody serves yet (ZeroMQ's default send high-water mark)."""
REPLY_QUEUE_MESSAGES = 1024
"""Replies a client that does not read may have waiting; past this a reply is refused (``reply`` is False)."""
DEFAULT_SEND_WAIT_S = 10.0
"""How long a send waits for a server when its queue is full and ``wait_s`` is not given."""
FIRST_FREE_PORT = 49152

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A bounded FIFO whose reader waits at most a given time."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._ready = threading.Condition()

    def put(self, item: T) -> bool:
        with self._ready:
            if self.capacity is not None and len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            self._ready.notify()
            return True

    def take(self, timeout_s: float, most: int = 1) -> list[T]:
        """Up to ``most`` items, waiting at most ``timeout_s`` for the first."""
        with self._ready:
            if not self._items:
                self._ready.wait_for(lambda: bool(self._items), max(0.0, timeout_s))
            return [self._items.popleft() for _ in range(min(most, len(self._items)))]

    def clear(self) -> None:
        with self._ready:
            self._items.clear()


def frames_of(message: Message, max_header_bytes: int = MAX_HEADER_BYTES) -> Frames:
    """``message`` as it would cross a socket: the header, then a private copy of each array's bytes.

    Raises :class:`~psdk.errors.ProtocolError` (nothing sent) if it cannot go on the wire.
    """
    head, *arrays = encode(message, max_header_bytes)
    return [head, *(np.asarray(a).tobytes() for a in arrays)]


def _key(address: str) -> tuple[str, str, int | None]:
    """(registry key, host, port) of ``address``; the key is the port for ``host:port``."""
    if address.startswith("inproc://"):
        return address, address, None
    bare = address.removeprefix("tcp://")
    host, sep, port = bare.rpartition(":")
    if "://" in bare or not sep or not host or not port.isdigit() or int(port) > 65535:
        raise TransportError(f"address {address!r} is not host:port or inproc://name")
    return f"port:{int(port)}", host, int(port)


class _Link:
    """One client's connection to one address: where its replies go and what waits for a server."""

    def __init__(self, client: InprocClient, index: int, key: str, peer: bytes):
        self.client, self.index, self.key, self.peer = client, index, key, peer
        self.outbox: deque[Frames] = deque()
        self.closed = False


class InprocHub:
    """The addresses bound in this process, and the messages waiting for one to be."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._servers: dict[str, InprocServer] = {}
        self._waiting: dict[str, set[_Link]] = {}
        self._next_port = FIRST_FREE_PORT

    def bind(self, server: InprocServer, key: str | None) -> str:
        """Register ``server`` at ``key`` (``None``: a free port's), hand it what waited there; the key it got."""
        with self._lock:
            if key is None:
                key = f"port:{self._free_port()}"
            if key in self._servers:
                raise PortInUseError(server.address, server.name)
            self._servers[key] = server
            for link in self._waiting.pop(key, set()):
                while link.outbox:
                    server.inbox.put((link, link.outbox.popleft()))
            self._lock.notify_all()
            return key

    def _free_port(self) -> int:
        """A port nobody serves or waits for, going round the ephemeral range as a kernel does."""
        span = 65536 - FIRST_FREE_PORT
        for _ in range(span):
            port = self._next_port
            self._next_port = FIRST_FREE_PORT + (port + 1 - FIRST_FREE_PORT) % span
            key = f"port:{port}"
            if key not in self._servers and key not in self._waiting:
                return port
        raise TransportError("no free in-process port left")

    def unbind(self, server: InprocServer, key: str) -> None:
        with self._lock:
            if self._servers.get(key) is server:
                del self._servers[key]

    def post(self, link: _Link, frames: Frames, wait_s: float) -> bool:
        """Deliver ``frames`` to whoever serves the link's address, or hold them until someone does.

        ``False`` when nobody serves it and the link's queue stayed full for ``wait_s``.
        """
        with self._lock:
            if link.closed:
                raise TransportError(f"{link.client.peers[link.index]}: the endpoint is closed")
            if link.key not in self._servers and len(link.outbox) >= SEND_QUEUE_MESSAGES:
                self._lock.wait_for(lambda: link.key in self._servers or link.closed, wait_s)
            server = self._servers.get(link.key)
            if server is not None:
                server.inbox.put((link, frames))
            elif len(link.outbox) < SEND_QUEUE_MESSAGES and not link.closed:
                link.outbox.append(frames)
                self._waiting.setdefault(link.key, set()).add(link)
            else:
                return False
            return True

    def forget(self, link: _Link) -> None:
        """A closing client's messages that wait for a server are dropped (linger 0)."""
        with self._lock:
            link.closed = True
            link.outbox.clear()
            waiting = self._waiting.get(link.key)
            if waiting is not None:
                waiting.discard(link)
                if not waiting:
                    del self._waiting[link.key]
            self._lock.notify_all()


PROCESS_HUB = InprocHub()
"""The hub every :class:`InprocTransport` uses unless given its own."""


class InprocServer(ServerEndpoint):
    def __init__(self, hub: InprocHub, bind: str, name: str):
        key, host, port = _key(bind)
        self.hub, self.name = hub, name
        self.address = bind
        self.inbox: Mailbox[tuple[_Link, Frames]] = Mailbox()
        self.max_message_bytes: int | None = None
        self._peers: dict[bytes, _Link] = {}
        self._failures = RateLimitedLog(log)
        self._closed = False
        self._key = hub.bind(self, None if port == 0 else key)
        if port is not None:
            self.address = f"{host}:{self._key.removeprefix('port:')}"

    def receive(self, timeout_s: float) -> Incoming | None:
        taken = self.inbox.take(timeout_s)
        if not taken or self._closed:
            return None
        link, frames = taken[0]
        self._peers[link.peer] = link  # the latest connection with an identity is the one replies go to
        nbytes = sum(len(f) for f in frames)
        if self.max_message_bytes is not None and nbytes > self.max_message_bytes:
            too_big = MalformedMessage(f"a message of {nbytes:,} bytes exceeds this job's largest")
            return Incoming(link.peer, None, too_big, rid=None, nbytes=nbytes)
        try:
            message = decode(frames)
            if message.lent:
                raise MalformedMessage("a request names lent memory, which this transport never lends", message.rid)
            return Incoming(link.peer, message, nbytes=nbytes)
        except MalformedMessage as exc:
            return Incoming(link.peer, None, exc, rid=exc.rid, nbytes=nbytes)

    def connected(self, peer: bytes) -> bool:
        link = self._peers.get(peer)
        return link is not None and not link.closed and not self._closed

    def reply(self, peer: bytes, message: Message) -> bool:
        frames = frames_of(message, MAX_REPLY_HEADER_BYTES)  # ProtocolError: the caller's to answer
        link = self._peers.get(peer)
        if link is None or link.closed or self._closed:
            self._failures.warning("%s: reply %s to a peer failed: it is gone", self.name, message.op)
            self._peers.pop(peer, None)
            return False
        if not link.client.inbox.put((link.index, frames)):
            self._failures.warning("%s: reply %s to a peer failed: it is not reading", self.name, message.op)
            return False
        return True

    def limit_incoming(self, largest_message: int, total: int) -> None:
        """Refuse requests over ``largest_message`` bytes, as a socket would; ``total`` needs no bound in-process."""
        self.max_message_bytes = largest_message

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.hub.unbind(self, self._key)
            self.inbox.clear()
            self._peers.clear()


class InprocClient(ClientEndpoint):
    def __init__(self, hub: InprocHub, addresses: Sequence[str], names: Sequence[str], identity: bytes | None):
        super().__init__()
        self.hub = hub
        self.peers = list(names)
        peer = identity if identity is not None else b"\0inproc-" + secrets.token_hex(4).encode()
        self.inbox: Mailbox[tuple[int, Frames]] = Mailbox(REPLY_QUEUE_MESSAGES)
        self._links = [_Link(self, index, _key(address)[0], peer) for index, address in enumerate(addresses)]

    def send(self, index: int, message: Message, wait_s: float | None = None) -> None:
        self.send_frames(index, frames_of(message), wait_s, message.op)

    def send_frames(self, index: int, frames: Sequence[bytes], wait_s: float | None = None, what: str = "") -> None:
        """Send raw ``frames`` (copied) to server ``index``: how tests send what ``encode`` would refuse."""
        waited = DEFAULT_SEND_WAIT_S if wait_s is None else wait_s
        if not self.hub.post(self._links[index], [bytes(f) for f in frames], waited):
            raise PeerTimeoutError(
                self.peers[index], f"sending {what or 'a message'}: nobody serves its address", waited
            )

    def receive(self, timeout_s: float) -> list[tuple[int, Message]]:
        got: list[tuple[int, Message]] = []
        for index, frames in self.inbox.take(timeout_s, most=REPLY_QUEUE_MESSAGES):
            got.append((index, decode_reply(frames, self.peers[index])))
        return got

    def close(self) -> None:
        for link in self._links:
            self.hub.forget(link)
        self.inbox.clear()


class InprocTransport(Transport):
    """Endpoints on ``hub`` (the process's by default); :meth:`close` closes every endpoint it made."""

    def __init__(self, hub: InprocHub | None = None):
        self.hub = hub or PROCESS_HUB
        # Weak: a worker makes and closes endpoints as it goes (heartbeats); only live ones need closing here.
        self._endpoints: weakref.WeakSet[InprocServer | InprocClient] = weakref.WeakSet()
        self._lock = threading.Lock()

    def serve(self, bind: str, name: str) -> InprocServer:
        server = InprocServer(self.hub, bind, name)
        with self._lock:
            self._endpoints.add(server)
        return server

    def connect(self, addresses: Sequence[str], names: Sequence[str], identity: bytes | None = None) -> InprocClient:
        client = InprocClient(self.hub, addresses, names, identity)
        with self._lock:
            self._endpoints.add(client)
        return client

    def close(self) -> None:
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints), weakref.WeakSet()
        for endpoint in endpoints:
            endpoint.close()
