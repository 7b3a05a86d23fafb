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


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` (of one shape and dtype) are the same bytes: an array filled where it goes."""
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides)


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where arrays of ``sizes`` bytes go in a heap's data, in order, each 64-byte aligned; and the bytes taken."""
    offsets, at = [], 0
    for nbytes in sizes:
        offsets.append(at)
        at += aligned(nbytes)
    return offsets, at


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

    def fits(self, arrays: list[np.ndarray]) -> bool:
        """Whether ``arrays`` can be written here (kinds, count and bytes); else they go as frames."""
        if len(arrays) > MAX_ARRAYS:
            return False
        for array in arrays:
            if array.dtype not in _CODES or array.ndim not in (1, 2) or (array.ndim == 2 and not array.shape[1]):
                return False
        return _offsets([array.nbytes for array in arrays])[1] <= self._data.size

    def room(self, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Float32 arrays of ``shapes`` where :meth:`write` of request ``rid`` would put them (None: no room),
        for a writer to fill in place; written with them, they are not copied again.

        From now on the heap reads as torn for any other request: a reader
        still copying an earlier one's arrays sees it changed under it.
        """
        float32 = _DTYPES[0]
        sizes = [rows * cols * float32.itemsize for rows, cols in shapes]
        offsets, end = _offsets(sizes)
        if len(shapes) > MAX_ARRAYS or end > self._data.size or any(cols < 1 for _, cols in shapes):
            return None
        self._seq[0] = rid
        places = zip(offsets, sizes, shapes, strict=True)
        return [self._data[at : at + nbytes].view(float32).reshape(shape) for at, nbytes, shape in places]

    def write(self, rid: int, arrays: list[np.ndarray]) -> None:
        """Put ``arrays`` (which :meth:`fits`) under request ``rid``; those :meth:`room` gave are there already."""
        self._seq[0] = rid
        offsets, _ = _offsets([array.nbytes for array in arrays])
        for i, (array, at) in enumerate(zip(arrays, offsets, strict=True)):
            rows, cols = (array.shape[0], 0) if array.ndim == 1 else array.shape
            self._descriptors[i] = (_CODES[array.dtype], rows, cols, at)
            target = self._data[at : at + array.nbytes].view(array.dtype).reshape(array.shape)
            if not _same_memory(target, array):
                np.copyto(target, array)
        self._count[0] = len(arrays)
        self._seq[1] = rid

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
        places, end = [], 0
        for index, descriptor in enumerate(descriptors):
            code, rows, cols, at = (int(v) for v in descriptor)
            place = self._place(index, code, rows, cols, at, end)
            places.append(place)
            end = place[0] + place[1]
        arrays = []
        for at, nbytes, dtype, shape in places:
            array = self._data[at : at + nbytes].view(dtype).reshape(shape)
            arrays.append(array.copy() if copy_values or dtype != _DTYPES[0] else array)
        if int(self._seq[0]) != rid:
            raise ProtocolError("the arrays in shared memory were rewritten while they were read")
        return arrays

    def _place(
        self, index: int, code: int, rows: int, cols: int, at: int, end: int
    ) -> tuple[int, int, np.dtype[Any], tuple[int, ...]]:
        """Where array ``index`` lies (offset, bytes, dtype, shape), checked: after the one before it (arrays never
        overlap, so what is copied is at most the heap), aligned, inside the heap, of sizes a frame may have."""
        if code >= len(_DTYPES):
            raise ProtocolError(f"array {index} in shared memory has an unknown dtype code {code}")
        if rows > MAX_DIM or cols > MAX_DIM:
            raise ProtocolError(f"array {index} in shared memory has a size over {MAX_DIM}")
        dtype = _DTYPES[code]
        nbytes = rows * max(cols, 1) * dtype.itemsize
        if at % ALIGN or at < end or at + nbytes > self._data.size:
            raise ProtocolError(f"array {index} in shared memory lies outside its region, or over the one before")
        return at, nbytes, dtype, (rows,) if cols == 0 else (rows, cols)
