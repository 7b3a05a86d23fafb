"""Preallocated range tables indexed directly (``psdk/ps/tables/direct.py``) give what the hash index gave.

Each check runs the same pulls, pushes, checkpoint chunks and restores on a
preallocated ``range`` table (a :class:`DirectTable`, slot = id - low) and on
its twin built as every preallocated table was before: a hash-indexed
``RowTable`` whose block was created by training lookups of its ids. Values,
slots, counters and chunks must agree; only the LRU stamps differ (a direct
table keeps none: it never evicts). The last test runs a real 2-ps job over
ZeroMQ through a checkpoint and a resume on 3 ps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient
from psdk.client import checkpoint as ckpt
from psdk.config.options import TransportOptions
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec, owned_range
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import Adagrad, Adam, UpdateRule
from psdk.ps.tables.chunks import ChunkedRestore, state_chunk
from psdk.ps.tables.direct import DirectIndex, DirectTable
from psdk.ps.tables.hashing import initial_rows, table_key
from psdk.ps.tables.served import RowGrad, ServedTable
from psdk.ps.tables.table import RowTable

from .conftest import running_ps

pytestmark = pytest.mark.timeout(60)
ITEMS = TableSpec("items", dim=3, capacity=3001, sharding="range", preallocate=True, seed=5, max_ids=4096)
RULES = [Adagrad(lr=0.3, initial_accumulator_value=0.1, eps=0.0), Adam(lr=0.01)]


def hashed_twin(spec: TableSpec, shard: int, num_ps: int, rule: UpdateRule) -> ServedTable:
    """The shard's table as preallocation built it before the direct index: training lookups of its block."""
    twin = ServedTable(dataclasses.replace(spec, preallocate=False), shard, num_ps, rule)
    assert type(twin.rows) is RowTable
    low, high = owned_range(spec, shard, num_ps)
    for start in range(low, high, 1 << 20):
        twin.rows.lookup(np.arange(start, min(start + (1 << 20), high), dtype=np.int64))
    return twin


def assert_same_table(direct: ServedTable, hashed: ServedTable) -> None:
    ids, rows = direct.rows.export()
    twin_ids, twin_rows = hashed.rows.export()
    np.testing.assert_array_equal(ids, twin_ids)
    np.testing.assert_array_equal(rows, twin_rows)
    slots, twin_slots = direct.rows.gather(ids)[1], hashed.rows.gather(ids)[1]
    for name in slots:
        np.testing.assert_array_equal(slots[name], twin_slots[name])
    np.testing.assert_array_equal(direct.rows.header()["counters"], hashed.rows.header()["counters"])
    stats, twin_stats = direct.stats(), hashed.stats()
    assert {k: v for k, v in stats.items() if k != "bytes_per_row"} == {
        k: v for k, v in twin_stats.items() if k != "bytes_per_row"
    }


def train(tables: list[ServedTable], rule: UpdateRule, low: int, high: int, steps: int, seed: int) -> None:
    """The same pulls and pushes on each table; every pull must read the same rows on each."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = np.unique(rng.integers(low, high, 200)).astype(np.int64)
        pulled = [table.pull(table.check_ids(ids, "a pull")) for table in tables]
        for other in pulled[1:]:
            np.testing.assert_array_equal(pulled[0], other)
        grad = (rng.standard_normal((len(ids), tables[0].spec.dim)) * 0.1).astype(np.float32)
        for table in tables:
            checked = table.check_grad(ids, grad)
            table.commit(table.stage_update(RowGrad(checked.ids, checked.rows), rule, step))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("shard", [0, 1])
def test_pulls_and_pushes_of_a_direct_table_match_the_hash_indexed_one(rule: UpdateRule, shard: int) -> None:
    direct = ServedTable(ITEMS, shard, 2, rule)
    assert isinstance(direct.rows, DirectTable) and direct.rows.last_used.size == 0  # no stamps kept
    hashed = hashed_twin(ITEMS, shard, 2, rule)
    low, high = owned_range(ITEMS, shard, 2)
    assert len(direct.rows) == high - low == len(hashed.rows) and direct.rows.created == high - low
    assert_same_table(direct, hashed)
    train([direct, hashed], rule, low, high, 12, seed=shard)
    assert_same_table(direct, hashed)
    assert direct.dropped_rows == hashed.dropped_rows == 0
    reads = np.array([low, (low + high) // 2, high - 1], np.int64)
    np.testing.assert_array_equal(direct.pull(reads, create=False), hashed.pull(reads, create=False))


def chunks(table: ServedTable, rows: int) -> list[dict[str, np.ndarray]]:
    """The table's rows chunks as ``table_state`` replies carry them (ids, rows, stamps, slots)."""
    found, cursor = [], 0
    while cursor is not None:
        fields, arrays = state_chunk(table, "rows", cursor, rows)
        names = ["ids", "rows", "last_used", *("slot." + s for s in fields["slots"])]
        found.append(dict(zip(names, arrays, strict=True)))
        cursor = fields["next"]
    return found


