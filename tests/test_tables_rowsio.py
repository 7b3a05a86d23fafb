"""The table's fast paths (``psdk/protocol/rowsio.py``, ``RowIndex._probe``) agree with plain numpy and a dict."""

from __future__ import annotations

import numpy as np
import pytest

from psdk.protocol.rowsio import put_rows, take_rows
from psdk.ps.tables.index import EMPTY, PROBE_TAIL, RowIndex

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((50, 16), np.float32), ((50, 3), np.float32), ((50,), np.uint32), ((50, 2, 3), np.float32)]
)
def test_take_and_put_rows_match_fancy_indexing(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(0)
    array = rng.integers(0, 1000, shape).astype(dtype)
    expected = array.copy()
    for slots in (np.array([7, 3, 49, 0], np.int32), np.array([5], np.intp), np.zeros(0, np.int64)):
        np.testing.assert_array_equal(take_rows(array, slots), expected[slots])
        values = rng.integers(0, 1000, (len(slots), *shape[1:])).astype(np.float64)
        strided = np.asfortranarray(values)  # not C-contiguous: copied, and cast as assignment would
        put_rows(array, slots, strided)
        expected[slots] = values
        np.testing.assert_array_equal(array, expected)
        put_rows(array, slots, 11)  # a scalar for every slot
        expected[slots] = 11
        np.testing.assert_array_equal(array, expected)
    np.testing.assert_array_equal(take_rows(array, np.array([1, 1, -1])), expected[[1, 1, -1]])
    with pytest.raises(ValueError, match="cannot write"):
        put_rows(array, np.array([1, 2]), np.zeros((3, *shape[1:]), dtype))


def test_put_rows_into_a_non_contiguous_array_writes_the_same() -> None:
    base = np.zeros((10, 8), np.float32)
    view = base[:, ::2]
    put_rows(view, np.array([2, 4]), np.ones((2, 4), np.float32))
    assert base.sum() == 8 and base[2, ::2].tolist() == [1, 1, 1, 1] and base[2, 1] == 0


def test_the_probe_agrees_with_a_dict_through_inserts_and_removals() -> None:
    """Long chains (45% load, tombstones) and batches above and below the Python tail's size."""
    rng = np.random.default_rng(5)
    index = RowIndex(30_000)
    held: dict[int, int] = {}
    for step in range(40):
        batch = np.unique(rng.integers(0, 60_000, int(rng.choice([5, PROBE_TAIL + 3, 900]))))
        slots, ends = index.find_with_ends(batch)
        assert slots.tolist() == [held.get(int(i), -1) for i in batch]
        absent = slots < 0
        assert (index._positions[ends[absent]] == EMPTY).all()  # where an insert may place them
        if absent.any() and index.room >= int(absent.sum()):
            new = index.insert_absent(batch[absent], ends[absent], index.rebuilds)
            held.update(zip(batch[absent].tolist(), new.tolist(), strict=True))
        if step % 3 == 2:
            gone = rng.choice(sorted(held), size=len(held) // 4, replace=False)
            index.remove_slots(np.array([held.pop(int(i)) for i in gone], np.int32))
    everything = np.array(sorted(held), np.int64)
    assert index.find(everything).tolist() == [held[int(i)] for i in everything]
    assert len(index) == len(held)
