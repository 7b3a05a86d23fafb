"""What the ZeroMQ transport does per message: frames kept for long-lived buffers, sends without flag
arithmetic, receives with a timeout. Apart from :mod:`psdk.transport.zeromq`, which is about sockets and peers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq


class FrameReuse:
    """Zero-copy frames built once per long-lived buffer, not once per send.

    pyzmq can send one ``zmq.Frame`` many times (each send takes a reference
    to the same message data), while a fresh ``copy=False`` frame per send
    costs a Python object and a release through pyzmq's garbage-collector
    thread, and a copying send allocates (and page-faults) a new buffer. For
    messages marked ``stable`` (a worker's gradient buffer, a ps's reply
    buffer for one worker) the frame of that buffer, the message's first
    array, is kept. The sender must not change a buffer until the peer has
    received it, which a request/reply exchange guarantees.

    Only the first array: the others of a stable message are a table's rows
    and ids, new arrays every step. A kept frame holds its array, so keeping
    theirs held the last 256 messages' rows alive: on a ps serving a table of
    10 million ids, hundreds of MB beside the table (docs/tables.md, Memory).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._frames: dict[int, tuple[Any, zmq.Frame]] = {}

    def frames(self, parts: list[Any], buffer_at: int) -> list[Any]:
        """``parts`` with the long-lived buffer at ``buffer_at`` (the first array) as its kept frame."""
        out = list(parts)
        part = parts[buffer_at] if buffer_at < len(parts) else None
        if isinstance(part, np.ndarray) and part.nbytes >= zmq.COPY_THRESHOLD:
            kept = self._frames.get(id(part))
            if kept is None or kept[0] is not part:
                if len(self._frames) >= self.capacity:
                    self._frames.pop(next(iter(self._frames)))
                kept = self._frames[id(part)] = (part, zmq.Frame(part))
            out[buffer_at] = kept[1]
        return out

    def __len__(self) -> int:
        """Frames kept."""
        return len(self._frames)


# Plain ints: pyzmq's flag enums cost a Python-level ``Flag.__or__`` on every frame sent.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)


def send_parts(sock: zmq.Socket[Any], parts: list[Any], copy: bool) -> None:
    """``send_multipart`` without blocking, minus its per-frame flag arithmetic."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        sock.send(part, _NOBLOCK if i == last else _NOBLOCK_MORE, copy=copy)


class TimedReceiver:
    """Whole messages from one socket, each waited for at most a given time.

    A receive timeout set on the socket (only when it changes) instead of a
    poll before each receive: libzmq waits with the GIL released either way,
    but a poll costs its own system calls and Python objects per message,
    which a ps answering thousands of pushes a second feels.
    """

    def __init__(self, sock: zmq.Socket[Any]):
        self.sock = sock
        self._timeout_ms: int | None = None

    def receive(self, timeout_s: float) -> list[Any] | None:
        timeout_ms = max(0, int(timeout_s * 1000))
        if timeout_ms != self._timeout_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            return self.sock.recv_multipart(copy=False)
        except zmq.Again:
            return None
