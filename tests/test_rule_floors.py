"""Adagrad in TensorFlow 1.x's configuration (eps=0, an initial accumulator) is proven finite without a backup.

With ``eps=0`` the only thing keeping Adagrad's denominator from zero is
the accumulator, which starts at ``initial_accumulator_value`` and only
grows. The store measures its smallest value with its bounds
(``UpdateRule.slot_floors``), so an apply skips the backup-and-check path
(copies of the whole shard) while that floor is large enough, and falls
back to it when a checkpoint brings smaller sums.
"""

from __future__ import annotations

import numpy as np
import pytest

from psdk.errors import NonFiniteError
from psdk.protocol.numerics import magnitude
from psdk.ps.rules import Adagrad, floor_key
from psdk.ps.store import FlatStore, RestoreState

pytestmark = pytest.mark.timeout(60)

SIZE = 257
TF1 = Adagrad(lr=0.3, initial_accumulator_value=0.1, eps=0.0)


def gradients(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(count)]


def test_tf1_adagrad_takes_no_checked_applies_and_follows_its_formula() -> None:
    store = FlatStore()
    start = np.linspace(-1, 1, SIZE, dtype=np.float32)
    store.initialize({"w": start}, TF1)
    p, acc = start.astype(np.float64), np.full(SIZE, np.float32(0.1), np.float64)
    for grad in gradients(200):
        store.apply(grad, magnitude(grad))
        acc += grad.astype(np.float64) ** 2
        p -= 0.3 * grad / np.sqrt(acc)  # tf.compat.v1.train.AdagradOptimizer: no epsilon
    assert store.checked_applies == 0 and store.version == 200
    np.testing.assert_allclose(store.params(), p, rtol=1e-4, atol=1e-5)
    assert store._bounds is not None and store._bounds[1][floor_key("sum")] == pytest.approx(0.1)


def test_without_an_initial_accumulator_the_first_apply_is_checked_and_its_sums_prove_the_rest() -> None:
    """From 0 (torch's start) with eps=0 nothing bounds the first denominator; the sums it leaves are measured."""
    store = FlatStore()
    store.initialize({"w": np.zeros(SIZE, np.float32)}, Adagrad(lr=0.3, eps=0.0))
    for grad in gradients(5):
        store.apply(grad, magnitude(grad))
    assert store.checked_applies == 1 and store.version == 5


def test_an_overflow_is_still_refused_and_changes_nothing() -> None:
    store = FlatStore()
    store.initialize({"w": np.ones(SIZE, np.float32)}, TF1)
    huge = np.full(SIZE, 3e37, np.float32)  # its square overflows the accumulator
    with pytest.raises(NonFiniteError, match="refused, store unchanged"):
        store.apply(huge, magnitude(huge))
    assert store.checked_applies == 1 and store.version == 0
    np.testing.assert_array_equal(store.params(), np.ones(SIZE, np.float32))
    np.testing.assert_array_equal(store.slots()["sum"], np.full(SIZE, 0.1, np.float32))
    grad = gradients(1)[0]
    store.apply(grad, magnitude(grad))  # the floor still holds: back on the cheap path
    assert store.checked_applies == 1 and store.version == 1


def restored(sums: np.ndarray) -> RestoreState:
    return RestoreState(7, 7, {"sum": {"w": sums}})


def test_a_checkpoint_with_smaller_sums_falls_back_to_the_checked_path() -> None:
    """Sums below the initial value (another rule's checkpoint) lower the floor; a zero sum leaves only the check."""
    sums = np.full(SIZE, 0.1, np.float32)
    sums[3] = 0.0
    store = FlatStore()
    store.initialize({"w": np.zeros(SIZE, np.float32)}, TF1, restored(sums))
    grad = gradients(1)[0]
    grad[3] = 0.0  # 0 / sqrt(0): NaN, which only the check catches
    with pytest.raises(NonFiniteError):
        store.apply(grad, magnitude(grad))
    assert store.checked_applies == 1 and store.version == 7
    grad[3] = 1.0
    store.apply(grad, magnitude(grad))
    assert store.checked_applies == 2 and store.version == 8  # measured again: sum[3] is 1 now
    store.apply(grad, magnitude(grad))
    assert store.checked_applies == 2 and store.version == 9  # and that floor proves the next apply


def test_a_rollback_to_smaller_sums_lowers_the_floor_too() -> None:
    store = FlatStore()
    store.initialize({"w": np.zeros(SIZE, np.float32)}, TF1)
    grad = gradients(1)[0]
    store.apply(grad, magnitude(grad))
    assert store.checked_applies == 0
    store.reset({"w": np.zeros(SIZE, np.float32)}, restored(np.zeros(SIZE, np.float32)))
    store.apply(grad, magnitude(grad))
    assert store.checked_applies == 1
