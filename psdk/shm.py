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

Layout: a 64-byte header (token, then the request id before and after the
ps's last write of the parameters: a torn read is detected, never used),
then three float32 regions of the shard's size: the gradient the backend
writes into, an outbox (a copy sent while the next gradient is computed
into the first region), and the parameters the ps writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
import sys
from typing import Any

import numpy as np

from psdk.errors import ProtocolError, PsdkError

HEADER_BYTES = 64
TOKEN_BYTES = 16
_SEQ_OFFSET = 16  # two uint64: request id before and after the ps writes the parameters
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


def _views(buffer: mmap.mmap, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    region = _region_bytes(size)
    seq = np.frombuffer(buffer, np.uint64, 2, offset=_SEQ_OFFSET)
    grads, outbox, params = (
        np.frombuffer(buffer, np.float32, size, offset=HEADER_BYTES + i * region) for i in range(3)
    )
    return seq, grads, outbox, params


class WorkerBuffers:
    """A worker's side: one shard's gradient, outbox and parameter regions in a memfd it owns."""

    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create("psdk-shard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, total_bytes(size))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, total_bytes(size))
        except BaseException:
            os.close(self.fd)
            raise
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self.token
        self._seq, self.grads, self.outbox, self._params = _views(self._map, size)

    def offer(self) -> dict[str, Any]:
        """What the ps needs to map these buffers (sent over the authenticated connection)."""
        return {"pid": os.getpid(), "fd": self.fd, "token": self.token.hex(), "bytes": total_bytes(self.size)}

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

    def close(self) -> None:
        """Give up the file descriptor; the mapping goes when the last array viewing it does."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _int_field(fields: dict[str, Any], key: str) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"shared memory offer has a bad {key} {value!r}")
    return value


class AttachedBuffers:
    """The ps's side: a worker's memfd, mapped, checked, and written into only as a reply."""

    def __init__(self, fields: dict[str, Any], size: int):
        pid, fd, nbytes = _int_field(fields, "pid"), _int_field(fields, "fd"), _int_field(fields, "bytes")
        try:
            token = bytes.fromhex(str(fields.get("token")))
        except ValueError:
            raise ProtocolError("shared memory offer has a bad token") from None
        if nbytes != total_bytes(size):
            raise ProtocolError(f"shared memory of {nbytes} bytes offered for a shard that needs {total_bytes(size)}")
        try:
            # O_PATH first: a handle that reads and writes nothing (a device or a pipe is never really opened),
            # checked, then reopened through that same handle, so what was checked is what gets mapped.
            probe = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
        except OSError:
            raise ProtocolError("cannot open the worker's shared memory (another host or container?)") from None
        try:
            found = os.fstat(probe)
            if not stat.S_ISREG(found.st_mode) or found.st_size != nbytes:
                raise ProtocolError(f"the offered file is not a memory file of {nbytes} bytes")
            handle = os.open(f"/proc/self/fd/{probe}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            raise ProtocolError("cannot open the worker's shared memory (another host or container?)") from None
        finally:
            os.close(probe)
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
        self._seq, grads, outbox, self._params = _views(self._map, size)
        self._slots = dict(zip(SLOTS, (grads, outbox), strict=True))
        self.session = b""
        """The connection that offered it: parameters are only written for requests from there."""

    def gradient(self, slot: Any) -> np.ndarray:
        """The pushed gradient, read in place: the worker leaves it alone until it has the reply."""
        grad = self._slots.get(slot) if isinstance(slot, str) else None
        if grad is None:
            raise ProtocolError(f"unknown shared-memory slot {slot!r} (one of {list(SLOTS)})")
        return grad

    def write_params(self, params: np.ndarray, rid: int) -> None:
        self._seq[0] = rid
        np.copyto(self._params, params)
        self._seq[1] = rid
