"""The CTR workload without a job: the generated log, Criteo TSV parsing, the score, the numpy DLRM's gradients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psdk import ShardRequest
from psdk.errors import ConfigError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.workloads.ctr import workload
from psdk.workloads.ctr.data import (
    DENSE,
    FIELDS,
    TABLE,
    TEST,
    TRAIN,
    ClickLog,
    auc,
    best_auc,
    hash_ids,
    log_loss,
    own_lookups,
    parse_tsv,
)
from psdk.workloads.ctr.model import DlrmSpec, backward, forward
from psdk.workloads.ctr.trainers import NumpyDlrm, bce_with_logits

pytestmark = pytest.mark.timeout(60)

SMALL = ClickLog(seed=3, vocab=10_000, capacity=50_000)


def test_batches_are_the_contracts_and_deterministic():
    batch = SMALL.batch(TRAIN, 7, 5, 64)
    assert batch.inputs["dense"].dtype == np.float32 and batch.inputs["dense"].shape == (64, DENSE)
    cat = batch.inputs["cat"]
    assert cat.dtype == np.int64 and cat.shape == (64, FIELDS)
    assert cat.min() >= 0 and cat.max() < SMALL.capacity
    assert batch.targets.dtype == np.float32 and set(np.unique(batch.targets)) <= {0.0, 1.0}
    ids = batch.ids[TABLE]
    np.testing.assert_array_equal(ids.values, cat.reshape(-1))
    np.testing.assert_array_equal(ids.offsets, np.arange(0, 26 * 64 + 1, 26))
    again = SMALL.batch(TRAIN, 7, 5, 64)
    np.testing.assert_array_equal(again.inputs["cat"], cat)
    np.testing.assert_array_equal(again.inputs["dense"], batch.inputs["dense"])
    np.testing.assert_array_equal(again.targets, batch.targets)
    assert not np.array_equal(SMALL.batch(TRAIN, 7, 6, 64).inputs["cat"], cat)  # the next batch differs
    assert not np.array_equal(SMALL.batch(TRAIN, 8, 5, 64).inputs["cat"], cat)  # another worker's too


def test_a_trainer_takes_a_batchs_own_lookups_only_when_they_are_its_cat_input():
    batch = SMALL.batch(TRAIN, 7, 5, 64)
    cat = batch.inputs["cat"]
    assert own_lookups(batch, cat) is batch.ids[TABLE]  # sorted once per batch, shared with the pull
    assert own_lookups(Batch(batch.inputs, batch.targets), cat) is None  # no ids of the table
    other = cat.copy()
    other[0, 0] = (other[0, 0] + 1) % SMALL.capacity
    assert own_lookups(batch, other) is None  # ids that are not this input's: the trainer sorts its own


def test_each_field_is_zipf_distributed():
    ranks = SMALL.ranks(np.random.default_rng(0), 200_000)
    largest = ranks[:, -1].astype(np.int64)  # the field of 10,000 values
    counts = np.bincount(largest, minlength=SMALL.vocab_sizes()[-1])
    # P(rank r) ~ (r+1)^-1.1: the log of the counts of ranks 1..100 falls with slope about -1.1
    top = np.arange(1, 100)
    slope = np.polyfit(np.log(top + 1), np.log(counts[top]), 1)[0]
    assert -1.3 < slope < -0.9, slope
    assert counts[0] > counts[1] > counts[5] > counts[50]
    assert ranks[:, 0].max() < 10  # the smallest field has 10 values


def test_clicks_the_hidden_model_and_its_auc():
    batch, logits = SMALL.held_out(TEST, 20_000)
    rate = float(batch.targets.mean())
    assert 0.15 < rate < 0.35, rate
    best = best_auc(SMALL, 20_000)
    assert best == pytest.approx(auc(logits, batch.targets), abs=1e-12)
    assert 0.7 < best < 0.95, best
    assert auc(np.zeros(len(batch)), batch.targets) == pytest.approx(0.5, abs=1e-12)
    # the shard's test set reports the same best AUC through the score entry, whatever the predictions
    shard = workload.shard(ShardRequest(0, 2, {}, DlrmSpec(capacity=50_000), {"seed": 3, "vocab": 10_000}, 0))
    scored = workload.score(logits.astype(np.float32), shard.test)
    assert scored["best_auc"] == pytest.approx(best, abs=1e-12)
    assert scored["auc"] == pytest.approx(best, abs=1e-6)
    assert scored["logloss"] == pytest.approx(log_loss(logits, batch.targets), abs=1e-5)


def test_auc_counts_ties_as_halves():
    rng = np.random.default_rng(1)
    scores, labels = rng.integers(0, 4, 300).astype(float), rng.integers(0, 2, 300)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auc(scores, labels) == pytest.approx(pairs, abs=1e-12)


def test_fields_are_salted_apart():
    raw = np.zeros((1, FIELDS), np.uint64)  # value 0 in every field
    assert len(np.unique(hash_ids(raw, 1 << 40))) == FIELDS


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """``n`` Criteo-format lines, some fields empty, as the real log has them."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(int(v)) if rng.random() > 0.2 else "" for v in rng.integers(-1, 500, DENSE)]
        cats = [f"{int(v):08x}" if rng.random() > 0.2 else "" for v in rng.integers(0, 1 << 32, FIELDS)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *ints, *cats]) + "\n")
    return lines


