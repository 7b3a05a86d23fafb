from __future__ import annotations

import json

import numpy as np
import pytest

from psdk.errors import ProtocolError
from psdk.wire import Message, decode, encode, peek_rid


def frames_of(message: Message) -> list[bytes]:
    return [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(message)]


def test_round_trip_keeps_fields_dtypes_and_shapes() -> None:
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([1, 2], np.int64),
        np.zeros((0,), np.float64),
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
        ([header(a=[["<f4", [1 << 40, 1 << 40]]]), b"1234"], "bytes"),
        ([header(a=[["<f4"]]), b"1234"], "[dtype, shape]"),
        ([b"{" + b" " * 70000 + b"}"], "exceeds"),
    ],
)
def test_malformed_messages_are_refused(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        decode(frames)
    assert fragment in str(info.value)


def test_peek_rid_reads_the_rid_of_a_broken_message() -> None:
    assert peek_rid([header(rid=41, a=[["<f4", [9]]])]) == 41
    assert peek_rid([b"garbage"]) is None
