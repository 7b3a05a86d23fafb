"""ZeroMQ implementation of the transport: a ROUTER per ps, a DEALER per shard per worker.

Large arrays leave with ``copy=False`` (pyzmq still copies frames below its
copy threshold, where that is cheaper) and arrive as ``np.frombuffer`` views
of the received frames. Every socket closes with linger 0, so a dead peer
never holds a process open; ``ROUTER_MANDATORY`` turns a reply to a vanished
peer into an error instead of silence; TCP keepalive drops dead TCP links, on
either side, never ZeroMQ's own heartbeats (see :func:`_apply_server`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from psdk.config.options import TransportOptions
from psdk.errors import PeerTimeoutError, PortInUseError, TransportError
from psdk.runtime.logs import RateLimitedLog
from psdk.transport import ClientEndpoint, Incoming, ServerEndpoint, ShardBuffers, Transport, shm, zmq_guard
from psdk.transport.frames import FrameReuse, TimedReceiver, send_parts
from psdk.transport.handshakes import HandshakeWatch, listening
from psdk.transport.heap import MAX_ARRAYS, heap_bytes
from psdk.transport.lending import ATTACH, CONTROL_PREFIX, PROBE, ClientLinks, ServerLinks, reply_regions
from psdk.transport.security import CurveKeys, PsdkAuthenticator, start_authenticator
from psdk.transport.wire import MAX_REPLY_HEADER_BYTES, MalformedMessage, Message, decode, decode_reply, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZmqOptions:
    """Socket settings of one process's transport: the ``transport.*`` group it is handed, and what it adds.

    Heartbeats, the message limit, I/O threads, shared memory and doorbells
    are the fields of :class:`~psdk.config.options.TransportOptions`, held here
    as they are and never copied (a ps hands over its own I/O threads,
    ``ps.io_threads``, with :func:`dataclasses.replace`).
    """

    transport: TransportOptions = field(default_factory=TransportOptions)
    """``transport.max_message_bytes``: a ps refuses bigger messages; it lowers this to its job's largest once
    the chief initialised it. ``shared_memory``: a worker and a ps on one host exchange arrays through shared
    memory, headers over ZeroMQ; ``doorbells``: then a push and its reply ring pipes (see psdk.transport.shm)."""
    max_connections: int = 1024
    """A ps shuts down TCP connections beyond this many (each worker makes two per ps)."""
    queue_messages: int = 2
    """Whole messages ZeroMQ queues per peer on their way in (its receive high-water mark): a worker waits for each
    reply, so one is the norm. A peer with this many queued is not read until the ps takes one."""
    curve: CurveKeys | None = None
    """CURVE keys: servers authenticate workers by key, all traffic is encrypted."""


def endpoint(address: str) -> str:
    """``host:port`` as a ZeroMQ endpoint; port 0 asks for a free port."""
    if "://" in address:
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise TransportError(f"address {address!r} is not host:port")
    return f"tcp://{host}:{'*' if port == '0' else port}"


def _apply_client(sock: zmq.Socket[Any], options: ZmqOptions) -> None:
    """A worker's socket: no ZeroMQ heartbeats either, the kernel's TCP keepalive drops a dead link to its ps.

    A worker's ZeroMQ PING is answered by the ps's I/O thread, and that is
    the abort of :func:`_apply_server` again, from a worker this time: a ps
    slow enough that a worker's queue fills (two messages: a slow update, a
    few heartbeats) answers a PING still queued once that worker has gone,
    e.g. at the end of the job. Measured: a ps slowed to 1 s per update
    (``PSDK_FAILPOINT=ps.update@500=sleep1``) aborted at the end of the job
    in 4 runs of 4; with no PINGs from the workers, in none of 6. A worker
    learns that its ps died from its own pings (:mod:`psdk.client.heartbeat`).
    """
    _keep_alive(sock, options)


def _apply_server(sock: zmq.Socket[Any], options: ZmqOptions) -> None:
    """A ps's socket: no ZeroMQ heartbeats, the kernel's TCP keepalive instead.

    libzmq 4.3 aborts the whole process (``Assertion failed: !_io_error``,
    libzmq issues 3937, 4364, 4767, still open) when a heartbeat falls due on
    a connection whose queue is full and whose peer has gone: measured, 16
    raw connections that each sent 5,000 requests and reset killed a ps at
    the first try. A ps learns that workers died from their own requests and
    pings (``transport.heartbeat_timeout_s``); dead links only have to be
    dropped, which keepalive does.
    """
    _keep_alive(sock, options)


def _keep_alive(sock: zmq.Socket[Any], options: ZmqOptions) -> None:
    """Linger 0, and TCP keepalive probes from ``transport.heartbeat_timeout_s`` of silence on."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, int(options.transport.heartbeat_timeout_s)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, int(options.transport.heartbeat_interval_s)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


