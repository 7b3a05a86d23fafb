"""Headers packed for lent memory: they round-trip, fall back to JSON, and what a peer forges is refused."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from psdk.transport.compact import JSON, PACKED, Packer, Unpacker
from psdk.transport.wire import MAX_HEADER_BYTES, MalformedMessage, Message, decode, encode

pytestmark = pytest.mark.timeout(30)


def round_trip(fields: dict[str, Any], lent: list[str] | None = None) -> tuple[bytes, Message]:
    packed = Packer(MAX_HEADER_BYTES).pack(Message("push_pull", fields, [], 7), lent or ["grads"])
    return packed, Unpacker(MAX_HEADER_BYTES).unpack(packed)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"worker": 0, "version": 2**62, "seq": -1, "epoch": 0},
        {"done": True, "outcome": "applied", "slowest": None, "x": 0.25},
    ],
)
def test_flat_fields_are_packed_and_come_back_as_they_were(fields: dict[str, Any]) -> None:
    packed, message = round_trip(fields)
    assert packed[0] == PACKED
    assert (message.op, message.rid, message.fields, message.lent) == ("push_pull", 7, fields, ["grads"])
    assert [type(v) for v in message.fields.values()] == [type(v) for v in fields.values()]


def test_a_pushs_table_entries_are_packed_and_each_message_gets_its_own() -> None:
    fields = {"seq": 3, "tables": [{"table": "ctr", "push": True, "pull": True}], "report": {"a": [1, 2]}}
    packed, message = round_trip(fields)
    assert packed[0] == PACKED and message.fields == fields
    unpacker = Unpacker(MAX_HEADER_BYTES)
    first = unpacker.unpack(packed)
    first.fields["tables"][0]["push"] = False  # a handler changing its message changes no other
    assert unpacker.unpack(packed).fields == fields


@pytest.mark.parametrize(
    "fields",
    [{"big": 2**64}, {"text": "x" * 100}, {"names": ["a" * 60] * 10}],
    ids=["beyond 64 bits", "long string", "long list"],
)
def test_anything_else_goes_as_json_and_is_checked_as_a_message_is(fields: dict[str, Any]) -> None:
    packed = Packer(MAX_HEADER_BYTES).pack(Message("push_pull", fields, [], 7), ["grads"])
    assert packed[0] == JSON
    if "big" in fields:
        with pytest.raises(MalformedMessage, match="64-bit"):
            Unpacker(MAX_HEADER_BYTES).unpack(packed)
    else:
        assert Unpacker(MAX_HEADER_BYTES).unpack(packed).fields == fields


def test_a_packed_list_is_checked_as_a_messages_fields_are() -> None:
    packed = Packer(MAX_HEADER_BYTES).pack(Message("push_pull", {"deep": [[1, [2**64]]]}, [], 7), ["grads"])
    with pytest.raises(MalformedMessage, match="64-bit"):
        Unpacker(MAX_HEADER_BYTES).unpack(packed)


@pytest.mark.parametrize("levels", [13, 14, 15, 16])
def test_a_packed_list_may_nest_exactly_as_deep_as_in_a_json_header(levels: int) -> None:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    message = Message("push_pull", {"x": value}, [], 7)
    packed = Packer(MAX_HEADER_BYTES).pack(message, ["grads"])
    assert packed[0] == PACKED

    def accepted(read: Any) -> bool:
        try:
            read()
        except MalformedMessage:
            return False
        return True

    as_json = accepted(lambda: decode(encode(message)))
    assert accepted(lambda: Unpacker(MAX_HEADER_BYTES).unpack(packed)) == as_json == (levels < 15)


def forged(layout: bytes, values: bytes) -> bytes:
    return struct.pack("<BH", PACKED, len(layout)) + layout + values


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"\x07junk", "unknown encoding"),
        (forged(b"not json", struct.pack("<q", 1)), "not \\[op, lent, fields\\]"),
        (forged(b'["", [], []]', struct.pack("<q", 1)), "no valid op"),
        (forged(b'["op", ["a","b","c","d","e"], []]', struct.pack("<q", 1)), "lent regions"),
        (forged(b'["op", [], [["x","Q",null]]]', struct.pack("<qq", 1, 2)), "unknown kind"),
        (forged(b'["op", [], [["x","q",null],["x","q",null]]]', struct.pack("<qqq", 1, 2, 3)), "one twice"),
        (forged(b'["op", [], [["x","q",null]]]', struct.pack("<q", 1)), "where its layout makes"),
        (forged(b'["op", [], [["x","d",null]]]', struct.pack("<qd", 1, float("nan"))), "not a finite number"),
        (forged(b'["op", [], [["x","j",3]]]', struct.pack("<q", 1)), "unknown kind"),
        (forged(b'["op", [], [["x","j",[NaN]]]]', struct.pack("<q", 1)), "not JSON compliant"),
        (forged(b'["op", [], [["x","j",[18446744073709551616]]]]', struct.pack("<q", 1)), "64-bit"),
        (forged(b'["op", [], [["x","j",' + b"[" * 15 + b"]" * 15 + b"]]]", struct.pack("<q", 1)), "deeper"),
    ],
    ids=[
        "empty",
        "tag",
        "layout",
        "op",
        "lent",
        "kind",
        "twice",
        "length",
        "nan",
        "j kind",
        "j nan",
        "j big",
        "j deep",
    ],
)
def test_a_forged_header_is_refused_naming_why(data: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        Unpacker(MAX_HEADER_BYTES).unpack(data)


def test_layouts_are_cached_up_to_a_bound_and_read_correctly_past_it() -> None:
    packer, unpacker = Packer(MAX_HEADER_BYTES), Unpacker(MAX_HEADER_BYTES)
    for n in range(100):  # 100 layouts: the caches stop growing at 64, the headers stay right
        fields = {f"f{n}": n, "outcome": f"o{n}"}
        assert unpacker.unpack(packer.pack(Message("op", fields, [], n), [])).fields == fields
    assert len(packer._layouts) == len(unpacker._layouts) == 64
