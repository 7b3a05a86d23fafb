"""Headers packed for the transport's own memory: what a knock or a ring carries, without JSON.

A push and its reply cross lent memory (see :mod:`psdk.transport.lending`)
thousands of times a second, each with a handful of flat fields: encoding
and checking them as JSON cost about 30 us a round trip, a fifth of it. A
header whose fields are all integers, booleans, floats, ``None`` or short
strings is packed instead: a *layout* (the op, the lent regions, each
field's name and kind, the strings and ``None`` as constants) in JSON, then
the request id and the values with :mod:`struct`. Both sides cache layouts,
so a layout is built and checked once; the receiver still checks every
layout it has not seen (as :func:`psdk.transport.wire.decode` checks a
header), and values cannot be out of range by construction. A small list
or dict that recurs message after message (a push's ``tables`` entries) is
a constant of its layout too, kept as its JSON text and parsed afresh for
each message, so no handler shares (or could change) another's. Any other
header goes as tagged JSON, decoded as a message is.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from psdk.errors import ProtocolError
from psdk.transport.wire import (
    MAX_LENT,
    MAX_OP_CHARS,
    MAX_STRING_CHARS,
    MalformedMessage,
    Message,
    check_json,
    decode,
    encode_header,
)

PACKED, JSON = 1, 2
"""The first byte of a header in memory: which of the two encodings follows."""
MAX_LAYOUTS = 64
"""Layouts one side keeps; past this a header is packed (or read) without the cache's help."""
MAX_FIELDS = 64
MAX_CONSTANT_CHARS = 64
"""Longer strings go in JSON: a layout keyed by a long string would not be met again."""
MAX_JSON_CONSTANT_CHARS = 512
"""A list or dict whose JSON is longer goes in JSON (eight tables' entries take about 350)."""
_KINDS = {"q": int, "?": bool, "d": float}
_CONSTANTS = ("c", "j")
"""Kinds held by the layout, not packed: ``None`` or a short string as it is, a list or dict as JSON text."""
_LENGTH = struct.Struct("<BH")  # tag, layout bytes
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder()


