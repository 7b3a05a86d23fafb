"""A bound on what the peers of a ps can make libzmq hold for them, enforced from the kernel's side.

libzmq reads every TCP connection eagerly into a pipe per peer, and its own
limits do not add up to a bound on memory:

* ``ZMQ_MAXMSGSIZE`` caps one frame, not a message: a message whose frames
  never end (a few lines of raw ZMTP, no libzmq sender does it) is kept
  whole until it ends, which it never does. Measured: 1.5 GB held after 3 s
  from one unauthenticated connection, with MAXMSGSIZE at 1 MiB.
* ``ZMQ_RCVHWM`` counts whole messages, so an unfinished one never counts.
* An option set on a socket reaches only connections made after it, so the
  ps cannot tighten MAXMSGSIZE once it knows the job's sizes.

So a thread watches every TCP connection of the ps's socket. The kernel
counts the bytes each one received (``TCP_INFO``'s ``tcpi_bytes_received``);
the ps counts the messages it took from each (``ZMQ_SRCFD`` of the frames)
and their bytes on the wire (payload plus an upper bound of each frame's
framing). What a connection received beyond what the ps took (less its
handshake, and ZeroMQ's heartbeats, credited per message taken) is held for
it by libzmq or by the kernel; credit never exceeds what was received, so
nothing is banked for a later flood. A connection holding more than
``per_connection`` bytes is shut down (``shutdown(2)`` on a duplicate of its
socket: libzmq sees the connection end, drops what it held, and a ZeroMQ
peer reconnects). While all connections together hold more than ``total``,
the biggest holder is shut down. A connection beyond ``max_connections`` is
shut down as it is accepted, unless one that never sent a message (no key,
a half-open connection) can make room. Connections are learnt from the
socket's monitor events, and from a scan of the process's file descriptors
twice a second (the monitor drops events when flooded). Checks run every
10 ms (every 1 ms while something holds over half of what it may, and never
more than a tenth of a core: with many connections they space out).

What the guard enforces is exact in bytes on the wire, give or take what
arrives during one check. In memory, libzmq keeps each frame in a 64-byte
structure (plus the payload when it is over 33 bytes), so empty frames make
it hold up to 32 times their wire size. docs/security.md states the bound.

Only TCP endpoints are guarded (inproc peers are threads of the same
process; ipc has no ``TCP_INFO``), and only on Linux.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from psdk.runtime.logs import RateLimitedLog
from psdk.transport.handshakes import failed_at_server

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.01
FRAME_OVERHEAD_BYTES = 42
"""The most a frame adds on the wire: its flags and 8-byte size, and CURVE's command name, nonce and box."""
HANDSHAKE_BYTES = 2048
"""What a connection sends before its first message: the greeting and the handshake (CURVE's is ~600 bytes)."""
CHATTER_PER_MESSAGE = 256
"""ZeroMQ's own heartbeats between two messages (a PING and a PONG each interval, ~60 bytes each with CURVE):
credited per message the ps takes, so a connection that keeps talking is never charged for them, and one that
sends only those (a message that never ends) is."""
CLOSE_CHECK_EVERY_S = 0.001
"""How often connections are checked while one holds over half of what it may (a flood fills fast)."""
SCAN_EVERY_S = 0.5
_TCP_INFO_BYTES = 256
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info: tcpi_bytes_received (u64), Linux >= 4.1
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Logged, rate-limited: the one monitor a socket may have is this guard's, so it says why a peer is not let in."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED | _HANDSHAKE_FAILED


def supported() -> bool:
    """Whether this platform can report the bytes each TCP connection received."""
    return sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


@dataclass
class _Connection:
    fd: int
    peer: Any
    accounted: int
    """Of the bytes received, those that belong to messages the ps took (and their framing), the handshake, and
    the protocol's own chatter: never more than were received, so nothing is banked for later."""
    taken: int
    """Messages the ps had taken from it at the last check."""
    taken_bytes: int
    """Their wire bytes at the last check."""
    held: int = 0
    since: float = 0.0
    """When the guard first saw it."""
    delivered: bool = False
    """The ps has taken a message from it (a peer that finished its handshake and spoke)."""


