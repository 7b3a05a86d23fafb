"""Same-host shared memory for a worker's gradients and the parameters its ps sends back.

A ps and a worker on one host need not move each step's arrays through TCP
loopback: every push and reply crossed the kernel twice (four copies of the
model per round trip) and kept both sides' ZeroMQ I/O threads busy, about
40% of a round trip's CPU for the MLP. Instead a worker keeps each shard's
buffers in an anonymous memory file (``memfd``) and tells its ps where to
find it (its pid, the file descriptor and a random token); the ps maps it
through ``/proc/<pid>/fd/<n>``, reads the gradient there and writes the
fresh parameters there, and the ZeroMQ messages carry only their headers.

Why a memfd and not a named ``/dev/shm`` segment: it has no name to leak,
so a worker or ps killed at any moment leaves nothing behind; the memory
goes with the last process that maps it, and a restarted ps maps it again.
The file is sealed against resizing (a shrunk file would crash the ps
with SIGBUS), which also proves to the ps that it maps a memfd, not some
other file a peer pointed it to; the token proves it is this worker's.
Anything that does not work (another host or container, no memfd, a
refusing ps) leaves that shard on plain ZeroMQ frames.

The reply rings a doorbell instead of crossing ZeroMQ: a pipe the worker
made, whose write end the ps opens the same way. A ZeroMQ reply wakes
four threads in turn (the ps's I/O thread, TCP, the worker's I/O thread,
the worker's main thread); a byte in a pipe wakes the one that waits, and
on two loaded cores every wake-up saved is ~50-150 us of a round trip. The
reply's few fields (version, done, outcome, slowest) go in the header.
Errors, refusals and everything but the parameters still come as ZeroMQ
messages, which the worker polls together with its doorbells.

The push knocks the same way: the worker writes its request's few fields
(version, sequence number, epoch, which region holds the gradient) into
the header and writes one byte into a second pipe, whose read end the ps
opened at attach and polls with its socket. The ps handles it as the
``push_pull`` message it stands for, from the session that attached, so
every check a message gets, a knock gets. Everything else a worker asks
still goes as a ZeroMQ message. Once the ps has opened it, the worker
closes its own read end: a ps that lets go (or dies) breaks the pipe,
and the worker's next push goes as a message rather than into the void.

Layout: a 128-byte header (token; the reply's request id before and after
the ps's last write: a torn read is detected, never used; the reply's
fields; the same for the request the worker knocked for; the torn-read
check relies on stores becoming visible in order, as on x86: elsewhere
only the pipes' system calls order them), then three
float32 regions of the shard's size: the gradient the backend writes
into, an outbox (a copy sent while the next gradient is computed into the
first region), and the parameters the ps writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from psdk.errors import ProtocolError, PsdkError
from psdk.wire import Message

HEADER_BYTES = 128
TOKEN_BYTES = 16
_SEQ_OFFSET = 16  # two uint64: request id before and after the ps writes the parameters
_REPLY_OFFSET = 32  # four int64: version, done, outcome (index in OUTCOMES), slowest (-1: none)
_KNOCK_SEQ_OFFSET = 64  # two uint64: request id before and after the worker writes a knocked request
_KNOCK_OFFSET = 80  # four int64: version, seq, epoch, slot (index in SLOTS)
OUTCOMES = ("applied", "dropped", "done", "parked")
"""The outcomes a reply through the doorbell can carry (any other goes as a ZeroMQ message)."""
SLOTS = ("grads", "outbox")
"""Where a push's gradient is: the buffer the backend writes, or the copy made as it left."""
# Sealed sizes: neither side can shrink the file under the other's mapping.
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)


def available() -> bool:
    """Whether this platform has what a worker needs to offer shared memory (Linux memfd, /proc)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _region_bytes(size: int) -> int:
    return -(-size * 4 // 64) * 64  # each region starts 64-byte aligned


def total_bytes(size: int) -> int:
    """The memory file's length for a shard of ``size`` floats."""
    return HEADER_BYTES + 3 * _region_bytes(size)


