"""Room a worker lends itself in its up heap: a push's row gradients written there go without a copy.

A dense gradient is written by the backend into its lent region and sent
from there; :meth:`psdk.transport.heap.Heap.lend` gives a push's rows the
same, and the ps reads them as any heap's arrays, checked the same way.
"""

from __future__ import annotations

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
        assert copies_during(monkeypatch, lambda: worker.put_arrays(5, [IDS, room[0], IDS[:2]])) == [(4,), (2,)]
        ids, rows, pulled = ps.take_arrays(5, borrow_values=True)
        np.testing.assert_array_equal(rows, ROWS)
        np.testing.assert_array_equal(ids, IDS)
        np.testing.assert_array_equal(pulled, IDS[:2])
        # Sent, the room is the heap's again: the next request's arrays may fill all of it.
        whole = np.ones((HEAP - 2048) // 16, np.float32).reshape(-1, 4)
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


def test_rooms_never_sent_give_way_to_the_next_and_too_big_a_room_is_refused() -> None:
    with memory() as (worker, _):
        for _ in range(10):  # each lent, none pushed: the heap does not fill up with them
            assert worker.lend_room([(100, 4)]) is not None
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
