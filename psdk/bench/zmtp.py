"""A raw ZMTP 3.0 peer: what a hostile client can send that no libzmq socket would.

libzmq never lets a sender stream a message without end (it sends a
multipart message only once its last frame is queued), so the attacks on a
ps's memory are made here with plain TCP: the NULL-mechanism greeting and
handshake, then frames whose "more" flag is never cleared. The memory
benchmark (``python -m psdk bench memory=true``) floods a ps with it, so it
lives with the bench, not with the test kit (product code imports no test
tooling); psdk's tests use it too. It speaks to a ps without CURVE only, as
an unauthenticated stranger would.
"""

from __future__ import annotations

import socket
import struct
import time

_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _frame_header(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


class RawZmtpPeer:
    """One TCP connection speaking just enough ZMTP to reach a ROUTER socket as a DEALER."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.sendall(_GREETING)
        greeting = b""
        while len(greeting) < len(_GREETING):
            chunk = self.sock.recv(len(_GREETING) - len(greeting))
            if not chunk:
                raise ConnectionError("the server closed the connection during the greeting")
            greeting += chunk
        ready = bytes([5]) + b"READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
        self.sock.sendall(_frame_header(_COMMAND, len(ready)) + ready)

    def send_frame(self, payload: bytes, more: bool) -> None:
        """One frame; ``more`` leaves the message open for another frame."""
        self.sock.sendall(_frame_header(_MORE if more else 0, len(payload)) + payload)

    def send_message(self, frames: list[bytes]) -> None:
        for index, frame in enumerate(frames):
            self.send_frame(frame, more=index < len(frames) - 1)

    def flood(self, frame_bytes: int, frames: int, stall_s: float = 1.0) -> int:
        """Up to ``frames`` frames of one message that never ends; how many went before the server hung up.

        A server that closes a connection it stopped reading may leave the
        kernel's window shut instead of resetting it: a send that makes no
        progress for ``stall_s`` counts as the end too.
        """
        chunk = _frame_header(_MORE, frame_bytes) + bytes(frame_bytes)
        self.sock.settimeout(stall_s)
        for sent in range(frames):
            try:
                self.sock.sendall(chunk)
            except OSError:
                return sent
        return frames

    def closed_by_server(self, timeout_s: float) -> bool:
        """Whether the server ended the connection within ``timeout_s`` (reads and drops what it sends)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(65536):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()
