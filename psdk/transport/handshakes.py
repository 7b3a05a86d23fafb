"""Why a ZeroMQ peer does not answer, in words: nothing listening, or a handshake that failed.

ZeroMQ connects silently: a worker whose ps is not running, or whose keys do
not match the ps's, queues its requests and waits out its timeout without a
sign. Two things tell the cases apart. A plain TCP connection to the address
(:func:`listening`) says whether anything listens there. A socket monitor on
each of the worker's sockets, set up before it connects, records how its
handshakes went: a secure worker and an insecure ps (or the reverse) fail
with a mechanism mismatch and never retry, a key the ps does not know fails
with ZAP's status 400, a ps key that is not the ps's fails the CURVE
handshake (measured with libzmq 4.3.5). A mismatch is seen by the side that
reads the other's greeting first; that side hangs up, and the other sees only
a handshake ended without detail (and, a worker, connects again): the ps's
line for a mismatch is therefore not certain, the worker's is once it has
retried.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

PROBE_TIMEOUT_S = 1.0
"""How long a TCP connection to a peer's address may take to say something listens there."""
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Handshakes only: a failure is followed by a disconnection, which must not hide it."""
KEY_MISMATCH = "a key mismatch"
"""How every handshake failure that keys explain begins (tests and users grep for it)."""


def listening(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing could listen at ``address`` (``tcp://host:port`` or ``host:port``); ``None`` if something does."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if address.startswith(("inproc://", "ipc://")):
        return None  # no TCP to probe
    host, _, port = rest.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return "nothing is listening there (is the ps started, at that address?)"
    except socket.gaierror as exc:
        return f"its host name cannot be resolved ({exc.strerror})"
    except TimeoutError:
        return f"nothing answered a TCP connection there in {timeout_s:g} s (is the host up, and the port open?)"
    except (OSError, ValueError) as exc:
        return f"it cannot be reached ({getattr(exc, 'strerror', None) or exc})"


def handshake_failure(event: int, value: int, secure: bool) -> str:
    """The likely cause of a failed handshake, as a worker (``secure``: with CURVE keys) saw it."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if secure:
            return (
                f"{KEY_MISMATCH}: this task uses CURVE keys and the ps does not (it runs with transport.secure=false); "
                "transport.secure must be the same on every task"
            )
        return (
            f"{KEY_MISMATCH}: the ps wants CURVE keys (it runs with transport.secure=true) and this task has none; "
            "transport.secure must be the same on every task, with the job's keys (transport.keys_dir)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{KEY_MISMATCH}: the ps does not know this task's key (keys of another `python -m psdk keys` run?); "
            "give every task the same transport.keys_dir"
        )
    if secure and (event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC):
        # The ps hung up mid-handshake: it could not decrypt this task's hello, or (the side that saw the
        # mechanism mismatch first hangs up before the other sees it) it runs without keys.
        return (
            f"{KEY_MISMATCH}: the ps ended the CURVE handshake; the ps public key this task holds is not that ps's "
            "(keys of another job?), or the ps runs with transport.secure=false; give every task the same "
            "transport.keys_dir"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            f"{KEY_MISMATCH}, likely: the ps ended the ZeroMQ handshake; does it want CURVE keys "
            "(transport.secure=true there)? transport.secure must be the same on every task"
        )
    return f"the ZeroMQ handshake failed (event {event:#x}, {value:#x}): is a psdk ps listening at that address?"


def failed_at_server(event: int, value: int, secure: bool) -> str | None:
    """What a ps (``secure``: with CURVE keys) logs of a connection whose handshake failed; ``None``: nothing.

    An unknown key is named by :class:`psdk.transport.security.KeyRing`; a
    peer that left mid-handshake (no detail, its errno: a port probe such as
    :func:`listening`, a task stopping) is no mistake.
    """
    if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if secure:
            return (
                f"refused a connection without CURVE keys ({KEY_MISMATCH}: a task with transport.secure=false?); "
                "transport.secure must be the same on every task"
            )
        return (
            f"refused a connection with CURVE keys ({KEY_MISMATCH}: this ps runs with transport.secure=false); "
            "transport.secure must be the same on every task"
        )
    if secure and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return f"a CURVE handshake failed ({KEY_MISMATCH}: a task holding another job's ps key?)"
    return f"a ZeroMQ handshake failed (event {event:#x}, {value:#x}): not a psdk task?"


class HandshakeWatch:
    """The latest handshake outcome of each of a client's sockets, from their monitors (owner thread only)."""

    def __init__(self, secure: bool):
        self.secure = secure
        self._monitors: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []
        self._last: list[tuple[int, int] | None] = []

    def add(self, sock: zmq.Socket[Any]) -> None:
        """Watch ``sock``; call before it connects, so its first handshake is seen."""
        self._monitors.append((sock, sock.get_monitor_socket(_EVENTS)))
        self._last.append(None)

    def drain(self) -> None:
        """Take in every event so far. Call it often: a full monitor (2,000 events, a failing handshake
        retried for minutes) stalls libzmq's I/O thread, and every socket of the context with it (measured)."""
        for index, (_, monitor) in enumerate(self._monitors):
            with contextlib.suppress(zmq.ZMQError):
                while monitor.poll(0):
                    event = parse_monitor_message(monitor.recv_multipart())
                    self._last[index] = (int(event["event"]), int(event["value"]))

    def failure(self, index: int) -> str | None:
        """Why socket ``index``'s latest handshake failed; ``None`` if it succeeded, or none was seen."""
        self.drain()
        last = self._last[index]
        if last is None or last[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return None
        return handshake_failure(last[0], last[1], self.secure)

    def close(self) -> None:
        """Stop watching: each socket stops sending events before its monitor's end closes (see zmq_guard)."""
        for sock, monitor in self._monitors:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()
