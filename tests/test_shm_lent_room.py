"""Room a worker lends itself in its up heap: a push's row gradients written there go without a copy.

A dense gradient is written by the backend into its lent region and sent
from there; :meth:`psdk.transport.heap.Heap.lend` gives a push's rows the
same, and the ps reads them as any heap's arrays, checked the same way.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from psdk.errors import ProtocolError
from psdk.transport import shm
from psdk.transport.wire import Message

from .test_shm_heap import HEAP, IDS, ROWS, SIZE, endpoints, lend, memory, round_trip

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc"),
]


def copies_during(monkeypatch: pytest.MonkeyPatch, write: object) -> list[tuple[int, ...]]:
    """The shapes ``np.copyto`` copied while ``write()`` ran."""
    copied: list[tuple[int, ...]] = []
    copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copied.append(np.shape(src)), copyto(dst, src, **kw)))
    write()  # type: ignore[operator]
    monkeypatch.undo()
    return copied


def test_rows_written_in_lent_room_reach_the_ps_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    with memory() as (worker, ps):
        room = worker.lend_room([(4, 4)])
        assert room is not None and room[0].shape == (4, 4) and not room[0].flags.owndata
        room[0][...] = ROWS  # as the backward writes its row gradients
        push = [IDS, room[0], IDS[:2]]
        assert copies_during(monkeypatch, lambda: worker.put_arrays(5, push, ends_rooms=True)) == [(4,), (2,)]
        ids, rows, pulled = ps.take_arrays(5, borrow_values=True)
        np.testing.assert_array_equal(rows, ROWS)
        np.testing.assert_array_equal(ids, IDS)
        np.testing.assert_array_equal(pulled, IDS[:2])
        # Sent, the room is the heap's again: the next request's arrays may fill all of it.
        whole = np.ones(worker._views.up._data.size // 4, np.float32).reshape(-1, 4)  # type: ignore[union-attr]
        assert worker.put_arrays(6, [whole])
        np.testing.assert_array_equal(ps.take_arrays(6)[0], whole)


def test_two_rooms_lie_apart_and_a_room_given_twice_is_copied_the_second_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with memory() as (worker, ps):
        first, second = worker.lend_room([(4, 4)]), worker.lend_room([(2, 4)])
        assert first is not None and second is not None
        first[0][...], second[0][...] = ROWS, -ROWS[:2]
        arrays = [IDS, first[0], IDS[:2], second[0], first[0]]
        assert copies_during(monkeypatch, lambda: worker.put_arrays(5, arrays)) == [(4,), (2,), (4, 4)]
        got = ps.take_arrays(5)
        for sent, read in zip(arrays, got, strict=True):
            np.testing.assert_array_equal(read, sent)


def test_a_request_sent_before_the_room_leaves_it_alone() -> None:
    """Say a pull between the backward and its push: its arrays go below the room, which keeps its rows."""
    with memory() as (worker, ps):
        room = worker.lend_room([(4, 4)])
        assert room is not None
        room[0][...] = ROWS
        big = np.arange(3 * 4096 // 4, dtype=np.float32).reshape(-1, 4)  # more than fits below the room
        assert not worker.put_arrays(5, [big])  # so it goes in frames, the room untouched
        assert worker.put_arrays(6, [IDS, IDS])
        np.testing.assert_array_equal(room[0], ROWS)
        assert worker.put_arrays(7, [IDS, room[0]])
        np.testing.assert_array_equal(ps.take_arrays(7)[1], ROWS)


def test_a_push_ends_the_rooms_it_did_not_send_and_no_room_is_lent_over_one_still_held() -> None:
    """Say the rows were pushed from an array of their own (unsorted ids, a copying push): the rooms lent for
    that push end with it, so the next push's rooms never lie over rooms a caller may still hold."""
    with memory() as (worker, ps):
        held = [worker.lend_room([(100, 4)]) for _ in range(10)]
        assert held[0] is not None and None in held  # the heap filled with rooms: none lent over another
        rooms = [room[0] for room in held if room is not None]
        assert not any(np.shares_memory(a, b) for i, a in enumerate(rooms) for b in rooms[i + 1 :])
        whole = np.ones(worker._views.up._data.size // 4, np.float32).reshape(-1, 4)  # type: ignore[union-attr]
        assert not worker.put_arrays(5, [whole])  # a pull: the rooms stay the caller's, so it goes in frames
        assert worker.put_arrays(6, [IDS, ROWS], ends_rooms=True)  # the push they were for, without them
        first, second = worker.lend_room([(4, 4)]), worker.lend_room([(4, 4)])
        assert first is not None and second is not None and not np.shares_memory(first[0], second[0])
        assert worker.put_arrays(7, [IDS, first[0]], ends_rooms=True) and worker.put_arrays(8, [whole], True)
        np.testing.assert_array_equal(ps.take_arrays(8)[0], whole)
        assert worker.lend_room([(HEAP, 4)]) is None
        assert worker.lend_room([(1, 0)]) is None
    with memory(0) as (worker, _):  # no heap: nothing to lend
        assert worker.lend_room([(1, 4)]) is None


def test_lending_tears_a_request_the_ps_was_still_reading() -> None:
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS, ROWS])
        assert worker.lend_room([(4, 4)]) is not None
        with pytest.raises(ProtocolError, match="rewritten while they were read"):
            ps.take_arrays(5)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_ps_takes_arrays_in_any_order_but_never_overlapping(order: tuple[int, int]) -> None:
    with memory() as (worker, ps):
        worker.put_arrays(5, [IDS, IDS])
        heap = worker._views.up  # type: ignore[union-attr]
        first, second = heap._descriptors[0].copy(), heap._descriptors[1].copy()
        heap._descriptors[order[0]], heap._descriptors[order[1]] = first, second
        assert [list(a) for a in ps.take_arrays(5)] == [list(IDS)] * 2
        heap._descriptors[1] = heap._descriptors[0]
        with pytest.raises(ProtocolError, match="overlap"):
            ps.take_arrays(5)