def restored(target: ServedTable, source: ServedTable, rule: UpdateRule, rows: int) -> None:
    """Restore ``source``'s state into ``target`` chunk by chunk, as a chief's ``table_restore`` does."""
    restore = ChunkedRestore.start(target, rows)
    cursor = 0
    while cursor is not None:
        fields, arrays = state_chunk(source, "rows", cursor, rows)
        if len(arrays[0]):  # in id order, as the chief sends a restore (a lazy table reads out in slot order)
            order = np.argsort(arrays[0])
            restore.take({"part": "rows", "slots": fields["slots"]}, [a[order] for a in arrays], rule)
        cursor = fields["next"]
    restore.commit(source.rows.header()["counters"].tolist())


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_checkpoint_chunks_and_restores_carry_the_same_rows_both_ways(rule: UpdateRule) -> None:
    direct, hashed = ServedTable(ITEMS, 1, 2, rule), hashed_twin(ITEMS, 1, 2, rule)
    low, high = owned_range(ITEMS, 1, 2)
    train([direct, hashed], rule, low, high, 5, seed=3)
    mine, theirs = chunks(direct, 256), chunks(hashed, 256)
    assert len(mine) == len(theirs) == -(-(high - low) // 256) and all(len(c["ids"]) <= 256 for c in mine)
    for key in ("ids", "rows", *("slot." + s for s in direct.rows.slots)):
        np.testing.assert_array_equal(np.concatenate([c[key] for c in mine]), np.concatenate([c[key] for c in theirs]))
    stamps = np.concatenate([c["last_used"] for c in mine])
    assert stamps.dtype == np.int32 and not stamps.any()  # uint32 bits on the wire; zero: no LRU order to keep

    into_direct = ServedTable(ITEMS, 1, 2, rule)
    restored(into_direct, hashed, rule, 300)
    assert isinstance(into_direct.rows, DirectTable) and into_direct.rows.direct.full
    assert_same_table(into_direct, hashed)
    into_hashed = ServedTable(dataclasses.replace(ITEMS, preallocate=False), 1, 2, rule)
    restored(into_hashed, direct, rule, 300)
    assert_same_table(direct, into_hashed)
    train([into_direct, into_hashed, direct, hashed], rule, low, high, 3, seed=4)  # and they train on alike


def test_a_lazy_tables_checkpoint_restores_into_a_direct_table_missing_rows_come_on_their_pull() -> None:
    rule = RULES[0]
    lazy = ServedTable(dataclasses.replace(ITEMS, preallocate=False), 0, 2, rule)
    low, high = owned_range(ITEMS, 0, 2)
    train([lazy], rule, low, high, 3, seed=9)
    held, _ = lazy.rows.export()
    table = ServedTable(ITEMS, 0, 2, rule)
    restored(table, lazy, rule, 100)
    assert len(table.rows) == len(held) < high - low and not table.rows.direct.full
    missing = np.setdiff1d(np.arange(low, high), held)[:5]
    assert not table.pull(missing, create=False).any() and not table.rows.admitted(missing).any()
    assert table.stage_update(RowGrad(missing, np.ones((5, 3), np.float32)), rule, 0).where.size == 0
    key = table_key(ITEMS.seed, ITEMS.name)
    np.testing.assert_array_equal(table.pull(missing), initial_rows(missing, 3, key, "normal", ITEMS.init_scale))
    assert len(table.rows) == len(held) + 5 and table.rows.created == lazy.rows.created + 5
    np.testing.assert_array_equal(table.pull(held, create=False), lazy.pull(held, create=False))


def test_the_direct_index_finds_its_block_only_and_never_evicts() -> None:
    index = DirectIndex(10, 20)
    assert index.find(np.array([9, 10, 15, 19, 20], np.int64)).tolist() == [-1, -1, -1, -1, -1]
    assert index.insert(np.array([15, 12, 15], np.int64)).tolist() == [5, 2, 5] and len(index) == 2
    assert index.find(np.array([9, 12, 15, 16, 20], np.int64)).tolist() == [-1, 2, 5, -1, -1]
    assert index.live_between(0, 10).tolist() == [2, 5] and index.ids_of(index.live_slots()).tolist() == [12, 15]
    with pytest.raises(ValueError, match="outside this block"):
        index.insert(np.array([20], np.int64))
    with pytest.raises(ValueError, match="never evicts"):
        index.remove_slots(np.array([2]))
    index.fill()
    assert index.full and index.find(np.array([10, 19, 21], np.int64)).tolist() == [0, 9, -1]


def test_a_shard_whose_block_is_empty_holds_nothing_and_refuses_every_id() -> None:
    spec = dataclasses.replace(ITEMS, capacity=5)
    assert owned_range(spec, 3, 4) == (5, 5)
    table = ServedTable(spec, 3, 4, RULES[0])
    assert len(table.rows) == 0 and table.rows.export()[0].size == 0 and chunks(table, 8)[0]["ids"].size == 0
    direct = DirectTable(5, 5, 3)
    assert direct.lookup(np.zeros(0, np.int64)).shape == (0, 3) and len(direct) == 0


FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0, request_timeout_s=20.0, init_timeout_s=20.0
    ),
    table_chunk_rows=500,
)
DENSE = {"w": np.zeros((2, 3), np.float32)}


