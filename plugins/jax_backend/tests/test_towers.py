"""Towers on JAX: CPU replicas are JAX CPU devices, asked for before JAX starts; the arithmetic, then jobs.

Each equivalence check runs in a fresh interpreter (:mod:`psdk.testing.towers`):
this test process has usually started JAX with one CPU device already.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from psdk.testing.towers import compare_in_subprocess, towers_beside_one_without, two_towers_against_one

JOB_TIMEOUT_S = 110
"""A job trains for seconds and starts for 10-30 s (a loaded 2-core host: 30); two at once, as long."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("size", "count"), [(33, 2), (10, 3)])
def test_replicas_on_slices_equal_one_device_on_the_whole_batch(size: int, count: int) -> None:
    result = compare_in_subprocess("jax", size, count)
    assert result["devices"] == [f"cpu:{k}" for k in range(count)]
    assert abs(result["tower_loss"] - result["loss"]) <= 1e-6 + 1e-5 * abs(result["loss"])
    assert result["max_gradient_gap"] <= 1e-6 + 1e-5 * result["largest_gradient"]


@pytest.mark.timeout(30)
def test_towers_are_refused_by_name_once_jax_started_with_fewer_cpu_devices() -> None:
    import jax

    from psdk.errors import ConfigError
    from psdk.plugins.loading import load_backend

    have = len(jax.devices("cpu"))  # starts JAX here, if nothing had
    with pytest.raises(ConfigError, match=r"placement\.towers.*xla_force_host_platform_device_count"):
        load_backend("jax").setup_towers([f"cpu:{k}" for k in range(have + 1)])


@pytest.mark.timeout(JOB_TIMEOUT_S + 10)
def test_a_job_with_two_towers_trains_as_the_default_job(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """One worker, sync, the same seed: the same batches, so the same parameters up to float rounding."""
    summaries = two_towers_against_one("jax", tmp_path, psdk_mnist_dir, JOB_TIMEOUT_S)
    assert summaries["t2"]["workers"]["0"]["devices"] == ["cpu:0", "cpu:1"]
    assert summaries["t1"]["test_accuracy"] == pytest.approx(summaries["t2"]["test_accuracy"], abs=0.002)


@pytest.mark.timeout(JOB_TIMEOUT_S + 10)
def test_an_async_worker_with_towers_beside_one_without(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    towers_beside_one_without("jax", "async", tmp_path, psdk_mnist_dir, JOB_TIMEOUT_S)
