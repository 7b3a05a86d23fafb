"""A lent memory's room for a message's other arrays: the ids and rows of embedding tables.

A push with tables carries, after its dense gradient, each table's ids and
row gradients, and its reply the rows it pulled. Sent as ZeroMQ frames they
kept both sides' I/O threads busy (a sixth of a CTR job's CPU with CURVE,
which encrypts every byte) while the dense arrays beside them crossed lent
memory. A *heap* is a region of the worker's memory file (see
:mod:`psdk.transport.shm`) that holds such arrays: one heap for what the
worker sends (``up``), one for what the ps writes back (``down``).

A heap starts with the request id before and after its arrays were written
(a reader checks both around its copy, so a torn read is detected, never
used), the number of arrays, and one descriptor per array (dtype, rows,
columns, offset); the arrays follow, each 64-byte aligned. Descriptors are
copied before they are checked, and ids (int64) are copied out at once: the
ps never indexes with ids a worker could change after they were checked.
The worker copies everything out, as its next request may reuse the heap
once it has the reply. The ps may read a push's float32 values (row
gradients) in place, as it reads a dense gradient in a lent region: changed
under it by a misbehaving worker they are only other numbers, and every
update checks what it wrote is finite
(:meth:`psdk.ps.tables.served.ServedTable.stage_update`); a push it keeps
past its reply has them copied before they are checked
(``ServedShard._keeps_pushes``), and any other request's are copied out.

The worker may also *lend* itself room at the top of its up heap before a
request (:meth:`Heap.lend`): a push's row gradients written there by the
backward, as a dense gradient is written into its lent region, are sent
from where they lie, never copied. Arrays are then not in message order in
the heap; the reader checks that none overlaps another, whatever their
order.

Only what tables send fits (float32 and int64, one or two dimensions, at
most :data:`MAX_ARRAYS`); anything else, or arrays beyond the heap's size,
leaves the message on ZeroMQ frames.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from psdk.errors import ProtocolError
from psdk.transport.wire import MAX_DIM

MAX_ARRAYS = 24
"""Arrays one heap holds (a table's push and pull take three: eight tables a request)."""
_DTYPES = (np.dtype("<f4"), np.dtype("<i8"))
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_SEQ, _COUNT, _DESCRIPTORS = 0, 16, 64  # byte offsets in a heap's prefix
PREFIX_BYTES = 1024  # the prefix: seq (2 x uint64), count (uint64), descriptors (4 x uint64 each)
ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _address(array: np.ndarray) -> int:
    """Where ``array``'s first byte lies in this process's memory."""
    return int(array.__array_interface__["data"][0])


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where arrays of ``sizes`` bytes go in a heap's data, in order, each 64-byte aligned; and the bytes taken."""
    offsets, at = [], 0
    for nbytes in sizes:
        offsets.append(at)
        at += aligned(nbytes)
    return offsets, at


def _float_rooms(shapes: list[tuple[int, int]]) -> tuple[list[int], list[int], int] | None:
    """Float32 arrays of ``shapes`` one after another: their offsets, sizes and the bytes taken; None if a heap
    cannot hold them (too many, or a shape without columns)."""
    if len(shapes) > MAX_ARRAYS or any(cols < 1 for _, cols in shapes):
        return None
    sizes = [rows * cols * _DTYPES[0].itemsize for rows, cols in shapes]
    offsets, end = _offsets(sizes)
    return offsets, sizes, end


def heap_bytes(arrays_bytes: int, count: int) -> int:
    """The heap size that holds ``count`` arrays of ``arrays_bytes`` bytes in all, whatever their alignment."""
    return PREFIX_BYTES + aligned(arrays_bytes) + count * ALIGN if arrays_bytes else 0


class Heap:
    """One heap in a memory file: ``write`` arrays under a request id, ``read`` them back (ids always copied)."""

    def __init__(self, buffer: mmap.mmap, offset: int, nbytes: int):
        self._seq = np.frombuffer(buffer, np.uint64, 2, offset=offset + _SEQ)
        self._count = np.frombuffer(buffer, np.uint64, 1, offset=offset + _COUNT)
        self._descriptors = np.frombuffer(buffer, np.uint64, 4 * MAX_ARRAYS, offset=offset + _DESCRIPTORS).reshape(
            MAX_ARRAYS, 4
        )
        self._data = np.frombuffer(buffer, np.uint8, nbytes - PREFIX_BYTES, offset=offset + PREFIX_BYTES)
        self._base = _address(self._data)
        self._lent: tuple[int, int] | None = None
        """The rooms :meth:`lend` gave (start and end offsets in the data), until the writer's next push ends them."""

    def fits(self, arrays: list[np.ndarray]) -> bool:
        """Whether ``arrays`` can be written here (kinds, count and bytes); else they go as frames."""
        return self._layout(arrays) is not None

    def _layout(self, arrays: list[np.ndarray]) -> list[int] | None:
        """Where each of ``arrays`` goes in the data: those lying in lent room stay there, the others follow one
        another from the start, below any room lent; None if they cannot all be written."""
        if len(arrays) > MAX_ARRAYS:
            return None
        kept: list[int | None] = []
        for array in arrays:
            if array.dtype not in _CODES or array.ndim not in (1, 2) or (array.ndim == 2 and not array.shape[1]):
                return None
            at = self._lent_place(array) if self._lent is not None else None
            if at is not None and any(a is not None and at < a + b.nbytes and a < at + array.nbytes
                                      for a, b in zip(kept, arrays, strict=False)):  # fmt: skip
                at = None  # the same room given twice: the second is copied, so arrays never overlap
            kept.append(at)
        offsets, end = _offsets([array.nbytes for array, at in zip(arrays, kept, strict=True) if at is None])
        if end > (self._lent[0] if self._lent else self._data.size):
            return None
        below = iter(offsets)
        return [next(below) if at is None else at for at in kept]

    def _lent_place(self, array: np.ndarray) -> int | None:
        """The offset of ``array`` if it is (part of) the room :meth:`lend` gave, aligned and whole; else None."""
        if self._lent is None or array.dtype != _DTYPES[0] or not array.nbytes or not array.flags.c_contiguous:
            return None
        at = _address(array) - self._base
        low, high = self._lent
        return at if low <= at and at + array.nbytes <= high and not at % ALIGN else None

    def room(self, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays of ``shapes`` where :meth:`write` of request ``rid`` would put them (None: no room),
        for a writer to fill in place; written with them, they are not copied again.

        From now on the heap reads as torn for any other request: a reader
        still copying an earlier one's arrays sees it changed under it.
        """
        planned = _float_rooms(shapes)
        if planned is None or planned[2] > self._data.size:
            return None
        offsets, sizes, _ = planned
        self._seq[0] = rid
        return self._views(offsets, sizes, shapes)

    def lend(self, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays of ``shapes`` at the top of the heap (None: no room), for the writer to fill before the
        request that sends them: :meth:`write` leaves them where they lie.

        Rooms lent one after another lie one below the other (a request
        with two tables' rows); they stay the writer's, and other arrays are
        written below them, until a write that ends them (the writer's next
        push, whether it sent them or not: see :meth:`write`). Lend only when
        no reader is left (every request that used the heap was answered):
        from now on the heap reads as torn for any request.
        """
        planned = _float_rooms(shapes)
        if planned is None:
            return None
        offsets, sizes, end = planned
        low, high = self._lent or (self._data.size, self._data.size)
        if end > low:  # never over a room still lent: the caller may hold it yet
            return None
        base = (low - end) // ALIGN * ALIGN
        self._seq[0] = 0  # no request's: a reader still copying sees its arrays rewritten
        self._lent = (base, high)
        return self._views([base + at for at in offsets], sizes, shapes)

    def _views(self, offsets: list[int], sizes: list[int], shapes: list[tuple[int, int]]) -> list[np.ndarray]:
        places = zip(offsets, sizes, shapes, strict=True)
        return [self._data[at : at + nbytes].view(_DTYPES[0]).reshape(shape) for at, nbytes, shape in places]

    def write(self, rid: int, arrays: list[np.ndarray], ends_rooms: bool = False) -> bool:
        """Put ``arrays`` under request ``rid``; those :meth:`room` or :meth:`lend` gave are there already.
        ``False`` (nothing written) if they do not fit (see :meth:`fits`). ``ends_rooms``: the rooms lent so far
        were for this request (sent in it or not); written or not, the heap is whole again for the next."""
        offsets = self._layout(arrays)
        if ends_rooms:
            self.end_rooms()
        if offsets is None:
            return False
        self._seq[0] = rid
        for i, (array, at) in enumerate(zip(arrays, offsets, strict=True)):
            rows, cols = (array.shape[0], 0) if array.ndim == 1 else array.shape
            self._descriptors[i] = (_CODES[array.dtype], rows, cols, at)
            if _address(array) != self._base + at or not array.flags.c_contiguous:  # else filled where it goes
                np.copyto(self._data[at : at + array.nbytes].view(array.dtype).reshape(array.shape), array)
        self._count[0] = len(arrays)
        self._seq[1] = rid
        return True

    def end_rooms(self) -> None:
        """The rooms lent so far are not the writer's any more (their request was sent)."""
        self._lent = None

    def read(self, rid: int, copy_values: bool = True) -> list[np.ndarray]:
        """Copies of the arrays written under request ``rid``; ProtocolError if they are not (or were torn).

        Without ``copy_values``, float32 arrays are views of the heap (valid
        until the writer's next request); ids are copied whatever it says.
        """
        if int(self._seq[1]) != rid:
            raise ProtocolError(f"the arrays in shared memory belong to request {int(self._seq[1])}, not {rid}")
        count = int(self._count[0])
        if count > MAX_ARRAYS:
            raise ProtocolError(f"shared memory names {count} arrays, more than {MAX_ARRAYS}")
        descriptors = self._descriptors[:count].copy()  # checked as copied: the writer cannot change them after
        places = [self._place(index, *(int(v) for v in descriptor)) for index, descriptor in enumerate(descriptors)]
        end = 0
        for at, nbytes, _, _ in sorted(places, key=lambda place: (place[0], place[1])):
            if at < end:  # none overlaps another, so what is copied is at most the heap
                raise ProtocolError("arrays in shared memory overlap")
            end = at + nbytes
        arrays = []
        for at, nbytes, dtype, shape in places:
            array = self._data[at : at + nbytes].view(dtype).reshape(shape)
            arrays.append(array.copy() if copy_values or dtype != _DTYPES[0] else array)
        if int(self._seq[0]) != rid:
            raise ProtocolError("the arrays in shared memory were rewritten while they were read")
        return arrays

    def _place(
        self, index: int, code: int, rows: int, cols: int, at: int
    ) -> tuple[int, int, np.dtype[Any], tuple[int, ...]]:
        """Where array ``index`` lies (offset, bytes, dtype, shape), checked: aligned, inside the heap, of sizes a
        frame may have."""
        if code >= len(_DTYPES):
            raise ProtocolError(f"array {index} in shared memory has an unknown dtype code {code}")
        if rows > MAX_DIM or cols > MAX_DIM:
            raise ProtocolError(f"array {index} in shared memory has a size over {MAX_DIM}")
        dtype = _DTYPES[code]
        nbytes = rows * max(cols, 1) * dtype.itemsize
        if at % ALIGN or at + nbytes > self._data.size:
            raise ProtocolError(f"array {index} in shared memory lies outside its region")
        return at, nbytes, dtype, (rows,) if cols == 0 else (rows, cols)
