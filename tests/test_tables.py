"""The ps-side row table of an embedding table (``psdk/ps/tables/``): index, rows, eviction, admission, state.

Nothing here goes over the wire: these are the table's own promises, which
the protocol and the store build on later (docs/tables.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psdk.ps.tables.hashing import CountMinSketch, initial_rows, table_key
from psdk.ps.tables.index import RowIndex
from psdk.ps.tables.table import RowTable

pytestmark = pytest.mark.timeout(30)
RTOL, ATOL = 1e-6, 1e-7


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def test_a_lookup_creates_rows_that_read_back_and_a_block_round_trips() -> None:
    table = RowTable(3, 16, slot_names=("m",), seed=7)
    first = table.lookup(ids(10, 4, 99))
    assert first.shape == (3, 3) and len(table) == 3 and table.created == 3
    np.testing.assert_allclose(table.lookup(ids(99, 10), create=False), first[[2, 0]], rtol=RTOL, atol=ATOL)
    rows, slots = table.gather(ids(4, 99))
    table.scatter(ids(4, 99), rows + 1.0, {"m": slots["m"] + 2.0})
    np.testing.assert_allclose(table.lookup(ids(4), create=False), first[[1]] + 1.0, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(table.gather(ids(99))[1]["m"], np.full((1, 3), 2.0), rtol=RTOL, atol=ATOL)
    assert table.lookup(ids(12345), create=False).tolist() == [[0.0, 0.0, 0.0]] and len(table) == 3


@pytest.mark.parametrize(
    "wanted",
    [(4, 10, 99), (10, 4, 99), (4, 10, 4), (4, 10, 12345), (12345, 4)],
    ids=["increasing", "any order", "duplicates", "one without a row", "unsorted, one without"],
)
def test_a_lookup_into_given_memory_fills_it_as_a_fresh_one_would(wanted: tuple[int, ...]) -> None:
    """The ps gathers a pull's rows straight into the worker's memory (psdk.transport.heap's room)."""
    table = RowTable(3, 16, seed=7)
    table.lookup(ids(10, 4, 99))
    expected = table.lookup(ids(*wanted), create=False)
    out = np.full((len(wanted), 3), np.nan, np.float32)
    increasing = bool(np.all(np.diff(wanted) > 0))
    assert table.lookup(ids(*wanted), create=False, increasing=increasing, out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_duplicate_ids_in_a_batch_get_one_row_each_time() -> None:
    table = RowTable(4, 8)
    rows = table.lookup(ids(5, 2, 5, 5, 2))
    assert len(table) == 2
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows[0], rows[3])
    np.testing.assert_array_equal(rows[1], rows[4])
    assert not np.array_equal(rows[0], rows[1])


def test_scatter_refuses_repeated_missing_or_misshapen_blocks() -> None:
    table = RowTable(2, 8, slot_names=("v",))
    table.lookup(ids(1, 2))
    with pytest.raises(ValueError, match="distinct ids"):
        table.scatter(ids(1, 1), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"have no row .*admitted"):
        table.gather(ids(1, 3))
    with pytest.raises(ValueError, match=r"not \(2, 3\)"):
        table.scatter(ids(1, 2), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="unknown slots"):
        table.scatter(ids(1), np.zeros((1, 2), np.float32), {"m": np.zeros((1, 2), np.float32)})


def test_the_initial_row_depends_on_seed_name_and_id_only_not_on_order_or_shard() -> None:
    every = np.random.default_rng(0).choice(10**12, 400, replace=False).astype(np.int64)
    whole = RowTable(8, 400, seed=3, name="users")
    reference = whole.lookup(every)
    shards = [RowTable(8, 400, seed=3, name="users") for _ in range(2)]
    shuffled = np.random.default_rng(1).permutation(every)
    for batch in np.array_split(shuffled, 7):
        for shard, part in enumerate(shards):
            part.lookup(batch[batch % 2 == shard])
    for shard, part in enumerate(shards):
        mine = every % 2 == shard
        np.testing.assert_array_equal(part.lookup(every[mine], create=False), reference[mine])
    assert not np.allclose(RowTable(8, 400, seed=4, name="users").lookup(every), reference)
    assert not np.allclose(RowTable(8, 400, seed=3, name="items").lookup(every), reference)


@pytest.mark.parametrize("initializer", ["normal", "uniform", "zeros"])
def test_the_initializers_draw_what_they_say(initializer: str) -> None:
    values = initial_rows(np.arange(20_000, dtype=np.int64), 16, table_key(0), initializer, 0.05)
    assert values.dtype == np.float32 and values.shape == (20_000, 16) and np.isfinite(values).all()
    want_std = {"normal": 0.05, "uniform": 0.05 / np.sqrt(3.0), "zeros": 0.0}[initializer]
    assert abs(float(values.mean())) < 1e-3
    assert float(values.std()) == pytest.approx(want_std, rel=0.02, abs=1e-9)
    if initializer == "uniform":
        assert np.abs(values).max() <= np.float32(0.05)  # U(-scale, scale), scale rounded to float32
    columns = np.corrcoef(values[:, :4].T) if initializer != "zeros" else np.eye(4)
    np.testing.assert_allclose(columns, np.eye(4), atol=0.03)


def test_eviction_takes_the_least_recently_used_first_and_counts() -> None:
    table = RowTable(2, 4, slot_names=("m",))
    table.lookup(ids(1, 2))
    table.lookup(ids(3, 4))
    table.lookup(ids(1))
    table.lookup(ids(5))  # full: 2 is the oldest
    assert sorted(table.export()[0].tolist()) == [1, 3, 4, 5] and table.evicted == 1
    table.lookup(ids(6, 7, 5))  # 3 and 4 are older than 1 and 5; 5 is in this lookup
    assert sorted(table.export()[0].tolist()) == [1, 5, 6, 7] and table.evicted == 3
    before = table.state()
    with pytest.raises(ValueError, match="5 distinct ids with rows cannot fit a table capped at 4"):
        table.lookup(ids(1, 2, 3, 4, 5))
    for key, value in table.state().items():  # a refused lookup changed nothing: no stamp, no clock tick
        np.testing.assert_array_equal(value, before[key])
    assert len(table.lookup(np.zeros(0, np.int64))) == 0


def test_a_row_evicted_and_looked_up_again_starts_over() -> None:
    table = RowTable(3, 2, slot_names=("m",), seed=1)
    initial = table.lookup(ids(8))
    rows, slots = table.gather(ids(8))
    table.scatter(ids(8), rows + 5.0, {"m": slots["m"] + 1.0})
    table.lookup(ids(20, 21))  # fills and evicts 8
    assert not table.admitted(ids(8))[0] and table.evicted == 1
    np.testing.assert_array_equal(table.lookup(ids(8)), initial)
    np.testing.assert_array_equal(table.gather(ids(8))[1]["m"], np.zeros((1, 3), np.float32))


def test_a_full_table_turning_over_keeps_its_cap_and_its_index_small() -> None:
    table = RowTable(4, 1000)
    for start in range(0, 20_000, 500):
        table.lookup(np.arange(start, start + 500, dtype=np.int64))
        assert len(table) <= 1000
    assert len(table) == 1000 and table.evicted == 19_000 and table.created == 20_000
    assert sorted(table.export()[0].tolist()) == list(range(19_000, 20_000))
    assert table.index.nbytes < 64 * 1000  # rebuilt, not grown by tombstones
    assert table.bytes_per_row() < 4 * 4 + 4 + 64


def test_admission_reads_zeros_until_an_id_is_seen_n_times() -> None:
    table = RowTable(2, 16, admit_after=3, seed=2)
    np.testing.assert_array_equal(table.lookup(ids(1, 2, 2)), np.zeros((3, 2), np.float32))
    assert table.admitted(ids(1, 2)).tolist() == [False, False] and len(table) == 0
    rows = table.lookup(ids(2, 1))  # 2 reaches 3 (duplicates count each), 1 is at 2
    assert table.admitted(ids(1, 2)).tolist() == [False, True]
    np.testing.assert_array_equal(rows[1], [0.0, 0.0])
    np.testing.assert_array_equal(rows[0], RowTable(2, 16, seed=2).lookup(ids(2))[0])
    table.lookup(ids(1), create=False)  # a read does not count
    assert not table.admitted(ids(1))[0]
    table.lookup(ids(1))
    assert table.admitted(ids(1))[0]


def test_eviction_keeps_the_counts_so_an_admitted_row_comes_straight_back() -> None:
    table = RowTable(2, 1, admit_after=2)
    table.lookup(ids(4, 4))
    table.lookup(ids(9, 9))  # evicts 4
    assert table.admitted(ids(4, 9)).tolist() == [False, True]
    table.lookup(ids(4))
    assert table.admitted(ids(4, 9)).tolist() == [True, False]


@settings(max_examples=40, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=300), st.sampled_from([1, 2, 8, 64]))
def test_the_sketch_never_counts_under(stream: list[int], width: int) -> None:
    sketch = CountMinSketch(depth=3, width=width)
    seen = np.array(stream, np.int64)
    for batch in np.array_split(seen, 3):
        unique, counts = np.unique(batch, return_counts=True)
        sketch.add(unique, counts)
    unique, counts = np.unique(seen, return_counts=True)
    assert (sketch.estimate(unique) >= counts).all()
    if width == 64 and len(unique) == 1:
        assert sketch.estimate(unique)[0] == counts[0]


