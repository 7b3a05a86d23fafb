"""The wire format: one small JSON header frame, then one raw frame per array.

Nothing received is ever unpickled. The header names the operation, the
request id that matches a reply to its request, plain JSON fields, and the
dtype and shape of every array frame that follows; :func:`decode` checks all
of it against the frames before any array is built, and the arrays it builds
are zero-copy, read-only views of the received buffers.

Decoding is total: whatever bytes arrive, :func:`decode` returns a message
or raises :class:`MalformedMessage`, never anything else, so a peer cannot
end a ps by what it sends (nesting deeper than the parser recurses, a shape
whose product overflows, numbers out of range, bad UTF-8, frames that do not
match the header).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ProtocolError

# Explicit byte order: a header cannot smuggle a big-endian or object dtype in.
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<f2", "<i4", "<i8", "|u1", "|i1"})
MAX_HEADER_BYTES = 1 << 16
"""A request's header: what a ps reads from anyone who reaches it."""
MAX_REPLY_HEADER_BYTES = 1 << 24
"""A reply's header: a ps's statistics grow with its workers (a worker decodes what its own ps sends)."""
MAX_ARRAYS = 4096
MAX_LENT = 4
"""Regions of lent memory one message may name (see :mod:`psdk.transport.shm`)."""
MAX_NDIM = 8
MAX_DIM = (1 << 31) - 1
"""Largest size of one dimension: a zero-element array may not declare dimensions numpy cannot hold."""
MAX_DEPTH = 16
"""Deepest nesting of a header's JSON (the deepest a real message has is 4: a finish report's histogram)."""
MAX_STRING_CHARS = 8192
MAX_OP_CHARS = 64
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
"""Every integer in a header fits in 64 bits, as the ps stores versions, steps and ids."""
# Built once: json.dumps/json.loads rebuild their coder objects and sniff the encoding per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
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
    """The first array is a long-lived buffer sent again and again: a zero-copy frame may be kept for it
    (the others, a table's rows, are sent zero-copy once). The sender must not change any before the peer
    has received it (a reply proves it has)."""
    in_place: bool = False
    """A reply whose one array the transport may write into memory the receiver lent (same host) instead
    of sending it; either way it is done with the array when ``reply`` returns."""
    borrowed: bool = False
    """Set by a transport on a received message: its float arrays may be views of memory the sender lent,
    which it may rewrite once it has the reply (copy what must outlive that); integer arrays never are."""
    lent: list[str] = field(default_factory=list)
    """On the wire only: names of regions of lent memory that hold the message's arrays instead of frames.
    A transport resolves them before handing the message on, so the ps and the client never see them."""


def _dtype_code(array: np.ndarray) -> str:
    code = array.dtype.str
    if code not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {array.dtype} cannot go on the wire (allowed: {ALLOWED_DTYPES})")
    return code


def encode(message: Message, max_header_bytes: int = MAX_HEADER_BYTES) -> list[Any]:
    """Frames for ``message``: the header bytes, then each array (C-contiguous)."""
    # Not np.ascontiguousarray alone: it makes a 0-d array 1-d, and the shape must cross as it was.
    arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in map(np.asarray, message.arrays)]
    header = {
        "op": message.op,
        "rid": message.rid,
        "f": message.fields,
        "a": [[_dtype_code(a), list(a.shape)] for a in arrays],
    }
    if message.lent:
        header["l"] = message.lent
    head = _ENCODER.encode(header).encode()
    if len(head) > max_header_bytes:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {max_header_bytes}")
    return [head, *arrays]


def encode_header(message: Message, lent: list[str], max_header_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """The header alone of ``message`` whose arrays lie in lent memory named ``lent`` (see :mod:`psdk.transport.shm`).

    What :func:`encode` would make with no arrays, without building a message for it: a worker's
    endpoint makes one per knocked push, a ps's one per reply it writes in place.
    """
    head: bytes = _ENCODER.encode(
        {"op": message.op, "rid": message.rid, "f": message.fields, "a": [], "l": lent}
    ).encode()
    if len(head) > max_header_bytes:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {max_header_bytes}")
    return head


def _buffer(frame: Any) -> memoryview:
    raw = getattr(frame, "buffer", frame)
    return raw if isinstance(raw, memoryview) else memoryview(raw)


class MalformedMessage(ProtocolError):
    """A message :func:`decode` refused, with its request id when the header got that far."""

    def __init__(self, problem: str, rid: int | None = None):
        super().__init__(problem)
        self.rid = rid


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} overflows a float")
    return value


# NaN, Infinity and numbers that overflow a float are refused while parsing; the rest of the
# checks (depth, integer range, string length) walk the parsed header once.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_LENIENT = json.JSONDecoder()  # only to find the rid of a refused message: NaN or 1e999 elsewhere do not hide it