def test_criteo_lines_parse_with_empty_fields():
    line = "\t".join(["1", "3", "", "-1", *["7"] * 10, "68fd1e64", "", *["0a519c5c"] * 24])
    batch = parse_tsv([line.encode(), line.replace("1\t3", "0\t0", 1).encode()], 1000)
    np.testing.assert_array_equal(batch.targets, [1.0, 0.0])
    np.testing.assert_allclose(batch.inputs["dense"][0, :4], np.log1p([3, 0, 0, 7]), atol=1e-6)
    cat = batch.inputs["cat"]
    assert cat.shape == (2, FIELDS) and cat.min() >= 0 and cat.max() < 1000
    np.testing.assert_array_equal(cat[0], cat[1])  # the same values: the same ids
    empty = parse_tsv([("\t" * (DENSE + FIELDS)).encode()], 1 << 40)
    assert empty.targets[0] == 0.0 and not empty.inputs["dense"].any()
    with pytest.raises(ValueError, match="40 tab-separated fields"):
        parse_tsv([b"1\t2\t3"], 1000)


def test_a_folder_of_criteo_files_is_streamed_to_the_workers(tmp_path: Path):
    (tmp_path / "day_0").write_text("".join(criteo_lines(300)))
    (tmp_path / "day_1.tsv").write_text("".join(criteo_lines(100, seed=1)))
    options = {"criteo_dir": str(tmp_path), "test_size": 25}
    shards = [workload.shard(ShardRequest(t, 2, {}, DlrmSpec(capacity=1000), options, 0)) for t in range(2)]
    assert len(shards[0].test) == 25 and shards[0].validation is None
    batches = shards[0].batches(32, 0)
    seen = [next(batches) for _ in range(6)]  # 400 lines: 360 trained on, 180 a worker: 5 batches, then again
    assert all(len(b) == 32 for b in seen) and shards[0].passes == 2
    np.testing.assert_array_equal(seen[5].inputs["cat"], seen[0].inputs["cat"])
    other = next(shards[1].batches(32, 0))
    assert not np.array_equal(other.inputs["cat"], seen[0].inputs["cat"])
    assert "best_auc" not in workload.score(np.zeros(25, np.float32), shards[0].test)
    with pytest.raises(ConfigError, match=r"workload\.criteo_dir: no folder"):
        workload.shard(ShardRequest(0, 1, {}, DlrmSpec(), {"criteo_dir": str(tmp_path / "none")}, 0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no Criteo TSV files"):
        workload.shard(ShardRequest(0, 1, {}, DlrmSpec(), {"criteo_dir": str(tmp_path / "empty")}, 0))


def test_a_model_without_a_table_is_refused():
    from psdk.plugins.models import ModelSpec

    with pytest.raises(ConfigError, match="use model=dlrm"):
        workload.shard(ShardRequest(0, 1, {}, ModelSpec(), {}, 0))


TINY = DlrmSpec(dim=4, capacity=50, bottom=(5,), top=(6,))


def tiny_batch(n: int = 6) -> Batch:
    log = ClickLog(seed=1, vocab=100, capacity=TINY.capacity)
    return log.batch(TRAIN, 0, 0, n)


def loss_of(weights: dict[str, np.ndarray], table: np.ndarray, batch: Batch) -> float:
    cat = batch.inputs["cat"]
    fwd = forward(TINY, weights, batch.inputs["dense"].astype(np.float64), table[cat])
    return bce_with_logits(fwd.logits, batch.targets.astype(np.float64))[0]


def test_dlrm_gradients_match_finite_differences():
    batch = tiny_batch()
    rng = np.random.default_rng(0)
    weights = {k: v.astype(np.float64) + 0.1 * rng.standard_normal(v.shape) for k, v in TINY.init_weights(0).items()}
    table = rng.standard_normal((TINY.capacity, TINY.dim)) * 0.5
    cat = batch.inputs["cat"]
    fwd = forward(TINY, weights, batch.inputs["dense"].astype(np.float64), table[cat])
    y = batch.targets.astype(np.float64)
    d_logits = (1 / (1 + np.exp(-fwd.logits)) - y) / len(y)  # float64: bce_with_logits rounds it to float32
    grads = {k: np.zeros_like(v) for k, v in weights.items()}
    d_rows = backward(TINY, weights, grads, fwd, d_logits)
    eps = 1e-6
    for name in ("bottom0/kernel", "bottom1/bias", "top0/kernel", "top1/kernel", "top1/bias"):
        flat = weights[name].reshape(-1)
        for i in rng.choice(flat.size, min(5, flat.size), replace=False):
            keep = flat[i]
            flat[i] = keep + eps
            up = loss_of(weights, table, batch)
            flat[i] = keep - eps
            down = loss_of(weights, table, batch)
            flat[i] = keep
            assert grads[name].reshape(-1)[i] == pytest.approx((up - down) / (2 * eps), abs=1e-7), name
    summed = np.zeros_like(table)
    np.add.at(summed, cat.reshape(-1), d_rows.reshape(-1, TINY.dim))
    for row in np.unique(cat)[:5]:
        for d in range(TINY.dim):
            keep = table[row, d]
            table[row, d] = keep + eps
            up = loss_of(weights, table, batch)
            table[row, d] = keep - eps
            down = loss_of(weights, table, batch)
            table[row, d] = keep
            assert summed[row, d] == pytest.approx((up - down) / (2 * eps), abs=1e-7)


def test_the_numpy_trainer_on_its_bridge_matches_the_reference():
    batch = tiny_batch(16)
    backend = NumpyBackend()
    trainer = NumpyDlrm(backend)
    weights = TINY.init_weights(0)
    model = trainer.build_model(TINY, weights)
    rows = np.random.default_rng(2).standard_normal((TINY.capacity, TINY.dim)).astype(np.float32)
    ids = np.unique(batch.inputs["cat"])
    backend.write_rows(model, TABLE, ids, rows[ids])
    loss = trainer.forward_backward(model, batch)
    assert loss == pytest.approx(loss_of({k: v.astype(np.float64) for k, v in weights.items()}, rows, batch), abs=1e-5)
    grad_ids, row_grads = backend.read_row_gradients(model, TABLE)
    np.testing.assert_array_equal(grad_ids, batch.inputs["cat"].reshape(-1))
    assert row_grads.shape == (16 * FIELDS, TINY.dim) and np.isfinite(row_grads).all()
    assert np.abs(model.grad_flat).sum() > 0
    logits = trainer.predict(model, batch)
    assert logits.dtype == np.float32 and logits.shape == (16,)
    assert trainer.forward_backward(model, batch) == pytest.approx(loss, abs=1e-6)  # gradients zeroed, not summed
    assert np.isfinite(model.grad_flat).all()