@dataclass(frozen=True)
class Limits:
    per_connection: int
    total: int
    max_connections: int


class ConnectionGuard:
    """Watches the TCP connections of one socket; see the module docstring."""

    def __init__(
        self, sock: zmq.Socket[Any], port: int, name: str, limits: Limits, check_every_s: float = CHECK_EVERY_S
    ):
        self.name = name
        self.port = port
        self.limits = limits
        self.check_every_s = check_every_s
        self.taken: dict[int, int] = {}
        """Messages taken per file descriptor, counted by the socket's owner (:meth:`took`)."""
        self.taken_bytes: dict[int, int] = {}
        """Their bytes on the wire, framing included (an upper bound: CURVE's box on every frame)."""
        self.shut_down = 0
        """Connections this guard ended, for tests and the ps's statistics."""
        self.held_when_shut: list[int] = []
        """What each of them held when it was shut down (the last 100)."""
        self._sock = sock
        self._secure = bool(sock.getsockopt(zmq.CURVE_SERVER))
        self._monitor = sock.get_monitor_socket(_EVENTS)  # made in the owner's thread, used only by ours
        self._connections: dict[int, _Connection] = {}
        self._ended: OrderedDict[tuple[int, Any], None] = OrderedDict()
        """Connections shut down lately, until libzmq closes them: a scan must not take them in again."""
        self.period_s = check_every_s
        """How long the guard waits between two checks now."""
        self._warnings = RateLimitedLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"psdk-guard-{name}", daemon=True)
        self._thread.start()

    def took(self, fd: int, nbytes: int, frames: int) -> None:
        """The socket's owner took a message of ``nbytes`` in ``frames`` from connection ``fd`` (per message: cheap)."""
        self.taken[fd] = self.taken.get(fd, 0) + 1
        self.taken_bytes[fd] = self.taken_bytes.get(fd, 0) + nbytes + frames * FRAME_OVERHEAD_BYTES

    def set_limits(self, limits: Limits) -> None:
        self.limits = limits

    def stop(self) -> None:
        """End the thread; call from the socket's owner before it closes the socket.

        The socket stops monitoring first: closing the monitor's receiving end
        while the socket still sends events to it, then the socket, stalls
        libzmq's I/O thread and with it every other socket of the context.
        """
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        next_scan = 0.0
        try:
            pressed, spent = False, 0.0
            while not self._stop.is_set():
                wait = CLOSE_CHECK_EVERY_S if pressed else self.check_every_s
                # With many connections a check costs more: wait at least ten times what it took (under 10% of a
                # core); a flood then gets further before it is cut (docs/security.md counts that in).
                wait = max(wait, 10 * spent)
                self.period_s = wait
                if self._monitor.poll(max(1, int(wait * 1000))):
                    self._events()
                if time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + SCAN_EVERY_S
                    self._scan()
                started = time.monotonic()
                pressed = self._check()
                spent = time.monotonic() - started
        except Exception:  # a broken guard must say so, never take the ps down with it
            log.exception("%s: the connection guard stopped", self.name)
        finally:
            self._monitor.close(linger=0)

    def _events(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            kind, fd = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self._connections.pop(fd, None)
                self.taken.pop(fd, None)  # the next connection on this descriptor starts from nothing
                self.taken_bytes.pop(fd, None)
            elif kind & _HANDSHAKE_FAILED and (why := failed_at_server(kind, fd, self._secure)) is not None:
                self._warnings.warning("%s: %s", self.name, why)  # "value" is the error here, not a descriptor
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                self._stop.set()
                return

    def _scan(self) -> None:
        """Every accepted connection of this port the events missed (a connection flood overflows them)."""
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in self._connections:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        if fd in self._connections:
            return
        received, peer = _inspect(fd, self.port)
        if received is None or (fd, peer) in self._ended:
            return
        # Counted from its first byte: whatever came before this look (events arrive late) is held too, unless
        # the ps already took messages from it (a connection a scan found after the monitor dropped its event:
        # taken as caught up).
        taken, taken_bytes = self.taken.get(fd, 0), self.taken_bytes.get(fd, 0)
        accounted = received if taken else min(received, HANDSHAKE_BYTES)
        connection = _Connection(fd, peer, accounted, taken, taken_bytes, held=received - accounted)
        connection.since, connection.delivered = time.monotonic(), taken > 0
        if len(self._connections) >= self.limits.max_connections:
            # Silent connections (no message yet: no key, or a half-open one) make room first, oldest first, so
            # strangers filling the slots cannot lock a worker out; else the newcomer is turned away.
            silent = [c for c in self._connections.values() if not c.delivered and c.since < connection.since - 1.0]
            if not silent:
                self._end(connection, f"it is beyond the {self.limits.max_connections} connections a ps accepts")
                return
            oldest = min(silent, key=lambda c: c.since)
            self._end(oldest, f"a ps keeps {self.limits.max_connections} connections and it never sent a message")
        self._connections[fd] = connection
        if connection.held > self.limits.per_connection:
            self._end(connection, f"it holds {connection.held:,} bytes (at most {self.limits.per_connection:,})")

    def _check(self) -> bool:
        """Shut down what holds too much; ``True`` while something comes close (check again sooner)."""
        limits = self.limits
        for fd, connection in list(self._connections.items()):
            received, peer = _inspect(fd, self.port)
            if received is None or peer != connection.peer:  # closed (an event may still be on its way)
                del self._connections[fd]
                continue
            taken, taken_bytes = self.taken.get(fd, 0), self.taken_bytes.get(fd, 0)
            if taken != connection.taken:
                credit = taken_bytes - connection.taken_bytes + (taken - connection.taken) * CHATTER_PER_MESSAGE
                connection.accounted = min(received, connection.accounted + credit)
                connection.taken, connection.taken_bytes, connection.delivered = taken, taken_bytes, True
            connection.held = max(0, received - connection.accounted)
            if connection.held > limits.per_connection:
                self._end(connection, f"it holds {connection.held:,} bytes (at most {limits.per_connection:,})")
        while self._connections:
            total = sum(c.held for c in self._connections.values())
            if total <= limits.total:
                biggest = max(c.held for c in self._connections.values())
                return 2 * biggest > limits.per_connection or 2 * total > limits.total
            largest = max(self._connections.values(), key=lambda c: c.held)
            self._end(largest, f"all connections hold {total:,} bytes (at most {limits.total:,}) and it holds most")
        return False

    def _end(self, connection: _Connection, why: str) -> None:
        self._connections.pop(connection.fd, None)
        try:  # a duplicate: checked and shut down, it is this connection even if libzmq closes fd meanwhile
            duplicate = socket.socket(fileno=os.dup(connection.fd))
        except OSError:
            return  # already closed
        with duplicate:
            if _peer(duplicate) != connection.peer:
                return  # already gone: the descriptor is someone else's now
            self.shut_down += 1  # counted first: whoever sees the connection end sees it counted
            self.held_when_shut = [*self.held_when_shut[-99:], connection.held]
            self._ended[(connection.fd, connection.peer)] = None
            while len(self._ended) > 4 * self.limits.max_connections:
                self._ended.popitem(last=False)
            with contextlib.suppress(OSError):
                duplicate.shutdown(socket.SHUT_RDWR)
        self._warnings.warning("%s: closed the connection from %s: %s", self.name, _label(connection.peer), why)


@contextlib.contextmanager
def _borrowed(fd: int) -> Any:
    """A socket object over libzmq's file descriptor that never closes it (``None`` if it is no socket now)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def _peer(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None


def _inspect(fd: int, port: int) -> tuple[int | None, Any]:
    """Bytes received so far and the peer of ``fd``, a connection accepted on ``port``; ``(None, None)`` if not."""
    with _borrowed(fd) as sock:
        if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None, None
        try:
            if sock.getsockname()[1] != port:
                return None, None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None, None
        if len(info) < _BYTES_RECEIVED_OFFSET + 8:
            return None, None
        peer = _peer(sock)  # None for the listening socket itself
        return (None, None) if peer is None else (struct.unpack_from("<Q", info, _BYTES_RECEIVED_OFFSET)[0], peer)


def _label(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
