"""Table ids and rows through a lent memory's heaps: copied out, checked, never torn, else frames.

The heap is tested on the memory file itself (:mod:`psdk.transport.shm`), a
hostile worker by writing its descriptors by hand, and the whole on real
ZeroMQ endpoints: a push with tables and its reply with rows cross the
worker's memory and arrive as the arrays that were sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from psdk.config.options import TransportOptions
from psdk.errors import ProtocolError, PsdkError
from psdk.transport import ClientEndpoint, ServerEndpoint, shm
from psdk.transport.heap import MAX_ARRAYS, heap_bytes
from psdk.transport.wire import Message
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc"),
]

SIZE = 100
HEAP = heap_bytes(4096, 3)
IDS = np.array([3, 9, 12, 40], np.int64)
ROWS = np.arange(16, dtype=np.float32).reshape(4, 4)


@contextmanager
def memory(heap: int = HEAP) -> Iterator[tuple[shm.WorkerBuffers, shm.AttachedBuffers]]:
    worker = shm.WorkerBuffers(SIZE, heap)
    ps = shm.AttachedBuffers(worker.offer(), 1 << 20)
    try:
        yield worker, ps
    finally:
        ps.close()
        worker.close()


def test_a_pushs_ids_reach_the_ps_as_private_copies_and_its_rows_are_read_in_place() -> None:
    with memory() as (worker, ps):
        assert worker.put_arrays(5, [IDS, ROWS, IDS[:2]])
        assert all(array.flags.owndata for array in ps.take_arrays(5))  # any other request's: all copied
        ids, rows, pulled = ps.take_arrays(5, borrow_values=True)
        np.testing.assert_array_equal(rows, ROWS)
        assert rows.dtype == np.float32 and not rows.flags.owndata  # values: read in place, as a dense gradient
        worker.put_arrays(6, [IDS * 0, ROWS * 0, IDS[:2] * 0])  # the worker's next push cannot change ids
        np.testing.assert_array_equal(ids, IDS)
        np.testing.assert_array_equal(pulled, IDS[:2])
        assert ids.dtype == np.int64 and ids.flags.owndata and pulled.flags.owndata
        np.testing.assert_array_equal(rows, ROWS * 0)  # (rows are the worker's again once it has its reply)


def test_the_worker_reads_a_replys_rows_as_private_copies() -> None:
    with memory() as (worker, ps):
        ps.write_reply(np.zeros(SIZE, np.float32), 7, None, [ROWS])
        (rows,) = worker.read_params(np.empty(SIZE, np.float32), 7, heap=True)
        ps.write_reply(np.zeros(SIZE, np.float32), 8, None, [ROWS * 0])
        np.testing.assert_array_equal(rows, ROWS)


def test_the_rows_a_reply_pulled_land_with_its_parameters() -> None:
    with memory() as (worker, ps):
        assert ps.fits([ROWS])
        assert not ps.write_reply(np.ones(SIZE, np.float32), 8, None, [ROWS])  # no header: written, not rung
        into = np.zeros(SIZE, np.float32)
        (rows,) = worker.read_params(into, 8, heap=True)
        np.testing.assert_array_equal(rows, ROWS)
        assert (into == 1.0).all()


def test_arrays_of_another_request_or_rewritten_while_read_are_never_used() -> None:
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS])
        with pytest.raises(ProtocolError, match="belong to request 5, not 4"):
            ps.take_arrays(4)
        worker._views.up._seq[0] = 6  # type: ignore[union-attr]  # the next request's write began
        with pytest.raises(ProtocolError, match="rewritten while they were read"):
            ps.take_arrays(5)
        ps.write_reply(np.ones(SIZE, np.float32), 8, None, [ROWS])
        ps._views.down._seq[0] = 9  # type: ignore[union-attr]
        with pytest.raises(PsdkError, match="rewritten"):
            worker.read_params(np.zeros(SIZE, np.float32), 8, heap=True)


def test_rows_gathered_into_the_room_a_reply_gets_reach_the_worker_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with memory() as (worker, ps):
        room = ps.reply_room(8, [(4, 4), (2, 4)])
        assert room is not None and [r.shape for r in room] == [(4, 4), (2, 4)]
        np.take(ROWS, [0, 1, 2, 3], axis=0, out=room[0])  # as the ps gathers a pull's rows
        room[1][...] = ROWS[:2] * -1
        copied: list[tuple[int, ...]] = []
        copyto = np.copyto
        monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copied.append(np.shape(src)), copyto(dst, src, **kw)))
        assert not ps.write_reply(np.ones(SIZE, np.float32), 8, None, room)
        monkeypatch.undo()
        assert copied == [(SIZE,)]  # the parameters only: the rows were where they go
        first, second = worker.read_params(np.zeros(SIZE, np.float32), 8, heap=True)
        np.testing.assert_array_equal(first, ROWS)
        np.testing.assert_array_equal(second, ROWS[:2] * -1)


def test_room_taken_for_a_reply_tears_the_one_before_and_is_refused_when_it_cannot_fit() -> None:
    with memory() as (worker, ps):
        ps.write_reply(np.ones(SIZE, np.float32), 8, None, [ROWS])
        assert ps.reply_room(9, [(4, 4)]) is not None  # a late reply's rows now go where rid 8's lay
        with pytest.raises(PsdkError, match="rewritten"):
            worker.read_params(np.zeros(SIZE, np.float32), 8, heap=True)
        assert ps.reply_room(10, [(HEAP, 4)]) is None
        assert ps.reply_room(10, [(1, 4)] * (MAX_ARRAYS + 1)) is None
        assert ps.reply_room(10, [(1, 0)]) is None
    worker, lent = shm.WorkerBuffers(SIZE, 0), None
    try:
        lent = shm.AttachedBuffers(worker.offer(), 1 << 20)
        assert lent.reply_room(3, [(1, 4)]) is None  # no heap lent: the rows are built anywhere
    finally:
        if lent is not None:
            lent.close()
        worker.close()


@pytest.mark.parametrize(
    ("descriptor", "message"),
    [
        ((7, 4, 0, 0), "unknown dtype code"),
        ((1, 1 << 30, 0, 0), "outside its region"),
        ((0, 4, 1 << 30, 0), "outside its region"),
        ((1, 4, 0, HEAP), "outside its region"),
        ((1, 4, 0, 8), "outside its region"),  # not aligned
        ((1, 1 << 62, 1 << 62, 0), "size over"),
        ((0, 0, 1 << 63, 0), "size over"),  # no bytes, an impossible shape: refused, never reshaped
        ((1, 1 << 31, 0, 0), "size over"),
    ],
)
def test_a_hostile_descriptor_is_refused_naming_why(descriptor: tuple[int, ...], message: str) -> None:
    """What a worker writes in its heap is the ps's to check: nothing outside the region is ever read."""
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS])
        worker._views.up._descriptors[0] = descriptor  # type: ignore[union-attr]
        with pytest.raises(ProtocolError, match=message):
            ps.take_arrays(5)


