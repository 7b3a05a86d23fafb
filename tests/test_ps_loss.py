"""A ps lost at any moment (training, a checkpoint, the wrap-up) is restored from this run's newest checkpoint.

Each fault is injected at measured progress inside the ps (a failpoint: its
n-th update, its n-th checkpoint state, the chief's finish at the job's end);
the launcher restarts the ps and the chief restores it. The job must exit 0
with its ``summary.json``, losing at most the steps since the last checkpoint,
and keep every worker's finished state and report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from psdk.runtime.failpoints import FAILPOINT_ENV, PS_STATE, PS_UPDATE, PS_WRAP_UP

from .jobs import FAST_FLAGS, all_tasks_gone, start

pytestmark = pytest.mark.timeout(240)

FLAGS = ["run", "backend=numpy", "train.steps=1000", "train.validate_every=0", "checkpoint.every_steps=200",
         "checkpoint.every_seconds=0", *FAST_FLAGS]  # fmt: skip


def run_losing_the_ps(tmp_path: Path, failpoint: str) -> dict[str, Any]:
    marker = tmp_path / "fired"
    out = tmp_path / "run"
    job = start(*FLAGS, out=out, extra_env={FAILPOINT_ENV: f"{failpoint}:{marker}"})
    try:
        output = job.communicate(timeout=200)[0]
    finally:
        job.kill()
    assert marker.exists(), f"the ps never reached {failpoint}:\n{output}"
    assert job.returncode == 0, output
    assert all_tasks_gone(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"ps 0": 1} and summary["global_step"] == 1000
    assert summary["workers"]["1"]["status"] == "finished" and summary["workers"]["1"]["local_steps"] > 0
    (recovery,) = summary["recoveries"]
    assert recovery["lost_steps"] == summary["global_steps_lost"]
    return summary


def test_a_ps_lost_mid_training_costs_at_most_the_steps_since_the_last_checkpoint(tmp_path: Path) -> None:
    summary = run_losing_the_ps(tmp_path, f"{PS_UPDATE}@700")
    (recovery,) = summary["recoveries"]
    assert 600 <= recovery["global_step"] < 700 and recovery["lost_steps"] <= 100


def test_a_ps_lost_during_a_checkpoint_is_restored_from_the_one_before(tmp_path: Path) -> None:
    summary = run_losing_the_ps(tmp_path, f"{PS_STATE}@3")  # the third cut: at about step 600
    (recovery,) = summary["recoveries"]
    assert 400 <= recovery["global_step"] < 600 and recovery["lost_steps"] <= 250
    assert "during a checkpoint" in recovery["why"]


def test_a_ps_lost_after_training_before_the_shutdown_loses_nothing(tmp_path: Path) -> None:
    """Before: the chief exited 1, its restart re-initialised the ps from the seed, trained again and waited
    120 s for worker 1, which had finished and gone; no summary.json."""
    summary = run_losing_the_ps(tmp_path, PS_WRAP_UP)
    (recovery,) = summary["recoveries"]
    assert recovery["global_step"] == 1000 and recovery["lost_steps"] == 0  # the final checkpoint came first
    assert summary["workers"]["1"]["gradients_pushed"] > 0  # worker 1's report survived the ps
