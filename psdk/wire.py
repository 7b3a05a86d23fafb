"""The wire format: one small JSON header frame, then one raw frame per array.

Nothing received is ever unpickled. The header names the operation, the
request id that matches a reply to its request, plain JSON fields, and the
dtype and shape of every array frame that follows; :func:`decode` checks all
of it against the frames before any array is built, and the arrays it builds
are zero-copy, read-only views of the received buffers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ProtocolError

# Explicit byte order: a header cannot smuggle a big-endian or object dtype in.
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<f2", "<i4", "<i8", "|u1", "|i1"})
MAX_HEADER_BYTES = 1 << 16
MAX_ARRAYS = 4096
MAX_NDIM = 8
# Built once: json.dumps/json.loads rebuild their coder objects and sniff the encoding per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder()
# A worker's heartbeat socket has its main socket's routing id plus this suffix.
HEARTBEAT_SUFFIX = b"/hb"


@dataclass
class Message:
    """One request or reply: an operation, JSON fields and arrays."""

    op: str
    fields: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    rid: int = 0
    volatile: bool = False
    """The arrays change once the send call returns: the transport must copy them there."""
    stable: bool = False
    """The arrays are long-lived buffers sent again and again: zero-copy frames may be kept for them.
    The sender must not change one before the peer has received it (a reply proves it has)."""


def _dtype_code(array: np.ndarray) -> str:
    code = array.dtype.str
    if code not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {array.dtype} cannot go on the wire (allowed: {ALLOWED_DTYPES})")
    return code


def encode(message: Message) -> list[Any]:
    """Frames for ``message``: the header bytes, then each array (C-contiguous)."""
    arrays = [np.ascontiguousarray(a) for a in message.arrays]
    header = {
        "op": message.op,
        "rid": message.rid,
        "f": message.fields,
        "a": [[_dtype_code(a), list(a.shape)] for a in arrays],
    }
    head = _ENCODER.encode(header).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    return [head, *arrays]


def _buffer(frame: Any) -> memoryview:
    raw = getattr(frame, "buffer", frame)
    return raw if isinstance(raw, memoryview) else memoryview(raw)


def peek_rid(frames: Sequence[Any]) -> int | None:
    """The request id of a message that failed to decode, if one can be read."""
    try:
        header = json.loads(bytes(_buffer(frames[0])))
        rid = header.get("rid") if isinstance(header, dict) else None
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    except (ValueError, IndexError, UnicodeDecodeError, TypeError):
        return None


def _parse_array_spec(spec: Any, index: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 2):
        raise ProtocolError(f"array spec {index} must be [dtype, shape]")
    code, shape = spec
    if code not in ALLOWED_DTYPES:
        raise ProtocolError(f"array {index} has dtype {code!r}, not one of {sorted(ALLOWED_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"array {index} has a bad shape {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"array {index} has a bad shape {shape!r}")
    return np.dtype(code), tuple(shape)


def decode(frames: Sequence[Any]) -> Message:
    """Parse and check ``frames``; raise :class:`ProtocolError` on anything off."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _DECODER.decode(bytes(head).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    op, rid, fields, specs = header.get("op"), header.get("rid"), header.get("f"), header.get("a")
    if not isinstance(op, str) or not op:
        raise ProtocolError("header has no op")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("header has no integer rid")
    if not isinstance(fields, dict):
        raise ProtocolError("header fields are not an object")
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError("header array list is missing or too long")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header declares {len(specs)} arrays but {len(frames) - 1} frames came")
    arrays = []
    for index, (spec, frame) in enumerate(zip(specs, frames[1:], strict=True)):
        dtype, shape = _parse_array_spec(spec, index)
        buf = _buffer(frame)
        expected = math.prod(shape) * dtype.itemsize
        if expected != buf.nbytes:
            raise ProtocolError(
                f"array {index} declares {shape} {dtype} ({expected} bytes) but its frame has {buf.nbytes} bytes"
            )
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
    return Message(op=op, fields=fields, arrays=arrays, rid=rid)