def test_arrays_may_not_overlap_so_a_read_copies_at_most_the_heap() -> None:
    """24 descriptors of the whole heap would make the ps copy 24 heaps' worth: the second is refused."""
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS, IDS])
        worker._views.up._descriptors[1] = worker._views.up._descriptors[0]  # type: ignore[union-attr]
        with pytest.raises(ProtocolError, match="overlap"):
            ps.take_arrays(5)


def test_a_heap_naming_more_arrays_than_it_may_is_refused() -> None:
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS])
        worker._views.up._count[0] = MAX_ARRAYS + 1  # type: ignore[union-attr]
        with pytest.raises(ProtocolError, match="more than"):
            ps.take_arrays(5)


def test_only_what_tables_send_fits_a_heap() -> None:
    with memory() as (worker, _):
        assert not worker.put_arrays(1, [IDS.astype(np.float64)])
        assert not worker.put_arrays(1, [np.zeros((2, 2, 2), np.float32)])
        assert not worker.put_arrays(1, [np.zeros((2, 0), np.float32)])
        assert not worker.put_arrays(1, [IDS] * (MAX_ARRAYS + 1))
        assert not worker.put_arrays(1, [np.zeros(HEAP, np.float32)])
    with memory(heap=0) as (worker, ps):
        assert not worker.put_arrays(1, [IDS]) and not ps.fits([ROWS]) and ps.fits([])
        with pytest.raises(ProtocolError, match="did not lend"):
            ps.take_arrays(1)


@pytest.mark.parametrize(("heap", "message"), [(100, "heaps of 100"), (HEAP + 8, "in steps of"), (1 << 30, "to")])
def test_a_bad_heap_in_an_offer_is_refused(heap: int, message: str) -> None:
    worker = shm.WorkerBuffers(SIZE)
    offer = {**worker.offer(), "heap": heap, "bytes": shm.total_bytes(SIZE, heap)}
    with pytest.raises(ProtocolError, match=message):
        shm.AttachedBuffers(offer, 1 << 20)
    worker.close()


