"""psdk.protocol.ids: the sort-based unique and positions are numpy's ``np.unique``, on every path."""

from __future__ import annotations

import numpy as np
import pytest

from psdk.plugins.batches import JaggedIds
from psdk.protocol.ids import unique_positions

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("count", [0, 1, 2, 7, 1000, 26_624])
@pytest.mark.parametrize("high", [3, 10_000_000, 2**62])  # 2**62: too wide to pack with an index, so argsort
def test_they_equal_np_unique(count: int, high: int) -> None:
    ids = np.random.default_rng(count + high % 97).integers(0, high, count)
    unique, inverse = np.unique(ids, return_inverse=True)
    got_unique, positions = unique_positions(ids)
    np.testing.assert_array_equal(got_unique, unique)
    np.testing.assert_array_equal(positions, inverse.reshape(-1))
    assert positions.dtype == np.int64 and got_unique.dtype == ids.dtype


def test_any_shape_and_negative_ids_too() -> None:
    ids = np.array([[5, -3, 5], [-3, 0, 2**40]], np.int64)
    unique, positions = unique_positions(ids)
    np.testing.assert_array_equal(unique, [-3, 0, 5, 2**40])
    np.testing.assert_array_equal(unique[positions], ids.reshape(-1))


def test_a_batchs_ids_sort_once_and_keep_both() -> None:
    values = np.array([9, 2, 9, 4, 2], np.int64)
    ids = JaggedIds(values, np.array([0, 2, 5]))
    np.testing.assert_array_equal(ids.unique(), [2, 4, 9])
    np.testing.assert_array_equal(ids.unique()[ids.positions()], values)
    assert ids.unique() is ids.unique()  # kept, not sorted again