def _check_scalar(item: Any) -> None:
    """An integer in 64 bits, a string of at most MAX_STRING_CHARS; any other scalar JSON makes passes."""
    kind = type(item)
    if kind is int:
        if not INT_MIN <= item <= INT_MAX:
            raise ProtocolError(f"integer {str(item)[:24]}… is outside the 64-bit range")
    elif kind is str and len(item) > MAX_STRING_CHARS:
        raise ProtocolError(f"a string of {len(item)} characters exceeds {MAX_STRING_CHARS}")


def check_json(value: Any, depth: int = 0) -> None:
    """Refuse what no handler expects and some could choke on: deep nesting, huge integers, long strings.

    Iterative, so its own depth costs nothing; a header that nests deeper
    than the interpreter's recursion limit never gets here (the parser's
    ``RecursionError`` is a refusal too). Scalars are checked where they are
    found, not stacked: a header is mostly scalars, and every message pays
    for this walk (a push and its reply, twice per step). ``depth``: how deep
    ``value`` already lies in its header.
    """
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        item, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise ProtocolError(f"the header nests deeper than {MAX_DEPTH} levels")
        children = [*item, *item.values()] if type(item) is dict else item  # a dict's keys are strings
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            else:
                _check_scalar(child)


def _parse_array_spec(spec: Any, index: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 2):
        raise ProtocolError(f"array spec {index} must be [dtype, shape]")
    code, shape = spec
    if code not in ALLOWED_DTYPES:
        raise ProtocolError(f"array {index} has dtype {str(code)[:16]!r}, not one of {sorted(ALLOWED_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"array {index} has a bad shape (a list of at most {MAX_NDIM} sizes is expected)")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape):
        raise ProtocolError(f"array {index} has a bad shape (each size must be an integer in [0, {MAX_DIM}])")
    return np.dtype(code), tuple(shape)


def decode(frames: Sequence[Any], max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Parse and check ``frames``: a :class:`Message`, or :class:`MalformedMessage` whatever they hold."""
    try:
        return _decode(frames, max_header_bytes)
    except MalformedMessage:
        raise
    except ProtocolError as exc:
        raise MalformedMessage(str(exc), _rid_of(frames)) from None
    except Exception as exc:
        raise MalformedMessage(f"undecodable message ({type(exc).__name__})", _rid_of(frames)) from None


def decode_reply(
    frames: Sequence[Any], sender: str, decoder: Callable[[Sequence[Any]], Message] | None = None
) -> Message:
    """A reply from ``sender``, with the reply header limit (or by ``decoder``); malformed, an error naming it."""
    try:
        return decoder(frames) if decoder is not None else decode(frames, MAX_REPLY_HEADER_BYTES)
    except ProtocolError as exc:
        raise ProtocolError(f"malformed reply from {sender}: {exc}") from None


def _rid_of(frames: Sequence[Any]) -> int | None:
    """The request id of a refused message, if its header parses to one (so the refusal can be answered)."""
    try:
        head = _buffer(frames[0])
        if len(head) > MAX_HEADER_BYTES:
            return None  # not parsed at all: a gigabyte of header must not cost a gigabyte to refuse
        header = _LENIENT.decode(bytes(head).decode())
        rid = header.get("rid") if isinstance(header, dict) else None
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and INT_MIN <= rid <= INT_MAX else None
    except Exception:
        return None


def _decode(frames: Sequence[Any], max_header_bytes: int) -> Message:
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if len(head) > max_header_bytes:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {max_header_bytes}")
    try:
        first = frames[0]
        header = _DECODER.decode(first.decode() if type(first) is bytes else bytes(head).decode())
    except RecursionError:
        raise ProtocolError(f"the header nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    check_json(header)
    op, rid, fields, specs = header.get("op"), header.get("rid"), header.get("f"), header.get("a")
    if not isinstance(op, str) or not op:
        raise ProtocolError("header has no op")
    if len(op) > MAX_OP_CHARS:
        raise ProtocolError(f"op name of {len(op)} characters exceeds {MAX_OP_CHARS}")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("header has no integer rid")
    if not isinstance(fields, dict):
        raise ProtocolError("header fields are not an object")
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError("header array list is missing or too long")
    lent = header.get("l", [])
    if not (isinstance(lent, list) and len(lent) <= MAX_LENT and all(isinstance(n, str) for n in lent)):
        raise ProtocolError(f"header names of lent memory must be a list of at most {MAX_LENT} strings")
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
        try:
            arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
        except ValueError as exc:  # e.g. zero elements in a shape numpy cannot represent
            raise ProtocolError(f"array {index} cannot have shape {shape}: {exc}") from None
    return Message(op=op, fields=fields, arrays=arrays, rid=rid, lent=lent)