def test_the_sketch_saturates_instead_of_wrapping() -> None:
    sketch = CountMinSketch(depth=2, width=4)
    sketch.add(ids(1), np.array([2**32 - 2]))
    sketch.add(ids(1), np.array([5]))
    assert sketch.estimate(ids(1))[0] == 2**32 - 1


def filled(admit_after: int = 0) -> RowTable:
    table = RowTable(3, 64, slot_names=("m", "v"), seed=5, admit_after=admit_after, sketch_width=32)
    for start in [*range(0, 90, 9)] * 2:
        table.lookup(np.arange(start, start + 12, dtype=np.int64) * 7)
    rows, slots = table.gather(table.export()[0][:5])
    table.scatter(table.export()[0][:5], rows * 2, {"v": slots["v"] + 3})
    return table


def same(a: RowTable, b: RowTable) -> None:
    for key, value in a.state().items():
        order_a, order_b = np.argsort(a.state()["ids"]), np.argsort(b.state()["ids"])
        by_row = value.ndim and len(value) == len(a) and key not in ("config", "counters", "sketch")
        theirs = b.state()[key]
        np.testing.assert_array_equal(value[order_a] if by_row else value, theirs[order_b] if by_row else theirs)


@pytest.mark.parametrize("admit_after", [0, 2])
def test_the_state_round_trips_whole_and_in_chunks(admit_after: int) -> None:
    table = filled(admit_after)
    assert table.evicted > 0 and set(table.state()) >= {"ids", "rows", "slot.m", "slot.v", "last_used", "counters"}
    settings = {"dim": 3, "capacity": 64, "slot_names": ("m", "v"), "seed": 5, "admit_after": admit_after}
    same(table, RowTable.from_state(table.state(), **settings, sketch_width=32))
    chunks = list(table.export_chunks(5))
    assert max(len(c.get("ids", ())) for c in chunks) == 5 and max(len(c.get("sketch", ())) for c in chunks) <= 15
    copy = RowTable(**settings, sketch_width=32)  # type: ignore[arg-type]
    restore = copy.restore()
    for chunk in chunks:
        restore.add(chunk)
        assert len(copy) == 0
    restore.commit()
    same(table, copy)
    np.testing.assert_array_equal(copy.lookup(ids(0, 7)), table.lookup(ids(0, 7)))
    assert copy.evicted == table.evicted