class Packer:
    """One sender's layouts: ``pack`` a header whose arrays lie in lent memory named ``lent``."""

    def __init__(self, max_header_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes
        self._layouts: dict[tuple[Any, ...], tuple[bytes, struct.Struct]] = {}

    def pack(self, message: Message, lent: list[str]) -> bytes:
        spec: list[tuple[str, str, Any]] = []
        values: list[Any] = []
        for name, value in message.fields.items():
            kind = type(value)
            if kind is int or kind is bool or kind is float:
                spec.append((name, "q" if kind is int else "?" if kind is bool else "d", None))
                values.append(value)
            elif value is None or (kind is str and len(value) <= MAX_CONSTANT_CHARS):
                spec.append((name, "c", value))
            elif (kind is list or kind is dict) and (text := _constant_text(value)) is not None:
                spec.append((name, "j", text))  # keyed by its text: the layout writes the value itself
            else:
                return self._json(message, lent)
        key = (message.op, *lent, *spec)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(message.op, lent, spec)
            if len(self._layouts) < MAX_LAYOUTS:
                self._layouts[key] = layout
        prefix, packer = layout
        try:
            return prefix + packer.pack(message.rid, *values)
        except struct.error:  # an integer beyond 64 bits: JSON says so to the receiver, which refuses it
            return self._json(message, lent)

    def _layout(self, op: str, lent: list[str], spec: list[tuple[str, str, Any]]) -> tuple[bytes, struct.Struct]:
        entries = [[name, kind, _DECODER.decode(value) if kind == "j" else value] for name, kind, value in spec]
        text = _ENCODER.encode([op, lent, entries]).encode()
        packer = struct.Struct("<q" + "".join(kind for _, kind, _ in spec if kind not in _CONSTANTS))
        return _LENGTH.pack(PACKED, len(text)) + text, packer

    def _json(self, message: Message, lent: list[str]) -> bytes:
        return bytes([JSON]) + encode_header(message, lent, self.max_header_bytes)


def _constant_text(value: list[Any] | dict[str, Any]) -> str | None:
    """``value``'s JSON if it is short enough to be a layout's constant (and valid JSON: NaN is not)."""
    try:
        text = _ENCODER.encode(value)
    except (ValueError, TypeError):
        return None  # the JSON header it then goes in says what is wrong
    return text if len(text) <= MAX_JSON_CONSTANT_CHARS else None


class Unpacker:
    """One receiver's layouts: ``unpack`` a header :class:`Packer` made, checking what it has not seen."""

    def __init__(self, max_header_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes
        self._layouts: dict[bytes, tuple[str, list[str], list[tuple[str, str, Any]], struct.Struct]] = {}

    def unpack(self, data: bytes) -> Message:
        """The message ``data`` stands for (its arrays named in ``lent``), or :class:`MalformedMessage`."""
        if not data:
            raise MalformedMessage("an empty header")
        if data[0] == JSON:
            return decode([data[1:]], self.max_header_bytes)
        if data[0] != PACKED or len(data) < _LENGTH.size:
            raise MalformedMessage(f"a header of unknown encoding {data[0]}")
        _, length = _LENGTH.unpack_from(data)
        end = _LENGTH.size + length
        text = data[_LENGTH.size : end]
        layout = self._layouts.get(text)
        if layout is None:
            layout = _checked_layout(text)
            if len(self._layouts) < MAX_LAYOUTS:
                self._layouts[text] = layout
        op, lent, spec, packer = layout
        if len(data) != end + packer.size:
            raise MalformedMessage(f"a packed header of {len(data)} bytes where its layout makes {end + packer.size}")
        rid, *values = packer.unpack_from(data, end)
        fields: dict[str, Any] = {}
        taken = iter(values)
        for name, kind, constant in spec:
            if kind in _CONSTANTS:
                fields[name] = _DECODER.decode(constant) if kind == "j" else constant  # "j": a fresh copy each
                continue
            value = next(taken)
            if kind == "d" and not math.isfinite(value):
                raise MalformedMessage(f"field {name[:64]!r} is not a finite number", rid)
            fields[name] = value
        return Message(op, fields, [], rid, lent=list(lent))


def _checked_layout(text: bytes) -> tuple[str, list[str], list[tuple[str, str, Any]], struct.Struct]:
    """A layout another process wrote, held to the rules :func:`psdk.transport.wire.decode` holds a header to."""
    try:
        op, lent, entries = _DECODER.decode(text.decode())
        spec = [(str(name), str(kind), constant) for name, kind, constant in entries]
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        raise MalformedMessage("a packed header's layout is not [op, lent, fields]") from None
    if not isinstance(op, str) or not op or len(op) > MAX_OP_CHARS:
        raise MalformedMessage("a packed header has no valid op")
    if not (isinstance(lent, list) and len(lent) <= MAX_LENT and all(isinstance(n, str) for n in lent)):
        raise MalformedMessage(f"a packed header names more than {MAX_LENT} lent regions, or not by name")
    if len(spec) > MAX_FIELDS or len({name for name, _, _ in spec}) != len(spec):
        raise MalformedMessage(f"a packed header has more than {MAX_FIELDS} fields, or one twice")
    for index, ((name, kind, constant), (raw, _, _)) in enumerate(zip(spec, entries, strict=True)):
        if not isinstance(raw, str) or len(name) > MAX_STRING_CHARS:
            raise MalformedMessage("a packed header's field names must be strings")
        if kind == "j" and isinstance(constant, (list, dict)):
            try:
                check_json(constant, depth=2)  # as deep as in a JSON header: its fields' values lie under "f"
                # Kept as text, decoded afresh per message; ValueError: NaN or an infinity, which JSON may not hold.
                spec[index] = (name, kind, _ENCODER.encode(constant))
            except (ProtocolError, ValueError) as exc:
                raise MalformedMessage(f"a packed header's field {name[:64]!r}: {exc}") from None
            continue
        if kind not in _KINDS and not (kind == "c" and (constant is None or isinstance(constant, str))):
            raise MalformedMessage(f"a packed header's field {name[:64]!r} has an unknown kind")
        if isinstance(constant, str) and len(constant) > MAX_STRING_CHARS:
            raise MalformedMessage(f"a string of {len(constant)} characters exceeds {MAX_STRING_CHARS}")
    packer = struct.Struct("<q" + "".join(kind for _, kind, _ in spec if kind not in _CONSTANTS))
    return op, list(lent), spec, packer
