"""The worker's side of tables: ids already unique and sorted are taken as they are, others sorted and summed,
and pulled rows always come back in the caller's order; the transport keeps frames of stable buffers only."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from psdk.client.rows import plan_tables, split_by_shard, sum_duplicates, unique_ids
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.transport.frames import FrameReuse

pytestmark = pytest.mark.timeout(30)
SPEC = TableSpec("emb", 4, capacity=1000)


def test_unique_sorted_ids_are_neither_sorted_nor_copied_again() -> None:
    ids = np.array([3, 7, 100, 999], np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4)
    pushed, rows = sum_duplicates(SPEC, ids, grads)
    assert np.shares_memory(pushed, ids) and np.shares_memory(rows, grads)
    unique, inverse = unique_ids(ids)
    assert unique is ids and inverse is None


def test_unsorted_and_repeated_ids_are_sorted_and_their_gradients_summed() -> None:
    ids = np.array([7, 3, 7, 1], np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4)
    pushed, rows = sum_duplicates(SPEC, ids, grads)
    assert pushed.tolist() == [1, 3, 7]
    np.testing.assert_allclose(rows, [grads[3], grads[1], grads[0] + grads[2]], atol=1e-6)
    unique, inverse = unique_ids(ids)
    assert unique.tolist() == [1, 3, 7] and inverse is not None and unique[inverse].tolist() == ids.tolist()


@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("order", ["sorted", "shuffled", "repeated"])
def test_pulled_rows_come_back_in_the_callers_order(num_ps: int, order: str) -> None:
    rng = np.random.default_rng(num_ps)
    ids = np.unique(rng.integers(0, 1000, 200)).astype(np.int64)
    if order != "sorted":
        ids = rng.permutation(ids)
    if order == "repeated":
        ids = np.concatenate([ids, ids[:50]])

    def row_of(i: np.ndarray) -> np.ndarray:  # what a ps sends: a row that names its id
        return np.repeat(i.astype(np.float32)[:, None], SPEC.dim, axis=1)

    parts, plans = plan_tables({"emb": SPEC}, num_ps, pull={"emb": ids})
    sent = {shard: row_of(part.arrays[0]) for shard, part in parts.items() if part.entries}
    assert all(np.all(np.diff(part.arrays[0]) > 0) for part in parts.values() if part.entries)  # as the ps takes them
    rows = plans["emb"].assemble(sent)
    np.testing.assert_allclose(rows, row_of(ids), atol=0)
    assert plans["emb"].ids.tolist() == ids.tolist()


@pytest.mark.parametrize("sharding", ["hash", "range"])
@pytest.mark.parametrize("num_ps", [1, 2, 3, 7])
def test_each_shard_gets_exactly_the_ids_it_holds_and_a_range_tables_parts_are_views(
    sharding: str, num_ps: int
) -> None:
    spec = TableSpec("emb", 4, capacity=1000, sharding=sharding)
    for draw in range(20):
        rng = np.random.default_rng(draw)
        ids = np.unique(rng.integers(0, 1000 if draw % 2 else rng.integers(1, 1000), rng.integers(0, 60)))
        grads = rng.standard_normal((len(ids), 4)).astype(np.float32)
        parts, plans = plan_tables({"emb": spec}, num_ps, push={"emb": (ids, grads)}, pull={"emb": ids})
        where = shard_of_ids(spec, ids, num_ps)
        for shard in range(num_ps):
            held = ids[where == shard]
            if not len(held):
                assert not parts[shard].entries
                continue
            pushed, rows, pulled = parts[shard].arrays
            assert pushed.tolist() == held.tolist() == pulled.tolist()
            np.testing.assert_array_equal(rows, grads[where == shard])
            if sharding == "range" or num_ps == 1:
                assert np.shares_memory(rows, grads) and np.shares_memory(pulled, plans["emb"].sent)
            assert not np.shares_memory(pulled, ids)  # a training pull's ids go from the plan's own copy
        copied, _ = plan_tables({"emb": spec}, num_ps, push={"emb": (ids, grads)}, pull={"emb": ids}, copy=True)
        for part in copied.values():  # the caller may change its arrays before the reply: none is theirs
            assert not any(np.shares_memory(a, b) for a in part.arrays for b in (ids, grads))
        if len(ids):
            sent = {shard: parts[shard].arrays[1] for shard in plans["emb"].masks}
            np.testing.assert_array_equal(plans["emb"].assemble(sent), grads)


def test_ids_a_range_table_cannot_hold_are_refused_whatever_the_shards() -> None:
    spec = TableSpec("emb", 4, capacity=1000, sharding="range")
    for num_ps in (1, 2):
        with pytest.raises(ValueError, match=r"holds ids 0 \.\. 999"):
            split_by_shard(spec, np.array([5, 1000], np.int64), num_ps)


def test_rows_of_the_wrong_shape_are_refused() -> None:
    from psdk.errors import PsdkError

    _, plans = plan_tables({"emb": SPEC}, 1, pull={"emb": np.array([1, 2], np.int64)})
    with pytest.raises(PsdkError, match="sent rows of table 'emb' of shape"):
        plans["emb"].assemble({0: np.zeros((3, SPEC.dim), np.float32)})


def test_only_a_messages_first_array_keeps_its_frame() -> None:
    """A step's rows are fresh arrays: kept frames would hold every one alive (up to the table's capacity)."""
    reuse = FrameReuse(capacity=8)
    stable = np.zeros(1 << 16, np.float32)
    for _ in range(20):
        fresh = np.ones(1 << 16, np.float32)
        parts = reuse.frames([b"peer", b"header", stable, fresh], 2)
        assert isinstance(parts[2], zmq.Frame) and parts[3] is fresh
    assert len(reuse) == 1
    again = reuse.frames([b"header", stable], 1)
    assert again[1] is parts[2]  # the same frame, built once


def test_a_push_of_the_ids_the_last_pull_named_takes_that_pulls_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step pushes the ids it pulled a step before: a hash table's are not hashed for their shards again."""
    import psdk.client.rows as rows_module

    spec = TableSpec("emb", 4, capacity=1000, sharding="hash")
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(0, 1000, 300)).astype(np.int64)
    grads = rng.standard_normal((len(ids), 4)).astype(np.float32)
    plain, _ = plan_tables({"emb": spec}, 2, push={"emb": (ids, grads)})
    _, pulled = plan_tables({"emb": spec}, 2, pull={"emb": ids})
    hashed: list[int] = []
    real = rows_module.shard_of_ids
    monkeypatch.setattr(rows_module, "shard_of_ids", lambda *a: hashed.append(len(a[1])) or real(*a))

    reused, _ = plan_tables({"emb": spec}, 2, push={"emb": (ids, grads)}, previous=pulled)
    assert hashed == []  # the pull's split, taken as it was
    for shard in range(2):
        for got, want in zip(reused[shard].arrays, plain[shard].arrays, strict=True):
            np.testing.assert_array_equal(got, want)

    ids[:] = np.arange(len(ids)) * 3  # the caller rewrites, in place, the array it pulled with: other ids now
    again, _ = plan_tables({"emb": spec}, 2, push={"emb": (ids, grads)}, previous=pulled)
    assert hashed == [len(ids)]  # the plan kept its own copy of the pulled ids, which no longer match: split afresh
    where = shard_of_ids(spec, ids, 2)
    for shard in range(2):
        np.testing.assert_array_equal(again[shard].arrays[0], ids[where == shard])
        np.testing.assert_array_equal(again[shard].arrays[1], grads[where == shard])