def test_chunks_of_a_table_below_its_cap_hold_only_its_rows() -> None:
    table = RowTable(2, 100, slot_names=("m",), admit_after=1, sketch_width=8)
    table.lookup(ids(42, 7, 42))
    chunks = list(table.export_chunks(256))
    assert sorted(np.concatenate([c["ids"] for c in chunks if "ids" in c]).tolist()) == [7, 42]
    copy = RowTable(2, 100, slot_names=("m",), admit_after=1, sketch_width=8)
    restore = copy.restore()
    for chunk in chunks:
        restore.add(chunk)
    restore.commit()
    same(table, copy)


def test_an_unfinished_or_refused_restore_leaves_the_table_as_it_was() -> None:
    table, source = filled(), filled()
    before = table.state()
    source.lookup(np.arange(1000, 1010, dtype=np.int64))
    chunks = list(source.export_chunks(4))
    restore = table.restore()
    for chunk in chunks[:-1]:
        restore.add(chunk)
    same_state = table.state()
    for key in before:
        np.testing.assert_array_equal(before[key], same_state[key])
    with pytest.raises(ValueError, match="the state has 64 rows, the restore got"):
        restore.commit()
    small = RowTable(3, 8, slot_names=("m", "v"))
    with pytest.raises(ValueError, match="do not fit"):
        small.restore().add(source.state())
    with pytest.raises(ValueError, match="header chunk is missing"):
        RowTable(3, 64, slot_names=("m", "v")).restore().commit()
    with pytest.raises(ValueError, match="dim, sketch depth, width"):
        RowTable(4, 64, slot_names=("m", "v")).restore().add(source.state())
    with pytest.raises(ValueError, match="this table needs"):
        RowTable(3, 64, slot_names=("m",)).restore().add(source.state())
    assert len(small) == 0