def test_a_preallocated_table_trains_checkpoints_and_resumes_on_three_ps(tmp_path: Path) -> None:
    """A real job: 2 ps hold the table, a checkpoint moves it to 3; every row and slot comes back."""
    rule = RULES[0]
    rng = np.random.default_rng(2)
    job = JobSpec(SyncSpec("async").resolved(1), 1000, 1)
    with running_ps(2) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            assert client.initialize(DENSE, job, rule, tables=(ITEMS,))
            client.pull()
            for _ in range(3):
                ids = rng.integers(0, ITEMS.capacity, 300)
                client.pull_rows({"items": ids})
                client.push_pull(rows={"items": (ids, rng.normal(size=(300, 3)).astype(np.float32))})
            every = np.arange(ITEMS.capacity, dtype=np.int64)
            before = client.pull_rows({"items": every}, read=True)["items"]
            sums = np.concatenate([s.store.tables["items"].rows.state()["slot.sum"] for s in ps.servers])
            state = client.checkpoint_state(folder=tmp_path)
            path = ckpt.save(state, ckpt.path_for(tmp_path, state.global_step, "run"))
        finally:
            client.close()
    key = table_key(ITEMS.seed, ITEMS.name)
    assert (before != initial_rows(every, 3, key, "normal", ITEMS.init_scale)).any(axis=1).sum() > 100
    with running_ps(3) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            assert client.initialize(DENSE, job, rule, restore=ckpt.load(path), tables=(ITEMS,))
            client.pull()
            np.testing.assert_array_equal(client.pull_rows({"items": every}, read=True)["items"], before)
            held = [s.store.tables["items"].rows for s in ps.servers]
            assert all(isinstance(t, DirectTable) and t.direct.full for t in held)
            np.testing.assert_array_equal(np.concatenate([t.state()["slot.sum"] for t in held]), sums)
            assert [s["tables"]["items"]["rows"] for s in client.stats()] == [1001, 1001, 999]
        finally:
            client.close()