# ----------------------------------------------------------------- real endpoints
@contextmanager
def endpoints(doorbells: bool, heap: int = 4096) -> Iterator[tuple[ServerEndpoint, ClientEndpoint, Any]]:
    options = ZmqOptions(transport=TransportOptions(doorbells=doorbells))
    server_side, worker_side = ZmqTransport(options), ZmqTransport(options)
    server = server_side.serve("127.0.0.1:0", "ps 0")
    client = worker_side.connect([server.address.removeprefix("tcp://")], ["ps 0"], b"w")
    try:
        yield server, client, client.buffers(0, SIZE, extra_bytes=heap, extra_arrays=3 if heap else 0)
    finally:
        client.close()
        server.close()
        for transport in (worker_side, server_side):
            transport.close()


def round_trip(server: ServerEndpoint, client: ClientEndpoint, buffers: Any, step: int) -> tuple[Message, Message]:
    """One push with a table's ids, rows and pulled ids, and a reply with the pulled rows."""
    buffers.grads[:] = step
    push = Message("push_pull", {"step": step}, [buffers.grads, IDS, ROWS * step, IDS[:2]], stable=True)
    pending = client.start_many({0: push})
    incoming = server.receive(5.0)
    assert incoming is not None and incoming.message is not None, incoming
    got = incoming.message
    reply = Message("params", {"step": step}, [np.full(SIZE, step, np.float32), ROWS[:2] + step], got.rid)
    reply.in_place = True
    assert server.reply(b"w", reply)
    return got, pending.wait(10.0, "the parameters")[0]


def lent_round_trip(server: ServerEndpoint, client: ClientEndpoint, buffers: Any) -> Message:
    """Round trips until one crosses the worker's memory (lending is agreed beside the first steps); its push."""
    for step in range(1, 100):
        got, _ = round_trip(server, client, buffers, step)
        if got.borrowed:
            return got
    raise AssertionError("no push crossed the worker's memory in 99 round trips")


@pytest.mark.parametrize("doorbells", [True, False], ids=["knock", "header"])
def test_a_push_with_tables_and_its_reply_cross_the_workers_memory(doorbells: bool) -> None:
    with endpoints(doorbells) as (server, client, buffers):
        deadline = time.monotonic() + 10
        for step in range(1, 100):  # lending is agreed beside the first steps: within a few, they use it
            got, answer = round_trip(server, client, buffers, step)
            assert got.fields == {"step": step} and (got.arrays[0] == step).all()
            np.testing.assert_array_equal(got.arrays[1], IDS)
            np.testing.assert_array_equal(got.arrays[2], ROWS * step)
            np.testing.assert_array_equal(got.arrays[3], IDS[:2])
            assert (answer.arrays[0] == step).all() and len(answer.arrays) == 2
            np.testing.assert_array_equal(answer.arrays[1], ROWS[:2] + step)
            if got.borrowed or time.monotonic() > deadline:
                break
        assert got.borrowed and client.sharing(0) != "frames"
        assert answer.arrays[0] is buffers.params  # landed in the lent memory, rows and all
        assert server.reply_room(b"w", got.rid + 1, [(2, 4)]) is None  # its last reply is not known read yet
        buffers.grads[:] = 1.0
        pending = client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, ROWS, IDS[:2]], stable=True)})
        incoming = server.receive(5.0)
        assert incoming is not None and incoming.message is not None
        room = server.reply_room(b"w", incoming.message.rid, [(2, 4)])
        assert room is not None  # this reply's rows may be gathered where they go
        room[0][...] = 7.0
        reply = Message("params", {}, [np.zeros(SIZE, np.float32), room[0]], incoming.message.rid, in_place=True)
        assert server.reply(b"w", reply)
        np.testing.assert_array_equal(pending.wait(10.0, "the parameters")[0].arrays[1], np.full((2, 4), 7.0))