def test_export_gives_ids_and_rows_by_increasing_id() -> None:
    table = RowTable(2, 8)
    rows = table.lookup(ids(30, 10, 20))
    exported_ids, exported_rows = table.export()
    assert exported_ids.tolist() == [10, 20, 30]
    np.testing.assert_array_equal(exported_rows, rows[[1, 2, 0]])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2], "numpy int64 array, not list"),
        (np.array([1, 2], np.int32), "int64, not int32"),
        (np.array([1.0]), "int64, not float64"),
        (np.array([3, -1], np.int64), "non-negative, got -1"),
        (np.zeros((2, 2), np.int64), "one-dimensional"),
    ],
)
def test_ids_that_are_not_non_negative_int64_are_refused(bad: Any, message: str) -> None:
    table = RowTable(2, 8)
    for call in (table.lookup, table.admitted, table.gather, RowIndex(4).insert):
        with pytest.raises(ValueError, match=message):
            call(bad)
    assert len(table) == 0


def test_the_index_hands_out_slots_in_order_and_reuses_freed_ones() -> None:
    index = RowIndex(6)
    assert index.insert(ids(50, 40, 50, 60)).tolist() == [1, 0, 1, 2]
    index.remove_slots(np.array([1], np.int32))
    assert index.find(ids(40, 50, 60)).tolist() == [0, -1, 2]
    assert index.insert(ids(70, 80)).tolist() == [1, 3]
    with pytest.raises(ValueError, match="3 new ids do not fit"):
        index.insert(ids(1, 2, 3))
    big = RowIndex(200_000)
    many = np.random.default_rng(3).integers(0, 2**63 - 1, 150_000)
    slots = big.insert(many)
    np.testing.assert_array_equal(big.find(many), slots)
    assert len(big) == len(np.unique(many)) and big.nbytes < 40 * len(big)


class Reference:
    """A dict-based model of the table: the rows it must hold, their stamps and counts."""

    def __init__(self, capacity: int, admit_after: int) -> None:
        self.capacity, self.admit_after = capacity, admit_after
        self.rows: dict[int, np.ndarray] = {}
        self.used: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        self.clock = 0

    def lookup(self, batch: list[int], table: RowTable) -> np.ndarray:
        self.clock += 1
        for i in batch:
            self.counts[i] = self.counts.get(i, 0) + 1
        touched = set(batch) & set(self.rows)
        new = sorted(i for i in set(batch) - touched if self.counts[i] >= max(self.admit_after, 1))
        for i in touched:
            self.used[i] = self.clock
        kept = set(table.export()[0].tolist())
        gone = set(self.rows) - kept
        assert len(gone) == max(0, len(self.rows) + len(new) - self.capacity)
        assert not gone & touched
        if gone:  # any oldest rows, ties as the table chose
            assert max(self.used[i] for i in gone) <= min(
                (self.used[i] for i in set(self.rows) - gone), default=self.clock
            )
        for i in gone:
            del self.rows[i], self.used[i]
        for i in new:
            self.rows[i] = initial_rows(np.array([i], np.int64), table.dim, table_key(9), "normal", 0.01)[0]
            self.used[i] = self.clock
        assert kept == set(self.rows)
        return np.array([self.rows.get(i, np.zeros(table.dim, np.float32)) for i in batch])


