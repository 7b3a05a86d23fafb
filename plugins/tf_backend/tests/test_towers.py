"""Towers on TensorFlow: CPU replicas are logical CPU devices, made before its runtime starts; arithmetic, a job.

Each equivalence check runs in a fresh interpreter (:mod:`psdk.testing.towers`):
this test process has usually started TensorFlow's runtime already.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from psdk.testing.towers import compare_in_subprocess, towers_beside_one_without

JOB_TIMEOUT_S = 200
"""A job trains for seconds and starts for 10-30 s; on a 2-core host at load 30, TensorFlow's took 2 minutes."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("size", "count"), [(33, 2), (10, 3)])
def test_replicas_on_slices_equal_one_device_on_the_whole_batch(size: int, count: int) -> None:
    result = compare_in_subprocess("tf", size, count)
    assert result["devices"] == [f"cpu:{k}" for k in range(count)]
    assert abs(result["tower_loss"] - result["loss"]) <= 1e-6 + 1e-5 * abs(result["loss"])
    assert result["max_gradient_gap"] <= 1e-6 + 1e-5 * result["largest_gradient"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 10)
def test_a_sync_worker_with_towers_beside_one_without(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    towers_beside_one_without("tf", "sync", tmp_path, psdk_mnist_dir, JOB_TIMEOUT_S)