HANDSHAKE_S = 5.0
REPLY_QUEUE_MESSAGES = 64
"""Replies ZeroMQ queues per peer that does not read them; past this they are dropped (and logged)."""
PRE_INIT_SLACK_BYTES = 16 << 20
"""Before the chief's init, what all connections but the chief's may hold together (requests are small)."""
FRAMING_SLACK_BYTES = 1 << 20
"""What a connection may hold beyond the largest message: ZMTP framing, CURVE boxes, a heartbeat or two."""


class ZmqServer(ServerEndpoint):
    def __init__(self, context: zmq.Context[Any], bind: str, name: str, options: ZmqOptions):
        self.name = name
        self.sock = context.socket(zmq.ROUTER)
        _apply_server(self.sock, options)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, options.transport.max_message_bytes)
        self.sock.setsockopt(zmq.RCVHWM, options.queue_messages)
        self.sock.setsockopt(zmq.SNDHWM, REPLY_QUEUE_MESSAGES)
        # A peer that has not finished the handshake (a stranger without a key, a half-open connection) is
        # dropped after this, so it cannot keep a connection slot of the guard's for long.
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self.max_message_bytes = options.transport.max_message_bytes
        self.secure = options.curve is not None
        if options.curve is not None:
            self.sock.curve_server = True
            self.sock.curve_publickey = options.curve.public
            self.sock.curve_secretkey = options.curve.secret
        try:
            self.sock.bind(endpoint(bind))
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUseError(bind, name) from None
            reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise TransportError(f"{name} cannot bind {bind}: {exc}", reason) from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.guard: zmq_guard.ConnectionGuard | None = None
        if self.address.startswith("tcp://") and zmq_guard.supported():
            held = self.max_message_bytes + FRAMING_SLACK_BYTES
            limits = zmq_guard.Limits(held, held + PRE_INIT_SLACK_BYTES, options.max_connections)
            port = int(self.address.rsplit(":", 1)[1])
            self.guard = zmq_guard.ConnectionGuard(self.sock, port, name, limits)
        self.shares_memory = options.transport.shared_memory and shm.available()
        """Whether workers on this host may lend their buffers (see :mod:`psdk.transport.lending`)."""
        self.links = ServerLinks(
            name,
            options.transport.max_message_bytes // 4,
            self.shares_memory and options.transport.doorbells,
            self._listen,
        )
        self._reuse = FrameReuse()
        self._receiver = TimedReceiver(self.sock)
        self._failures = RateLimitedLog(log)
        self._knock_fds: set[int] = set()
        self._poller: zmq.Poller | None = None  # only while someone may knock: else a plain timed receive
        self._ready: deque[Incoming] = deque()

    def _listen(self, fd: int, on: bool) -> None:
        """Wake :meth:`receive` on a worker's knock pipe (``on``), or stop (it is about to close)."""
        if on and fd not in self._knock_fds:
            if self._poller is None:
                self._poller = zmq.Poller()
                self._poller.register(self.sock, zmq.POLLIN)
            self._knock_fds.add(fd)
            self._poller.register(fd, zmq.POLLIN)
        elif not on and fd in self._knock_fds:
            self._knock_fds.discard(fd)
            if self._poller is not None:
                self._poller.unregister(fd)
                if not self._knock_fds:
                    self._poller = None

    def lent_memory(self, peer: bytes) -> bool:
        return peer in self.links.by_peer

    def forget(self, peer: bytes) -> None:
        self.links.forget(peer)

    def connected(self, peer: bytes) -> bool:
        """Probed with a transport op the peer's endpoint ignores: ``ROUTER_MANDATORY`` refuses a closed one."""
        try:
            send_parts(self.sock, [peer, *encode(Message(PROBE, {}, [], 0))], copy=True)
        except zmq.ZMQError as exc:
            return exc.errno != zmq.EHOSTUNREACH  # EAGAIN: there, only not reading
        return True

    def receive(self, timeout_s: float) -> Incoming | None:
        got = self._receive_once(timeout_s)
        if got is not None or timeout_s <= 0:
            return got
        deadline = time.monotonic() + timeout_s  # what the transport took for itself does not end the wait early
        while got is None and (left := deadline - time.monotonic()) > 0:
            got = self._receive_once(left)
        return got

    def _receive_once(self, timeout_s: float) -> Incoming | None:
        if self._ready:
            return self._ready.popleft()
        if self._poller is None:
            frames = self._receiver.receive(timeout_s)
            return None if frames is None else self._incoming(frames)
        for item, _ in self._poller.poll(max(0, int(timeout_s * 1000))):
            if isinstance(item, int):  # a knock (or its writer hung up: the links let it go)
                got = self.links.knocked(item)
            else:
                try:  # one message: the next receive polls again
                    got = self._incoming(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    got = None
            if got is not None:
                self._ready.append(got)
        return self._ready.popleft() if self._ready else None

    def limit_incoming(self, largest_message: int, total: int) -> None:
        """From now on, refuse messages over ``largest_message`` bytes and bound what connections hold to ``total``.

        The socket's own limit reaches only connections made after this;
        the guard applies both to every connection at once.
        """
        self.max_message_bytes = largest_message
        self.links.max_size = largest_message // 4
        self.sock.setsockopt(zmq.MAXMSGSIZE, largest_message)
        if self.guard is not None:
            held, most = largest_message + FRAMING_SLACK_BYTES, self.guard.limits.max_connections
            self.guard.set_limits(zmq_guard.Limits(held, total + FRAMING_SLACK_BYTES, most))

    def _incoming(self, frames: list[Any]) -> Incoming | None:
        """A request as the ps takes it; ``None`` for the transport's own (an offer of memory, answered here)."""
        peer, body = frames[0].bytes, frames[1:]
        nbytes = sum(len(f) for f in body)
        if self.guard is not None and body:
            self.guard.took(body[0].get(zmq.SRCFD), nbytes, len(body))
        user = body[0].get("User-Id") if self.secure and body else None
        if nbytes > self.max_message_bytes:
            too_big = MalformedMessage(f"a message of {nbytes:,} bytes exceeds this job's largest")
            return Incoming(peer, None, too_big, rid=None, nbytes=nbytes, user=user)
        try:
            message = decode(body)
            if message.op.startswith(CONTROL_PREFIX):
                if message.op != ATTACH:
                    raise MalformedMessage(f"unknown transport op {message.op!r}", message.rid)
                self._send(peer, self.links.attach(peer, user, message, self.shares_memory))
                return None
            self.links.heard(peer)
            if message.lent:
                unlent = self.links.unlent(peer, message)
                if unlent is not None:  # the worker's transport sends it again whole: the ps never sees this one
                    self._send(peer, unlent)
                    return None
                message = self.links.resolve(peer, message)
            return Incoming(peer, message, nbytes=nbytes, user=user)
        except MalformedMessage as exc:
            return Incoming(peer, None, exc, rid=exc.rid, nbytes=nbytes, user=user)

    def reply_room(self, peer: bytes, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        return self.links.reply_room(peer, rid, shapes)

    def reply(self, peer: bytes, message: Message) -> bool:
        if message.in_place:
            written = self.links.write(peer, message)
            if written:
                return True  # rung: no message at all
            if written is not None:  # the array is in the worker's memory; the header goes as a message
                message = Message(message.op, message.fields, [], message.rid, lent=reply_regions(message))
            else:  # the caller may change the array once this returns: copied into the frame
                message = Message(message.op, message.fields, message.arrays, message.rid, volatile=True)
        return self._send(peer, message)

    def _send(self, peer: bytes, message: Message) -> bool:
        parts = [peer, *encode(message, MAX_REPLY_HEADER_BYTES)]  # ProtocolError: the caller's to answer
        try:
            if message.stable:
                send_parts(self.sock, self._reuse.frames(parts, 2), copy=False)  # [peer, header, buffer, ...]
            else:  # volatile: copied inside the send; else a fresh zero-copy frame each
                send_parts(self.sock, parts, copy=message.volatile)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: peer gone; EAGAIN: peer not reading (its queue is full)
            self._failures.warning("%s: reply %s to a peer failed: %s", self.name, message.op, exc.strerror)
            return False
        return True

    def close(self) -> None:
        self.links.close()
        self._poller = None
        if self.guard is not None:
            self.guard.stop()
        self.sock.close(linger=0)


class ZmqClient(ClientEndpoint):
    def __init__(
        self,
        context: zmq.Context[Any],
        addresses: Sequence[str],
        names: Sequence[str],
        options: ZmqOptions,
        identity: bytes | None = None,
    ):
        super().__init__()
        self.options, self.peers, self.addresses = options, list(names), list(addresses)
        self.watch = HandshakeWatch(secure=options.curve is not None)
        self.shares_memory = options.transport.shared_memory and shm.available()
        """Whether to lend a ps on this host the buffers of its arrays (see :mod:`psdk.transport.lending`)."""
        self.socks: list[zmq.Socket[Any]] = []
        self.poller = zmq.Poller()
        self._index: dict[zmq.Socket[Any], int] = {}
        self.links = ClientLinks(self.peers, options.transport.doorbells, self._listen)
        self._reuse: list[FrameReuse] = []
        for index, address in enumerate(addresses):
            sock = context.socket(zmq.DEALER)
            _apply_client(sock, options)
            if identity is not None:
                sock.setsockopt(zmq.ROUTING_ID, identity)
            if options.curve is not None:
                if index >= len(options.curve.servers):
                    raise TransportError(
                        f"a CURVE client needs the public key of every ps task: it has {len(options.curve.servers)} "
                        f"for {len(addresses)} ps tasks (load the worker's keys with the job's number of ps tasks)"
                    )
                sock.curve_publickey = options.curve.public
                sock.curve_secretkey = options.curve.secret
                sock.curve_serverkey = options.curve.servers[index]
            self.watch.add(sock)
            sock.connect(endpoint(address))
            self.socks.append(sock)
            self.poller.register(sock, zmq.POLLIN)
            self._index[sock] = index
            self._reuse.append(FrameReuse())

    def _listen(self, fd: int, on: bool) -> None:
        """Wake :meth:`receive` on a doorbell (``on``), or stop (it is about to close)."""
        if on:
            self.poller.register(fd, zmq.POLLIN)
        else:
            self.poller.unregister(fd)

    def buffers(self, index: int, size: int, extra_bytes: int = 0, extra_arrays: int = 0) -> ShardBuffers:
        if not (self.shares_memory and size):
            self.links.release(index)
            return ShardBuffers.private(size)
        heap = heap_bytes(extra_bytes, extra_arrays) if extra_arrays <= MAX_ARRAYS else 0  # else: in frames
        buffers, offer = self.links.lend(index, size, self.new_rid(), heap)
        self._offer(index, offer)
        return buffers

    def room(self, index: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        return self.links.room(index, shapes)

    def renew(self, index: int) -> None:
        self._offer(index, self.links.offer(index, self.new_rid()))

    def _offer(self, index: int, offer: Message | None) -> None:
        if offer is None:
            return
        try:
            self.send(index, offer)
        except PeerTimeoutError as exc:  # the buffers still serve, in frames
            log.info("%s: no shared memory (%s)", self.peers[index], exc)
            self.links.release(index)

    def sharing(self, index: int) -> str:
        return self.links.sharing(index)

    def send(self, index: int, message: Message, wait_s: float | None = None) -> None:
        light, knock = self.links.outgoing(index, message)
        if knock is not None and self.links.knock(index, message.rid, knock):
            return
        if knock is None:
            message = light  # with its array named in lent memory, when it lies there
        parts = encode(message)
        if message.stable:
            parts = self._reuse[index].frames(parts, 1)  # [header, buffer, ...]
        sock = self.socks[index]
        try:
            send_parts(sock, parts, copy=message.volatile)
            return
        except zmq.Again:
            pass
        # No pipe to the peer just now: between reconnects (a ps restarting, or one refusing
        # the handshake, e.g. a secure ps and a client without its keys) ZeroMQ queues nothing.
        # Wait for one, as long as a heartbeat would, rather than fail on a transient gap.
        waited = self.options.transport.heartbeat_timeout_s if wait_s is None else wait_s
        if waited > 0 and sock.poll(int(waited * 1000), zmq.POLLOUT):
            try:
                send_parts(sock, parts, copy=message.volatile)
                return
            except zmq.Again:
                pass
        raise PeerTimeoutError(
            self.peers[index],
            f"sending {message.op}: no connection to it was accepted (is it running at that address, and does "
            "it want CURVE keys this client lacks? transport.secure must be the same on every task)",
            waited,
        )

    def receive(self, timeout_s: float) -> list[tuple[int, Message]]:
        got: list[tuple[int, Message]] = []
        for sock, _ in self.poller.poll(max(0, int(timeout_s * 1000))):
            if isinstance(sock, int):  # a doorbell: the reply is in shared memory
                rung = self.links.rung(sock)
                if rung is not None:
                    got.append(rung)
                continue
            # One message per ready socket: the caller polls again if it expects more.
            frames = sock.recv_multipart(copy=False)
            index = self._index[sock]
            reply = decode_reply(frames, self.peers[index])
            if reply.op.startswith(CONTROL_PREFIX):  # the transport's own answer: the caller never sees it
                again = self.links.answered(index, reply)
                if again is not None and again.op == "error":
                    got.append((index, again))
                elif again is not None:
                    self.send(index, again)  # whole, in frames: the server holds this memory no more
                continue
            landed = self.links.landed(index, reply)
            if landed is not None:
                got.append((index, landed))
        if not got:  # idle: the handshake monitors are read now, or a full one would stall the I/O thread
            self.watch.drain()
        return got

    def diagnose(self, index: int) -> str | None:
        return listening(self.addresses[index]) or self.watch.failure(index)

    def close(self) -> None:
        self.watch.close()
        self.links.close()
        for sock in self.socks:
            self.poller.unregister(sock)
            sock.close(linger=0)
        self.socks.clear()


class ZmqTransport(Transport):
    """Owns one ZeroMQ context; pass ``context`` to share one with ``inproc://`` peers."""

    def __init__(self, options: ZmqOptions | None = None, context: zmq.Context[Any] | None = None):
        self.options = options or ZmqOptions()
        self._own_context = context is None
        self.context = context or zmq.Context(io_threads=self.options.transport.io_threads)
        self._authenticator: PsdkAuthenticator | None = None

    def serve(self, bind: str, name: str) -> ZmqServer:
        if self.options.curve is not None and self._authenticator is None:
            self._authenticator = start_authenticator(self.context, self.options.curve, name)
        return ZmqServer(self.context, bind, name, self.options)

    def connect(self, addresses: Sequence[str], names: Sequence[str], identity: bytes | None = None) -> ZmqClient:
        return ZmqClient(self.context, addresses, names, self.options, identity)

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_context:
            self.context.destroy(linger=0)