class _Views:
    """Numpy views of one memory file: request ids, the reply's and request's fields, the three regions."""

    def __init__(self, buffer: mmap.mmap, size: int):
        region = _region_bytes(size)
        self.seq = np.frombuffer(buffer, np.uint64, 2, offset=_SEQ_OFFSET)
        self.reply = np.frombuffer(buffer, np.int64, 4, offset=_REPLY_OFFSET)
        self.knock_seq = np.frombuffer(buffer, np.uint64, 2, offset=_KNOCK_SEQ_OFFSET)
        self.knock = np.frombuffer(buffer, np.int64, 4, offset=_KNOCK_OFFSET)
        self.grads, self.outbox, self.params = (
            np.frombuffer(buffer, np.float32, size, offset=HEADER_BYTES + i * region) for i in range(3)
        )


class WorkerBuffers:
    """A worker's side: one shard's gradient, outbox and parameter regions in a memfd it owns."""

    def __init__(self, size: int):
        self.size = size
        self.bell = self._bell_write = self._knock_read = self._knock_write = -1
        self.fd = os.memfd_create("psdk-shard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, total_bytes(size))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, total_bytes(size))
            self.bell, self._bell_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            """The doorbell's read end: readable when the ps has written a reply (poll it with the sockets)."""
        except BaseException:
            self.close()
            raise
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self.token
        views = self._views = _Views(self._map, size)
        self._seq, self.grads, self.outbox, self._params = views.seq, views.grads, views.outbox, views.params

    def offer(self, bell: bool = True) -> dict[str, Any]:
        """What the ps needs to map these buffers (sent over the authenticated connection).

        ``bell``: the worker listens to its doorbell and may knock for its
        pushes (else both go as messages). Each offer has a knock pipe of
        its own, whose read end only the ps that took the offer keeps (see
        :meth:`knocks_heard`).
        """
        offer = {"pid": os.getpid(), "fd": self.fd, "token": self.token.hex(), "bytes": total_bytes(self.size)}
        if bell:
            self._close_knock_pipe()
            self._knock_read, self._knock_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            offer["bell"], offer["knock"] = self._bell_write, self._knock_read
        return offer

    def knocks_heard(self) -> None:
        """The ps opened the knock pipe: close this side's read end.

        From then on the ps holds the only reader, so a ps that lets this
        worker's memory go, or dies, breaks the pipe: the next knock fails
        and the push goes as a message (answered, or refused, at once)
        instead of waiting in a pipe nobody reads.
        """
        _close(self._knock_read)
        self._knock_read = -1

    def knock(self, rid: int, version: int, seq: int, epoch: int, slot: str) -> bool:
        """Ask for a push-and-pull of the gradient in ``slot`` by knocking, not by message.

        The fields go between the two writes of the request id, so a ps
        reading while they change (a knock after an abandoned request) sees
        a torn request and waits for the knock that follows. ``False`` when
        the knock could not be made (the request has to go as a message).
        """
        if self._knock_write < 0:
            return False
        self._views.knock_seq[0] = rid
        self._views.knock[:] = (version, seq, epoch, SLOTS.index(slot))
        self._views.knock_seq[1] = rid
        try:
            os.write(self._knock_write, b"\x01")
        except BlockingIOError:
            pass  # a full pipe: the ps has knocks it has not read yet, and reads this request with them
        except OSError:  # EPIPE: no ps reads it any more
            return False
        return True

    def take_reply(self) -> Message | None:
        """The reply the doorbell announced, built from the header; ``None`` if there is none to read.

        Drains the doorbell first (one read holds every ring a worker can
        have pending), so one poll wakes once per reply. A reply whose
        fields were being rewritten (a late answer to an abandoned request)
        is skipped: its own ring follows.
        """
        with contextlib.suppress(BlockingIOError):
            os.read(self.bell, 65536)
        locked = _read_locked(self._seq, self._views.reply)
        if locked is None:
            return None
        rid, (version, done, outcome, slowest) = locked
        if not 0 <= outcome < len(OUTCOMES):
            return None
        fields: dict[str, Any] = {"version": version, "done": bool(done), "outcome": OUTCOMES[outcome], "shm": True}
        if slowest >= 0:
            fields["slowest"] = slowest
        return Message("params", fields, [], rid)

    def read_params(self, into: np.ndarray, rid: int) -> None:
        """Copy the parameters the ps wrote for request ``rid`` into ``into``.

        The ps writes before it replies and the worker reads after, so this
        only fails if a late reply to an abandoned request overwrote them
        while they were read; the parameters are then not used.
        """
        if int(self._seq[1]) != rid:
            raise PsdkError(f"the parameters in shared memory belong to request {int(self._seq[1])}, not {rid}")
        np.copyto(into, self._params)
        if int(self._seq[0]) != rid:
            raise PsdkError("the ps overwrote the parameters in shared memory while they were read")

    def _close_knock_pipe(self) -> None:
        _close(self._knock_read, self._knock_write)
        self._knock_read = self._knock_write = -1

    def close(self) -> None:
        """Give up the file descriptors; the mapping goes when the last array viewing it does."""
        self._close_knock_pipe()
        _close(self.fd, self.bell, self._bell_write)
        self.fd = self.bell = self._bell_write = -1


def _int_field(fields: dict[str, Any], key: str) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"shared memory offer has a bad {key} {value!r}")
    return value