def test_a_worker_lends_room_only_while_the_ps_reads_nothing_of_its_memory() -> None:
    with endpoints(doorbells=True) as (server, client, buffers):
        assert client.room(0, [(4, 4)]) is None  # not lent yet: the arrays go in frames
        lend(server, client, buffers)
        room = client.room(0, [(4, 4)])
        assert room is not None
        room[0][...] = ROWS * 9
        buffers.grads[:] = 9.0
        pending = client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, room[0], IDS[:2]], stable=True)})
        assert client.room(0, [(4, 4)]) is None  # the ps may be reading the heap
        got = server.receive(5.0)
        assert got is not None and got.message is not None and got.message.borrowed
        np.testing.assert_array_equal(got.message.arrays[2], ROWS * 9)
        assert server.reply(b"w", Message("params", {}, [np.zeros(SIZE, np.float32), ROWS], got.message.rid))
        pending.wait(10.0, "the parameters")
        assert client.room(0, [(4, 4)]) is not None  # answered: the heap is the worker's again
        round_trip(server, client, buffers, 3)


def test_lending_resumes_after_a_push_was_sent_again_whole() -> None:
    """A ps that let the worker's memory go sends the push back; its rid, sent twice, is answered once."""
    with endpoints(doorbells=False) as (server, client, buffers):
        lend(server, client, buffers)
        server.forget(b"w")
        pending = client.start_many({0: Message("push_pull", {}, [buffers.grads, IDS, ROWS, IDS[:2]], stable=True)})
        deadline, got = time.monotonic() + 10, None
        while got is None and time.monotonic() < deadline:
            client.receive(0.01)  # the worker takes the endpoint's answer and sends the request again
            got = server.receive(0.05)
        assert got is not None and got.message is not None and not got.message.borrowed
        assert server.reply(b"w", Message("params", {}, [np.zeros(SIZE, np.float32), ROWS], got.message.rid))
        pending.wait(10.0, "the parameters")
        client.renew(0)
        lend(server, client, buffers)
        assert client.room(0, [(4, 4)]) is not None