@settings(max_examples=60, deadline=3000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 6),
    st.sampled_from([0, 2]),
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5), min_size=1, max_size=25),
    st.lists(st.floats(-2, 2), min_size=1, max_size=25),
)
def test_the_table_behaves_as_a_dict_of_rows_with_lru_and_counts(
    capacity: int, admit_after: int, batches: list[list[int]], deltas: list[float]
) -> None:
    table = RowTable(2, capacity, admit_after=admit_after, seed=9, sketch_width=1024)
    probe = np.arange(13, dtype=np.int64)
    assert (table.sketch is None) or len({tuple(c) for c in np.array(table.sketch._columns(probe)).T}) == 13
    model = Reference(capacity, admit_after)
    for step, batch in enumerate(batches):
        if len(set(batch)) > capacity:
            continue
        got = table.lookup(np.array(batch, np.int64))
        np.testing.assert_allclose(got, model.lookup(batch, table), rtol=RTOL, atol=ATOL)
        target = batch[0]
        if target in model.rows:
            delta = np.float32(deltas[step % len(deltas)])
            rows, _ = table.gather(np.array([target], np.int64))
            table.scatter(np.array([target], np.int64), rows + delta)
            model.rows[target] = model.rows[target] + delta
    exported_ids, exported_rows = table.export()
    assert exported_ids.tolist() == sorted(model.rows)
    for i, row in zip(exported_ids.tolist(), exported_rows, strict=True):
        np.testing.assert_allclose(row, model.rows[i], rtol=RTOL, atol=ATOL)


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_table_costs_memory_only_for_the_rows_handed_out() -> None:
    """Building the table writes none of its per-slot arrays (why ``np.empty``: ``psdk/ps/tables/table.py``)."""
    before = resident()
    table = RowTable(16, 1_000_000, slot_names=("m",))  # 2 x 64 MB of rows and slots, 16 MB of index
    assert resident() - before < 2**20
    table.lookup(np.arange(10_000, dtype=np.int64) * 1_000_003)
    assert resident() - before < 12 * 2**20
    assert table.bytes_per_row() < 16 * 4 * 2 + 4 + 40


def test_a_push_reuses_its_pulls_slots_only_while_they_still_hold_its_rows() -> None:
    """``slots_of_pushed`` must answer as ``index.find`` would: after evictions, admissions, or a new pull."""
    table = RowTable(2, 4, admit_after=2, sketch_width=64)
    table.lookup(ids(1, 2)), table.lookup(ids(1, 2))  # admitted at their second pull
    assert table.slots_of_pushed(ids(1, 2)).tolist() == table.index.find(ids(1, 2)).tolist() != [-1, -1]
    table.lookup(ids(7, 8))  # counted once: no rows yet, and the memory of this pull says so
    table.lookup(ids(7))  # admitted by a later pull of other ids
    assert table.slots_of_pushed(ids(7, 8)).tolist() == table.index.find(ids(7, 8)).tolist()
    assert table.slots_of_pushed(ids(7, 8))[0] >= 0 and table.slots_of_pushed(ids(7, 8))[1] == -1
    table.lookup(ids(3, 4)), table.lookup(ids(3, 4))  # two more rows: 1 and 2 are the oldest and one goes
    assert table.evicted == 1
    assert table.slots_of_pushed(ids(1, 2)).tolist() == table.index.find(ids(1, 2)).tolist()
    assert (table.index.find(ids(1, 2)) < 0).sum() == 1
    assert table.slots_of_pushed(ids(5, 6)).tolist() == [-1, -1]  # never pulled: probed
