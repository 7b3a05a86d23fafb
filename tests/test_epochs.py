"""``train.epochs``: one pass over the training set by the job as a whole, and the global steps it makes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from psdk.config import config_dir, prepare_hydra
from psdk.config.check import OverrideChecker
from psdk.config.options import TrainOptions
from psdk.errors import ConfigError
from psdk.jobs.epochs import EpochCount, batches_per_step, resolve_steps, shard_sizes
from psdk.ps.consistency import SyncSpec

from .jobs import FAST_FLAGS, psdk

pytestmark = pytest.mark.timeout(60)


def composed(*overrides: str):  # type: ignore[no-untyped-def]
    prepare_hydra()
    return OverrideChecker(config_dir()).composed(list(overrides))


def test_shards_are_cut_as_the_workers_cut_them() -> None:
    for size, workers in [(55000, 3), (55000, 2), (59999, 7), (10, 4)]:
        expected = [len(part) for part in np.array_split(np.arange(size), workers)]
        assert shard_sizes(size, workers) == expected


def test_an_epoch_is_every_workers_batches_of_its_shard_once() -> None:
    count = EpochCount.of_job(55000, 3, 100)
    assert count.batches_per_epoch == 3 * 183  # 18,334 and 18,333 images a shard: 183 whole batches each
    assert count.steps_for(1) == 549 and count.at_step(549) == pytest.approx(1.0)
    # The TF1 program: each of 3 workers 50 times over the whole set, 82,500 global steps: here 150 epochs.
    assert count.steps_for(150) == 82350
    assert abs(count.steps_for(150) - 82500) / 82500 < 0.002


def test_a_sync_step_uses_replicas_to_aggregate_batches() -> None:
    assert batches_per_step(SyncSpec("async"), 3) == 1
    assert batches_per_step(SyncSpec("ssp", staleness=2), 3) == 1
    assert batches_per_step(SyncSpec("sync"), 3) == 3  # null: every worker
    assert batches_per_step(SyncSpec("sync", replicas_to_aggregate=2), 3) == 2  # one backup worker
    count = EpochCount.of_job(55000, 2, 100, batches_per_step=2)
    assert count.steps_for(1) == 275 and count.at_step(275) == pytest.approx(1.0)
    assert count.steps_for(0.25) == math.ceil(0.25 * 550 / 2)


def test_steps_round_up_to_whole_steps_and_never_to_none() -> None:
    count = EpochCount.of_job(55000, 2, 100)
    assert count.steps_for(3 / 550) == 3  # exactly 3 batches: no step more for a float's last bit
    assert count.steps_for(1e-6) == 1
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        EpochCount.of_job(10, 4, 5)  # shards of 3 and 2 images: no whole batch of 5


def test_epochs_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs: must be a positive number or null, got 0"):
        TrainOptions(epochs=0)
    assert TrainOptions(epochs=0.5).epochs == 0.5 and TrainOptions().epochs is None


def test_the_launcher_sets_train_steps_from_epochs_and_what_reads_steps_follows() -> None:
    cfg = composed("train.epochs=3", "sync=sync", "topology.num_workers=3")
    assert resolve_steps(cfg) == 549 and cfg.train.steps == 549
    assert cfg.optimizer.decay_steps == 549  # the default schedule runs over the job's steps
    assert cfg.optimizer.warmup_steps == 55  # and warms up over a tenth of them
    cfg = composed("train.epochs=1", "topology.num_workers=2", "data.validation_size=0", "train.batch_size=50")
    assert resolve_steps(cfg) == 1200  # async: a step a batch; 60,000 images in 1,200 batches of 50
    cfg = composed("train.steps=77")
    assert resolve_steps(cfg) is None and cfg.train.steps == 77


def test_a_worker_counts_the_workers_of_its_cluster() -> None:
    cfg = composed("job_name=worker", "ps_hosts=127.0.0.1:1", "worker_hosts=[a:1,b:2,c:3,d:4]", "train.epochs=2")
    assert resolve_steps(cfg) == EpochCount.of_job(55000, 4, 100).steps_for(2) == 2 * 4 * 137


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_run_by_epochs_counts_them_the_same_in_logs_metrics_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = psdk(
        "run", "backend=numpy", "sync=sync", "train.epochs=0.25", "progress.mode=off", *FAST_FLAGS, out=out, timeout=100
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = math.ceil(0.25 * 550 / 2)  # 2 workers, 275 batches a shard; a sync step uses 2 batches
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == summary["global_step"] == steps and summary["train_epochs"] == 0.25
    assert summary["batches_per_epoch"] == 550
    assert summary["epochs"] == pytest.approx(steps * 2 / 550, abs=1e-4)
    for worker in summary["workers"].values():
        assert "epochs" not in worker and worker["shard_passes"] == 1
    assert f"steps: {steps}" in (out / "config.yaml").read_text()
    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert points and all(p["epoch"] == pytest.approx(p["global_step"] * 2 / 550, abs=1e-4) for p in points)
    assert f"launcher: train.epochs=0.25 is {steps} global steps" in done.stdout
    last = f"worker 0: epoch {steps * 2 / 550:.2f}/0.25, global step {steps},"
    assert last in done.stdout, done.stdout


def test_each_split_knows_the_training_set_an_epoch_passes_over() -> None:
    from psdk.data import mnist

    images, labels = np.zeros((1003, 4), np.uint8), np.zeros(1003, np.int64)
    data = mnist.Mnist(train_x=images, train_y=labels, test_x=images[:5], test_y=labels[:5])
    splits = [mnist.split(data, w, 3, 100) for w in range(3)]
    assert [len(s.train_images) for s in splits] == shard_sizes(903, 3)
    assert all(s.train_size == 903 for s in splits)
