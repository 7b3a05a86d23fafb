from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psdk.errors import ProtocolError
from psdk.transport.wire import MalformedMessage, Message, decode, encode


def frames_of(message: Message) -> list[bytes]:
    return [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(message)]


def test_round_trip_keeps_fields_dtypes_and_shapes() -> None:
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([1, 2], np.int64),
        np.zeros((0,), np.float64),
        np.array(2.5, np.float64),  # 0-d: stays 0-d
        np.zeros((2, 0, 3), np.int32),
    ]
    message = Message("push_pull", {"worker": 1, "names": ["a", "b"]}, arrays, rid=7)
    back = decode(frames_of(message))
    assert (back.op, back.rid, back.fields) == ("push_pull", 7, {"worker": 1, "names": ["a", "b"]})
    for sent, got in zip(arrays, back.arrays, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


def test_decoded_arrays_are_read_only_views() -> None:
    back = decode(frames_of(Message("x", {}, [np.ones(4, np.float32)])))
    assert not back.arrays[0].flags.writeable


def test_non_contiguous_arrays_are_sent_contiguous() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    back = decode(frames_of(Message("x", {}, [array])))
    np.testing.assert_array_equal(back.arrays[0], array)


def test_encode_refuses_object_and_big_endian_dtypes() -> None:
    with pytest.raises(ProtocolError):
        encode(Message("x", {}, [np.array([object()], dtype=object)]))
    with pytest.raises(ProtocolError):
        encode(Message("x", {}, [np.zeros(2, dtype=">f4")]))


def header(**overrides: object) -> bytes:
    base: dict[str, object] = {"op": "pull", "rid": 1, "f": {}, "a": []}
    base.update(overrides)
    return json.dumps(base).encode()


@pytest.mark.parametrize(
    "frames, fragment",
    [
        ([], "empty"),
        ([b"\xff\xfe"], "not JSON"),
        ([b"[1, 2]"], "not a JSON object"),
        ([header(op=None)], "no op"),
        ([header(rid="1")], "rid"),
        ([header(rid=True)], "rid"),
        ([header(f=[])], "fields"),
        ([header(a=[["<f4", [2]]])], "declares 1 arrays but 0"),
        ([header(), b"1234"], "declares 0 arrays but 1"),
        ([header(a=[["<f4", [3]]]), b"12345678"], "12 bytes"),
        ([header(a=[["|O", [1]]]), b"12345678"], "dtype"),
        ([header(a=[[">f4", [2]]]), b"12345678"], "dtype"),
        ([header(a=[["<f4", [-2]]]), b"12345678"], "shape"),
        ([header(a=[["<f4", [1 << 30, 1 << 30]]]), b"1234"], "bytes"),
        ([header(a=[["<f4"]]), b"1234"], "[dtype, shape]"),
        ([b"{" + b" " * 70000 + b"}"], "exceeds"),
    ],
)
def test_malformed_messages_are_refused(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        decode(frames)
    assert fragment in str(info.value)


def test_a_refusal_carries_the_rid_when_the_header_parsed_so_it_can_be_answered() -> None:
    with pytest.raises(MalformedMessage) as info:
        decode([header(rid=41, a=[["<f4", [9]]])])
    assert info.value.rid == 41
    with pytest.raises(MalformedMessage) as info:
        decode([b"garbage"])
    assert info.value.rid is None


def nested(depth: int) -> bytes:
    return b'{"op":"pull","rid":1,"a":[],"f":{"x":' + b"[" * depth + b"]" * depth + b"}}"


@pytest.mark.parametrize(
    "frames, fragment",
    [
        # Deeper than the parser recurses (was RecursionError, which ended the ps), under 64 KiB.
        ([nested(30_000)], "nests deeper"),
        ([nested(100)], "nests deeper"),
        # Zero bytes declared, so the byte count matched, then reshape raised ValueError (which ended the ps).
        ([header(a=[["<f4", [0, 2**70]]]), b""], "64-bit"),
        ([header(a=[["<f4", [0, 2**62]]]), b""], "bad shape"),
        ([header(a=[["<f4", [0, 2**31 - 1, 2**31 - 1, 2**31 - 1]]]), b""], "cannot have shape"),
        ([header(rid=2**64)], "64-bit"),
        ([header(f={"version": -(2**63) - 1})], "64-bit"),
        ([b'{"op":"pull","rid":1,"f":{"lr":NaN},"a":[]}'], "not JSON"),
        ([b'{"op":"pull","rid":1,"f":{"lr":-Infinity},"a":[]}'], "not JSON"),
        ([b'{"op":"pull","rid":1,"f":{"lr":1e999},"a":[]}'], "not JSON"),
        ([b'{"op":"pull","rid":1,"f":{"n":' + b"9" * 5000 + b'},"a":[]}'], "not JSON"),
        ([header(op="x" * 65)], "op name"),
        ([header(f={"reason": "y" * 9000})], "string"),
        ([b'{"op":"pull","rid":1,"f":{},"a":[]}\xff'], "not JSON"),
        ([header(), b"", b""], "declares 0 arrays but 2"),
    ],
)
def test_hostile_headers_are_refused_as_malformed_messages(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode(frames)
    assert fragment in str(info.value)


@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_any_bytes_at_all_decode_to_a_message_or_a_malformed_message(frames: list[bytes]) -> None:
    with contextlib.suppress(MalformedMessage):
        decode(frames)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
@given(
    op=JSON,
    rid=JSON,
    fields=JSON,
    specs=st.lists(st.tuples(st.sampled_from(["<f4", "<i8", "|u1", "?", 3]), st.lists(st.integers(), max_size=4))),
    frames=st.lists(st.binary(max_size=64), max_size=4),
)
def test_any_json_header_decodes_to_a_message_or_a_malformed_message(
    op: object, rid: object, fields: object, specs: list[tuple[object, list[int]]], frames: list[bytes]
) -> None:
    head = json.dumps({"op": op, "rid": rid, "f": fields, "a": [list(s) for s in specs]}).encode()
    with contextlib.suppress(MalformedMessage):
        decode([head, *frames])