class AttachedBuffers:
    """The ps's side: a worker's memfd, mapped, checked, and written into only as a reply."""

    def __init__(self, fields: dict[str, Any], size: int, pipes: bool = True):
        pid, fd, nbytes = _int_field(fields, "pid"), _int_field(fields, "fd"), _int_field(fields, "bytes")
        try:
            token = bytes.fromhex(str(fields.get("token")))
        except ValueError:
            raise ProtocolError("shared memory offer has a bad token") from None
        if nbytes != total_bytes(size):
            raise ProtocolError(f"shared memory of {nbytes} bytes offered for a shard that needs {total_bytes(size)}")
        handle = _open_checked(
            pid, fd, os.O_RDWR, lambda found: stat.S_ISREG(found.st_mode) and found.st_size == nbytes
        )
        if handle is None:
            raise ProtocolError(f"the offered file is not a memory file of {nbytes} bytes")
        try:
            try:
                seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
            except OSError:
                raise ProtocolError("the offered file is not a sealed memory file") from None
            if seals & _SEALS != _SEALS or os.fstat(handle).st_size != nbytes:
                raise ProtocolError("the offered memory file is not sealed at the size it claims")
            self._map = mmap.mmap(handle, nbytes)
        finally:
            os.close(handle)
        if not secrets.compare_digest(self._map[:TOKEN_BYTES], token):
            raise ProtocolError("the offered memory file does not hold the worker's token")
        views = _Views(self._map, size)
        self._seq, self._reply, self._params = views.seq, views.reply, views.params
        self._slots = dict(zip(SLOTS, (views.grads, views.outbox), strict=True))
        self.session = b""
        """The connection that offered it: parameters are only written for requests from there."""
        self._knock_seq, self._knock = views.knock_seq, views.knock
        self.bell = -1
        """The doorbell's write end, or -1: the worker then gets its replies as ZeroMQ messages."""
        self.knock = -1
        """The read end of the pipe the worker knocks on for a push, or -1: it pushes in messages."""
        if pipes:
            self._open_pipes(pid, fields.get("bell"), fields.get("knock"))
        self.hung_up = False
        """The knock pipe has no writer left: the worker closed these buffers, or is gone."""
        self._last_knock = int(self._knock_seq[1])  # a request an earlier attachment took (or never will)

    def _open_pipes(self, pid: int, bell: Any, knock: Any) -> None:
        """Only the worker's anonymous pipes are written to or read: two different ones, else none."""
        seen: list[int] = []

        def anonymous_pipe(found: os.stat_result) -> bool:
            seen.append(found.st_ino)
            return stat.S_ISFIFO(found.st_mode) and found.st_dev == _pipe_device() and seen.count(found.st_ino) == 1

        self.bell = _open_pipe(pid, bell, os.O_WRONLY, anonymous_pipe)
        if self.bell >= 0:
            self.knock = _open_pipe(pid, knock, os.O_RDONLY, anonymous_pipe)

    def take_knock(self) -> tuple[int, dict[str, Any]] | None:
        """The request id and fields of the push the worker knocked for; ``None`` if there is none new.

        Drains the pipe first (one wake-up per knock). A request read while
        the worker rewrote it is skipped (its own knock follows), and so is
        one already taken (two knocks read apart for one request). End of
        file means the worker's process is gone: :attr:`hung_up`.
        """
        try:  # one read per wake-up: a worker that floods its pipe cannot hold the ps here
            if not os.read(self.knock, 65536):
                self.hung_up = True
                return None
        except BlockingIOError:
            pass
        except OSError:
            self.hung_up = True
            return None
        locked = _read_locked(self._knock_seq, self._knock)
        if locked is None or locked[0] <= self._last_knock:
            return None
        rid, (version, seq, epoch, slot) = locked
        self._last_knock = rid
        named = SLOTS[slot] if 0 <= slot < len(SLOTS) else slot  # an unknown slot is refused as in a message
        return rid, {"version": version, "seq": seq, "epoch": epoch, "shm": named}

    def gradient(self, slot: Any) -> np.ndarray:
        """The pushed gradient, read in place: the worker leaves it alone until it has the reply."""
        grad = self._slots.get(slot) if isinstance(slot, str) else None
        if grad is None:
            raise ProtocolError(f"unknown shared-memory slot {slot!r} (one of {list(SLOTS)})")
        return grad

    def write_params(self, params: np.ndarray, rid: int, reply: dict[str, Any] | None = None) -> bool:
        """Write the parameters for request ``rid``; with ``reply``'s fields, ring the doorbell too.

        Returns whether the worker was rung: if not, the reply has to go as
        a ZeroMQ message (no doorbell, an outcome the header cannot hold, or
        a worker that closed its end).
        """
        self._seq[0] = rid
        np.copyto(self._params, params)
        outcome = reply.get("outcome") if reply is not None else None
        ring = self.bell >= 0 and reply is not None and outcome in OUTCOMES
        if ring and reply is not None:
            slowest = reply.get("slowest")
            self._reply[:] = (
                int(reply["version"]),
                int(bool(reply.get("done"))),
                OUTCOMES.index(str(outcome)),
                -1 if slowest is None else int(slowest),
            )
        if not ring:
            self._reply[2] = -1  # no reply fields for this rid: a stray ring must not pair it with older ones
        self._seq[1] = rid
        if not ring:
            return False
        try:
            os.write(self.bell, b"\x01")
        except BlockingIOError:
            pass  # a full pipe: the worker has rings it has not read yet, and reads this reply with them
        except OSError:  # the worker closed its end (it is gone)
            return False
        return True

    def close(self) -> None:
        """Close both pipes; the mapping goes when the last array viewing it does."""
        _close(self.bell, self.knock)
        self.bell = self.knock = -1


