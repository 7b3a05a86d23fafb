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

All of it is the ZeroMQ transport's business (:mod:`psdk.transport.zeromq`):
the worker's endpoint lends a shard's buffers, the ps's endpoint maps them,
and both still hand their side ordinary messages whose arrays are views of
this memory. Neither the ps nor the client sees a file descriptor.

The reply rings a doorbell instead of crossing ZeroMQ: a pipe the worker
made, whose write end the ps opens the same way. A ZeroMQ reply wakes
four threads in turn (the ps's I/O thread, TCP, the worker's I/O thread,
the worker's main thread); a byte in a pipe wakes the one that waits, and
on two loaded cores every wake-up saved is ~50-150 us of a round trip. The
reply's wire header (:mod:`psdk.transport.wire`) goes in the file's header. Errors,
refusals and everything but the parameters still come as ZeroMQ messages,
which the worker polls together with its doorbells.

The push knocks the same way: the worker writes its request's wire header
(whose arrays name regions of the file instead of frames) into the file's
header and one byte into a second pipe, whose read end the ps opened at
attach and polls with its socket. The ps's endpoint decodes it as the
message it stands for, from the connection that attached, so every check
a message gets, a knock gets. Once the ps has opened it, the worker closes
its own read end: a ps that lets go (or dies) breaks the pipe, and the
worker's next push goes as a message rather than into the void.

Layout: a 4 KiB header (token; the reply's request id before and after
the ps's last write: a torn read is detected, never used; the reply's wire
header; the same for the request the worker knocked for; the torn-read
check relies on stores becoming visible in order, as on x86: elsewhere
only the pipes' system calls order them), then three
float32 regions of the shard's size: the gradient the backend writes
into, an outbox (a copy sent while the next gradient is computed into the
first region), and the parameters the ps writes; then, for a job with
embedding tables, two heaps for a request's other arrays and its reply's
(:mod:`psdk.transport.heap`: a push's ids and row gradients, the rows it pulled).
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
from psdk.transport.heap import ALIGN, PREFIX_BYTES, Heap

HEADER_BYTES = 4096
TOKEN_BYTES = 16
_SEQ_OFFSET = 16  # two uint64: request id before and after the ps writes a reply
_KNOCK_SEQ_OFFSET = 32  # two uint64: request id before and after the worker writes a knocked request
_LENGTHS_OFFSET = 48  # two uint32: the bytes of the reply's header and of the knocked request's
_REPLY_HEADER = (64, 2048)  # where the reply's wire header lies (offset, most bytes)
_KNOCK_HEADER = (2112, 1984)  # where the knocked request's wire header lies
SLOTS = ("grads", "outbox")
"""Where a request's gradient lies: the buffer the backend writes, or the copy made as it left."""
REPLY_SLOT = "params"
"""Where the ps writes the first array of a reply it writes in place."""
HEAP = "heap"
"""Named last by a message whose arrays after the first lie in a heap (:mod:`psdk.transport.heap`)."""
# Sealed sizes: neither side can shrink the file under the other's mapping.
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)


def available() -> bool:
    """Whether this platform has what a worker needs to offer shared memory (Linux memfd, /proc)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _region_bytes(size: int) -> int:
    return -(-size * 4 // 64) * 64  # each region starts 64-byte aligned


def total_bytes(size: int, heap: int = 0) -> int:
    """The memory file's length for a shard of ``size`` floats and two heaps of ``heap`` bytes."""
    return HEADER_BYTES + 3 * _region_bytes(size) + 2 * heap


class _Header:
    """One wire header in the file, written between two copies of its request id (see :meth:`read`)."""

    def __init__(self, buffer: mmap.mmap, seq_offset: int, length_index: int, area: tuple[int, int]):
        self.seq = np.frombuffer(buffer, np.uint64, 2, offset=seq_offset)
        self._lengths = np.frombuffer(buffer, np.uint32, 2, offset=_LENGTHS_OFFSET)
        self._index = length_index
        self._bytes = np.frombuffer(buffer, np.uint8, area[1], offset=area[0])

    def write(self, rid: int, header: bytes) -> bool:
        """Put ``header`` under ``rid``; ``False`` (nothing written) when it does not fit."""
        if len(header) > self._bytes.size:
            return False
        self.seq[0] = rid
        self._lengths[self._index] = len(header)
        self._bytes[: len(header)] = np.frombuffer(header, np.uint8)
        self.seq[1] = rid
        return True

    def clear(self, rid: int) -> None:
        """Mark ``rid`` as written without a header: a stray wake-up must not pair it with an older one."""
        self.seq[0] = rid
        self._lengths[self._index] = 0
        self.seq[1] = rid

    def read(self) -> tuple[int, bytes] | None:
        """The request id and the header written under it; ``None`` if there is none or it was torn."""
        rid = int(self.seq[1])
        length = min(int(self._lengths[self._index]), self._bytes.size)
        header = self._bytes[:length].tobytes()
        return (rid, header) if rid and length and int(self.seq[0]) == rid else None


class _Views:
    """Numpy views of one memory file: the two headers, the three float32 regions and the two heaps."""

    def __init__(self, buffer: mmap.mmap, size: int, heap: int):
        region = _region_bytes(size)
        self.reply = _Header(buffer, _SEQ_OFFSET, 0, _REPLY_HEADER)
        self.knock = _Header(buffer, _KNOCK_SEQ_OFFSET, 1, _KNOCK_HEADER)
        self.grads, self.outbox, self.params = (
            np.frombuffer(buffer, np.float32, size, offset=HEADER_BYTES + i * region) for i in range(3)
        )
        heaps = HEADER_BYTES + 3 * region
        self.up = Heap(buffer, heaps, heap) if heap else None
        self.down = Heap(buffer, heaps + heap, heap) if heap else None


class WorkerBuffers:
    """A worker's side: one shard's gradient, outbox and parameter regions in a memfd it owns.

    ``heap``: the bytes of each of its two heaps (see :mod:`psdk.transport.heap`), 0 for none.
    """

    def __init__(self, size: int, heap: int = 0):
        self.size, self.heap = size, heap
        self.bell = self._bell_write = self._knock_read = self._knock_write = -1
        self.fd = os.memfd_create("psdk-shard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, total_bytes(size, heap))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, total_bytes(size, heap))
            self.bell, self._bell_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            """The doorbell's read end: readable when the ps has written a reply (poll it with the sockets)."""
        except BaseException:
            self.close()
            raise
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self.token
        views = self._views = _Views(self._map, size, heap)
        self.grads, self.outbox, self._params = views.grads, views.outbox, views.params

    def slot_of(self, array: np.ndarray) -> str | None:
        """Which region ``array`` is (the very buffer, not a copy of it), if it is one a request may name."""
        if array is self.grads:
            return "grads"
        if array is self.outbox:
            return "outbox"
        return None

    def offer(self, bell: bool = True) -> dict[str, Any]:
        """What the ps needs to map these buffers (sent over the authenticated connection).

        ``bell``: the worker listens to its doorbell and may knock for its
        pushes (else both go as messages). Each offer has a knock pipe of
        its own, whose read end only the ps that took the offer keeps (see
        :meth:`knocks_heard`).
        """
        offer = {
            "pid": os.getpid(),
            "fd": self.fd,
            "token": self.token.hex(),
            "bytes": total_bytes(self.size, self.heap),
            "size": self.size,
            "heap": self.heap,
        }
        if bell:
            self._close_knock_pipe()
            self._knock_read, self._knock_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            offer["bell"], offer["knock"] = self._bell_write, self._knock_read
        return offer

    def knocks_heard(self) -> None:
        """The ps opened the knock pipe: close this side's read end.

        From then on the ps holds the only reader, so a ps that lets this
        worker's memory go, or dies, breaks the pipe: the next knock fails
        and the request goes as a message (answered, or refused, at once)
        instead of waiting in a pipe nobody reads.
        """
        _close(self._knock_read)
        self._knock_read = -1

    def fits(self, header: bytes) -> bool:
        """Whether a request ``header`` fits the knock area (else the request goes as a message)."""
        return len(header) <= _KNOCK_HEADER[1]

    def knock(self, rid: int, header: bytes) -> bool:
        """Send request ``rid`` (its wire ``header``; its arrays lie in the regions) by knocking, not by message.

        ``False`` when the knock could not be made (no pipe, a header too big
        for its area, a ps that stopped reading): the request has to go as
        a message. A ps reading while the header changes (a knock after an
        abandoned request) sees it torn and waits for the knock that follows.
        """
        if self._knock_write < 0 or not self._views.knock.write(rid, header):
            return False
        try:
            os.write(self._knock_write, b"\x01")
        except BlockingIOError:
            pass  # a full pipe: the ps has knocks it has not read yet, and reads this request with them
        except OSError:  # EPIPE: no ps reads it any more
            return False
        return True

    def take_reply(self) -> tuple[int, bytes] | None:
        """The request id and wire header of the reply the doorbell announced; ``None`` if there is none to read.

        Drains the doorbell first (one read holds every ring a worker can
        have pending), so one poll wakes once per reply. A reply whose
        header was being rewritten (a late answer to an abandoned request)
        is skipped: its own ring follows.
        """
        with contextlib.suppress(BlockingIOError):
            os.read(self.bell, 65536)
        return self._views.reply.read()

    def put_arrays(self, rid: int, arrays: list[np.ndarray], ends_rooms: bool = False) -> bool:
        """Write request ``rid``'s arrays after its first into the up heap; ``False`` if they do not fit there.
        ``ends_rooms``: the request is the one the rooms lent so far were for (see :meth:`Heap.write`)."""
        return self._views.up is not None and self._views.up.write(rid, arrays, ends_rooms)

    def end_rooms(self) -> None:  # the request they were for left without the heap
        if self._views.up is not None:
            self._views.up.end_rooms()

    def lend_room(self, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays in the up heap for the next push's to be written where they go (:meth:`Heap.lend`)."""
        return self._views.up.lend(shapes) if self._views.up is not None else None

    def read_params(self, into: np.ndarray, rid: int, heap: bool = False) -> list[np.ndarray]:
        """Copy the parameters the ps wrote for request ``rid`` into ``into``; with ``heap``, the arrays after them.

        The ps writes before it replies and the worker reads after, so this
        only fails if a late reply to an abandoned request overwrote them
        while they were read; the parameters are then not used.
        """
        seq = self._views.reply.seq
        if int(seq[1]) != rid:
            raise PsdkError(f"the parameters in shared memory belong to request {int(seq[1])}, not {rid}")
        np.copyto(into, self._params)
        arrays = self._read_heap(rid) if heap else []
        if int(seq[0]) != rid:
            raise PsdkError("the ps overwrote the parameters in shared memory while they were read")
        return arrays

    def _read_heap(self, rid: int) -> list[np.ndarray]:
        if self._views.down is None:
            raise PsdkError("the ps answered with arrays in a heap this worker did not lend it")
        try:
            return self._views.down.read(rid)
        except ProtocolError as exc:
            raise PsdkError(str(exc)) from None

    def _close_knock_pipe(self) -> None:
        _close(self._knock_read, self._knock_write)
        self._knock_read = self._knock_write = -1

    def close(self) -> None:
        """Give up the file descriptors; the mapping goes when the last array viewing it does."""
        self._close_knock_pipe()
        _close(self.fd, self.bell, self._bell_write)
        self.fd = self.bell = self._bell_write = -1


def _int_field(fields: dict[str, Any], key: str, default: int | None = None) -> int:
    value = fields.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"shared memory offer has a bad {key} {value!r}")
    return value


class AttachedBuffers:
    """The ps's side: a worker's memfd, mapped, checked, and written into only as a reply."""

    def __init__(self, fields: dict[str, Any], max_size: int, pipes: bool = True):
        pid, fd, nbytes = _int_field(fields, "pid"), _int_field(fields, "fd"), _int_field(fields, "bytes")
        size, heap = _int_field(fields, "size"), _int_field(fields, "heap", 0)
        try:
            token = bytes.fromhex(str(fields.get("token")))
        except ValueError:
            raise ProtocolError("shared memory offer has a bad token") from None
        if size > max_size:
            raise ProtocolError(f"shared memory for {size:,} floats offered, more than a message may hold here")
        if heap and (heap > 4 * max_size or heap < PREFIX_BYTES or heap % ALIGN):
            raise ProtocolError(f"shared memory offered with heaps of {heap:,} bytes (0, or {PREFIX_BYTES} to "
                                f"{4 * max_size:,} in steps of {ALIGN})")  # fmt: skip
        if nbytes != total_bytes(size, heap):
            raise ProtocolError(
                f"shared memory of {nbytes} bytes offered for {size} floats and heaps of {heap}, which need "
                f"{total_bytes(size, heap)}"
            )
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
        self.size = size
        views = self._views = _Views(self._map, size, heap)
        self._params = views.params
        self._slots = dict(zip(SLOTS, (views.grads, views.outbox), strict=True))
        self.bell = -1
        """The doorbell's write end, or -1: the worker then gets its replies as ZeroMQ messages."""
        self.knock = -1
        """The read end of the pipe the worker knocks on for a push, or -1: it pushes in messages."""
        if pipes:
            self._open_pipes(pid, fields.get("bell"), fields.get("knock"))
        self.hung_up = False
        """The knock pipe has no writer left: the worker closed these buffers, or is gone."""
        self._last_knock = int(views.knock.seq[1])  # a request an earlier attachment took (or never will)

    def _open_pipes(self, pid: int, bell: Any, knock: Any) -> None:
        """Only the worker's anonymous pipes are written to or read: two different ones, else none."""
        seen: list[int] = []

        def anonymous_pipe(found: os.stat_result) -> bool:
            seen.append(found.st_ino)
            return stat.S_ISFIFO(found.st_mode) and found.st_dev == _pipe_device() and seen.count(found.st_ino) == 1

        self.bell = _open_pipe(pid, bell, os.O_WRONLY, anonymous_pipe)
        if self.bell >= 0:
            self.knock = _open_pipe(pid, knock, os.O_RDONLY, anonymous_pipe)

    def take_knock(self) -> tuple[int, bytes] | None:
        """The request id and wire header of the request the worker knocked for; ``None`` if there is none new.

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
        taken = self._views.knock.read()
        if taken is None or taken[0] <= self._last_knock:
            return None
        self._last_knock = taken[0]
        return taken

    def region(self, slot: Any) -> np.ndarray:
        """The region a request names for its array, read in place: the worker leaves it alone until the reply."""
        grad = self._slots.get(slot) if isinstance(slot, str) else None
        if grad is None:
            raise ProtocolError(f"unknown shared-memory slot {str(slot)[:32]!r} (one of {list(SLOTS)})")
        return grad

    def take_arrays(self, rid: int, borrow_values: bool = False) -> list[np.ndarray]:
        """The arrays request ``rid`` put in the up heap (ProtocolError: none, or torn): private copies, except
        with ``borrow_values`` float32 values (a push's row gradients), read in place until the reply."""
        if self._views.up is None:
            raise ProtocolError("the request names a heap its sender did not lend")
        return self._views.up.read(rid, copy_values=not borrow_values)

    def fits(self, arrays: list[np.ndarray]) -> bool:
        """Whether a reply's arrays after its first fit the down heap (else the reply goes as frames)."""
        return not arrays or (self._views.down is not None and self._views.down.fits(arrays))

    def reply_room(self, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays in the down heap for the rows of request ``rid``'s reply (see :meth:`Heap.room`)."""
        return self._views.down.room(rid, shapes) if self._views.down is not None else None

    def write_reply(
        self, array: np.ndarray, rid: int, header: bytes | None, arrays: list[np.ndarray] | None = None
    ) -> bool:
        """Write the reply's first array for request ``rid`` (and the ``arrays`` after it, which :meth:`fits`);
        with its wire ``header``, ring the doorbell too.

        Returns whether the worker was rung: if not, the header has to go as
        a ZeroMQ message (no doorbell, a header too big for its area, or a
        worker that closed its end).
        """
        reply = self._views.reply
        reply.seq[0] = rid
        np.copyto(self._params, array)
        if arrays and self._views.down is not None:
            self._views.down.write(rid, arrays)
        ring = self.bell >= 0 and header is not None and reply.write(rid, header)
        if not ring:
            reply.clear(rid)
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