def test_only_a_pushs_row_gradients_are_read_in_place_any_other_requests_values_are_copied() -> None:
    """A chief's init or restore is checked and then kept: nothing of it may stay in the worker's memory."""
    with endpoints(doorbells=True) as (server, client, buffers):
        got = lent_round_trip(server, client, buffers)
        assert not got.arrays[2].flags.owndata and got.arrays[1].flags.owndata
        client.start_many({0: Message("restore", {}, [buffers.grads, IDS, ROWS], stable=True)})
        incoming = server.receive(5.0)
        assert incoming is not None and incoming.message is not None and incoming.message.borrowed
        assert all(array.flags.owndata for array in incoming.message.arrays[1:])
        np.testing.assert_array_equal(incoming.message.arrays[2], ROWS)


def test_a_hostile_heap_is_refused_to_its_sender_and_the_ps_serves_on() -> None:
    """Whatever a worker writes in its heap, the ps's endpoint hands the ps a refusal, never an exception."""
    with endpoints(doorbells=True) as (server, client, buffers):
        lent_round_trip(server, client, buffers)
        heap = client.links.by_index[0].memory._views.up  # type: ignore[attr-defined]
        buffers.grads[:] = 1.0
        client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, ROWS, IDS], stable=True)})
        heap._descriptors[0] = (0, 0, 1 << 63, 0)  # rewritten after the knock, before the ps reads it
        refused = server.receive(5.0)
        assert refused is not None and refused.message is None and "size over" in str(refused.error)
        got, answer = round_trip(server, client, buffers, 200)  # the next push is served as ever
        np.testing.assert_array_equal(got.arrays[2], ROWS * 200)
        np.testing.assert_array_equal(answer.arrays[1], ROWS[:2] + 200)


def lend(server: ServerEndpoint, client: ClientEndpoint, buffers: Any) -> None:
    """Push until the lending is agreed and the ps reads a push from the worker's memory."""
    for step in range(1, 100):
        got, _ = round_trip(server, client, buffers, step)
        if got.borrowed:
            return
    raise AssertionError("the worker's memory was never used")


def test_a_push_naming_a_heap_the_ps_let_go_is_sent_again_whole() -> None:
    """Say a restarted ps: its endpoint sends the request back, and the worker's sends all four arrays in frames."""
    with endpoints(doorbells=False) as (server, client, buffers):
        lend(server, client, buffers)
        server.forget(b"w")
        buffers.grads[:] = 7.0
        pending = client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, ROWS * 7, IDS[:2]], stable=True)})
        deadline, got = time.monotonic() + 10, None
        while got is None and time.monotonic() < deadline:
            client.receive(0.01)  # the worker takes the endpoint's answer and sends the request again
            got = server.receive(0.05)
        assert got is not None and got.message is not None and not got.message.borrowed
        np.testing.assert_array_equal(got.message.arrays[2], ROWS * 7)
        assert len(got.message.arrays) == 4 and (got.message.arrays[0] == 7.0).all()
        assert server.reply(b"w", Message("params", {}, [np.zeros(SIZE, np.float32), ROWS], got.message.rid))
        np.testing.assert_array_equal(pending.wait(10.0, "the parameters")[0].arrays[1], ROWS)


def test_rows_a_heap_cannot_hold_come_back_whole_in_frames() -> None:
    with endpoints(doorbells=True, heap=200) as (server, client, buffers):  # room for the push's small arrays
        lend(server, client, buffers)
        buffers.grads[:] = 3.0
        pending = client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, ROWS, IDS], stable=True)})
        got = server.receive(5.0)
        assert got is not None and got.message is not None and got.message.borrowed
        many = np.arange(1600, dtype=np.float32).reshape(100, 16)  # 6,400 bytes: more than the heap holds
        reply = Message("params", {}, [np.full(SIZE, 3.0, np.float32), many], got.message.rid, in_place=True)
        assert server.reply(b"w", reply)
        many[:] = -1.0  # in place means the endpoint is done with it: it went as a copy
        answer = pending.wait(10.0, "the parameters")[0]
        assert (answer.arrays[0] == 3.0).all()
        np.testing.assert_array_equal(answer.arrays[1], np.arange(1600, dtype=np.float32).reshape(100, 16))


def test_without_a_heap_a_push_with_tables_goes_whole_in_frames() -> None:
    with endpoints(doorbells=True, heap=0) as (server, client, buffers):
        for step in range(1, 30):
            got, answer = round_trip(server, client, buffers, step)
            np.testing.assert_array_equal(got.arrays[2], ROWS * step)
            np.testing.assert_array_equal(answer.arrays[1], ROWS[:2] + step)
            assert not got.borrowed
        assert client.sharing(0) != "frames"  # lent, and used for pushes without tables
