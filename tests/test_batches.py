"""Batches psdk can read, shards, variable kinds and the trainer's sliced predictions: the workload contracts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psdk
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import ArrayShard, Batch, JaggedIds, take_rows
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Dense, Rows, as_variables, tables_of

pytestmark = pytest.mark.timeout(30)


def jagged(rows: list[list[int]]) -> JaggedIds:
    offsets = np.cumsum([0] + [len(r) for r in rows])
    return JaggedIds(np.array([i for r in rows for i in r], np.int64), offsets.astype(np.int64))


def test_jagged_ids_hold_each_examples_lookups_and_the_distinct_ids() -> None:
    ids = jagged([[3, 1], [], [1, 7, 7]])
    assert ids.rows == 3 and ids.unique().tolist() == [1, 3, 7]
    part = ids.take(1, 3)
    assert part.values.tolist() == [1, 7, 7] and part.offsets.tolist() == [0, 0, 3]
    picked = take_rows(ids, np.array([2, 0]))
    assert picked.values.tolist() == [1, 7, 7, 3, 1] and picked.offsets.tolist() == [0, 3, 5]


@pytest.mark.parametrize(
    ("values", "offsets", "says"),
    [
        ([1, 2], [0, 1], "rise from 0 to the number of values"),
        ([1, 2], [1, 2], "rise from 0"),
        ([1, 2, 3], [0, 2, 1, 3], "rise from 0"),
        ([-1], [0, 1], "never negative"),
        ([0.5], [0, 1], "integer array of values"),
    ],
)
def test_malformed_jagged_ids_are_refused_saying_why(values: list[Any], offsets: list[int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        JaggedIds(np.array(values), np.array(offsets))


def test_a_batch_refuses_inputs_or_ids_that_do_not_match_its_targets() -> None:
    with pytest.raises(ValueError, match="input 'x' has 3 rows, the targets 2"):
        Batch({"x": np.zeros((3, 1))}, np.zeros(2))
    with pytest.raises(ValueError, match="ids of table 'user' cover 1 examples, the targets 2"):
        Batch({}, np.zeros(2), {"user": jagged([[1]])})
    batch = Batch({"x": np.arange(4.0)}, np.arange(4), {"user": jagged([[1], [2, 3], [], [4]])})
    part = batch.take(1, 3)
    assert len(part) == 2 and part.inputs["x"].tolist() == [1.0, 2.0] and part.ids["user"].values.tolist() == [2, 3]


def test_an_array_shard_cuts_shuffled_batches_pass_after_pass_with_their_ids() -> None:
    train = Batch({"x": np.arange(10.0)}, np.arange(10), {"t": jagged([[i] for i in range(10)])})
    shard = ArrayShard(train, test=train)
    batches = shard.batches(3, seed=0)
    first = [next(batches) for _ in range(3)]  # a pass is 3 whole batches of the 10 examples
    seen = np.concatenate([b.targets for b in first])
    assert shard.passes == 1 and len(set(seen.tolist())) == 9 and shard.train_size == 10
    for b in first:
        assert b.inputs["x"].tolist() == b.targets.astype(float).tolist() == b.ids["t"].values.astype(float).tolist()
    next(batches)
    assert shard.passes == 2
    with pytest.raises(ValueError, match="cannot fill a batch of 11"):
        next(ArrayShard(train, test=train).batches(11, seed=0))


def test_variables_have_a_kind_and_tables_are_told_apart() -> None:
    declared = as_variables({"w": (3, 2), "emb": Rows(dim=8, capacity=1000)})
    assert declared["w"] == Dense((3, 2)) and declared["w"].kind == "dense" and declared["emb"].kind == "rows"
    assert tables_of(declared) == {"emb": Rows(dim=8, capacity=1000)}
    assert tables_of(as_variables([("w", (3, 2))])) == {}
    with pytest.raises(ValueError, match="unknown row initializer"):
        Rows(dim=8, capacity=10, initializer="glorot")
    with pytest.raises(ValueError, match="positive dim and capacity"):
        Rows(dim=0, capacity=10)


class Halves(Trainer):
    """Predicts half of each input, counting the slices it is asked for."""

    def __init__(self) -> None:
        super().__init__(NumpyBackend())
        self.sizes: list[int] = []

    def forward_backward(self, model: Any, batch: Batch) -> float:
        return 0.0

    def predict(self, model: Any, batch: Batch) -> np.ndarray:
        self.sizes.append(len(batch))
        return batch.inputs["x"] / 2


def test_predictions_over_a_set_go_a_slice_at_a_time_and_join_in_order() -> None:
    trainer = Halves()
    batch = Batch({"x": np.arange(12.0)}, np.zeros(12))
    np.testing.assert_allclose(trainer.predictions(None, batch, size=5), np.arange(12.0) / 2, rtol=0, atol=0)
    assert trainer.sizes == [5, 5, 2]


def test_the_contracts_are_public_names() -> None:
    assert psdk.Trainer is Trainer and psdk.Batch is Batch and psdk.ArrayShard is ArrayShard
    assert psdk.Rows is Rows and psdk.Dense is Dense and psdk.JaggedIds is JaggedIds
    assert isinstance(psdk.ShardRequest(0, 1, {}, None, {}), psdk.ShardRequest)