def _read_locked(seq: np.ndarray, fields: np.ndarray) -> tuple[int, list[int]] | None:
    """A request id and the fields written under it, or ``None`` if none is there or it was torn.

    The writer sets ``seq[0]``, then the fields, then ``seq[1]``; reading in
    the opposite order, a write in progress shows as ``seq[0] != seq[1]``.
    """
    rid = int(seq[1])
    values = [int(v) for v in fields]
    return (rid, values) if rid and int(seq[0]) == rid else None


def _close(*fds: int) -> None:
    """Close whichever of ``fds`` are open (-1: not), whatever state their other ends are in."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _pipe_device() -> int:
    """The device of anonymous pipes (pipefs): a named FIFO on some file system has another."""
    global _PIPE_DEVICE
    if _PIPE_DEVICE is None:
        read, write = os.pipe()
        try:
            _PIPE_DEVICE = os.fstat(read).st_dev
        finally:
            os.close(read)
            os.close(write)
    return _PIPE_DEVICE


_PIPE_DEVICE: int | None = None


def _open_pipe(pid: int, fd: Any, flags: int, accept: Callable[[os.stat_result], bool]) -> int:
    """A worker's pipe opened with ``flags`` if ``accept`` likes it, else -1 (no doorbell, not an error)."""
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        return -1
    try:
        handle = _open_checked(pid, fd, flags, accept)
    except ProtocolError:
        return -1
    return -1 if handle is None else handle


def _open_checked(pid: int, fd: int, flags: int, accept: Callable[[os.stat_result], bool]) -> int | None:
    """Open another process's file descriptor ``fd`` if ``accept`` likes what it is; ``None`` if not.

    O_PATH first: a handle that reads and writes nothing (a device is never
    really opened), checked, then reopened through that same handle, so what
    was checked is what gets opened.
    """
    try:
        probe = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except OSError:
        raise ProtocolError("cannot open the worker's shared memory (another host or container?)") from None
    try:
        if not accept(os.fstat(probe)):
            return None
        return os.open(f"/proc/self/fd/{probe}", flags | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        raise ProtocolError("cannot open the worker's shared memory (another host or container?)") from None
    finally:
        os.close(probe)
