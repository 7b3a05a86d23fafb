"""A job that diverges says so, with the likely cause; async momentum is scaled to the worker count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from psdk.jobs.divergence import DivergenceWatch
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adam

from .jobs import FAST_FLAGS, psdk

pytestmark = pytest.mark.timeout(120)


def watch(workers: int = 8, mode: str = "async") -> DivergenceWatch:
    return DivergenceWatch(target_steps=1000, num_workers=workers, lr=0.1, momentum=0.9, mode=mode)


def test_a_non_finite_loss_is_divergence_at_once_naming_the_cause() -> None:
    w = watch()
    assert w.observe(2.3, 1) is None
    verdict = w.observe(math.nan, 2)
    assert verdict is not None and verdict["global_step"] == 2 and "nan" in verdict["what"]
    assert "8 async workers" in verdict["cause"] and "1 - 1/8 = 0.88" in verdict["cause"]
    assert "optimizer.lr (now 0.1)" in w.message()
    assert w.observe(math.inf, 3) is None  # reported once


def test_a_loss_still_at_its_start_after_a_tenth_of_the_job_is_divergence() -> None:
    stuck, learning = watch(), watch()
    for step in range(1, 200):
        assert stuck.observe(2.3026, step) is None or step >= 100
        learning.observe(2.3 * 0.99**step, step)
    assert stuck.verdict is not None and stuck.verdict["global_step"] == 100
    assert "still at or above its starting level" in stuck.verdict["what"]
    assert learning.verdict is None


def test_a_job_joined_late_is_judged_only_by_a_non_finite_loss() -> None:
    """A job resumed at half its steps (or a restarted worker) starts from a trained model's low loss.

    `run train.steps=6000 resume=<a 3000-step run>` was reported DIVERGED at step 3144: its loss, 0.05
    from the start, had not fallen by 2%.
    """
    resumed = watch()
    for step in range(500, 700):
        assert resumed.observe(0.05, step) is None
    assert resumed.observe(math.nan, 700) is not None


def test_a_worker_that_starts_past_a_twentieth_of_the_job_is_not_judged_by_its_start() -> None:
    """With 8 workers on a busy host one started late: its first losses were the partly trained model's."""
    late, early = watch(), watch()
    for step in range(60, 260):
        assert late.observe(0.3, step) is None
    for step in range(49, 260):
        early.observe(0.3, step)
    assert early.verdict is not None  # a twentieth in, a flat loss is still a stalled job


def test_sync_mode_and_two_workers_name_the_step_size_not_asynchrony() -> None:
    assert "async" not in watch(mode="sync").likely_cause()
    assert "async" not in watch(workers=2).likely_cause()


def test_momentum_is_scaled_for_more_than_two_async_workers_only() -> None:
    rule = SGD(lr=0.1, momentum=0.9, nesterov=True)
    scaled = SyncSpec("async").rule_for(rule, 8)
    assert isinstance(scaled, SGD) and scaled.momentum == pytest.approx(0.9**7, rel=1e-12, abs=1e-12)
    assert scaled.nesterov and scaled.lr == 0.1
    assert SyncSpec("async").rule_for(rule, 2) is rule and SyncSpec("async").rule_for(rule, 1) is rule
    assert SyncSpec("sync", 8).resolved(8).rule_for(rule, 8) is rule  # rounds add no momentum
    assert SyncSpec("async", scale_momentum=False).rule_for(rule, 8) is rule
    assert SyncSpec("async").rule_for(SGD(lr=0.1), 8) == SGD(lr=0.1)  # no momentum to scale
    assert SyncSpec("async").rule_for(Adam(lr=0.01), 8) == Adam(lr=0.01)


def test_a_job_whose_loss_goes_nan_ends_saying_so_in_its_log_and_summary(tmp_path: Path) -> None:
    result = psdk(
        "run", "backend=numpy", "optimizer=sgd", "optimizer.lr=1e9", "train.steps=2000", "train.validate_every=0",
        *FAST_FLAGS, out=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["divergence"] is not None and summary["global_step"] < 2000
    assert "training diverged at global step" in output and "lower optimizer.lr (now 1e+09)" in output
    assert "the loss became nan" in output
    assert "DIVERGED at global step" in output
