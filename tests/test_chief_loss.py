"""A chief killed at the worst moments: mid-checkpoint, and after training but before its results."""

from __future__ import annotations

import json
from pathlib import Path

from psdk.runtime.failpoints import CHECKPOINT_PAUSED, FAILPOINT_ENV, TRAINED

from .jobs import FAST_FLAGS, all_tasks_gone, start


def run_killing_the_chief_at(point: str, tmp_path: Path, *flags: str) -> tuple[int, str]:
    """The job, whose chief SIGKILLs itself the first time it reaches ``point`` (the launcher restarts it)."""
    marker = tmp_path / "failpoint-fired"
    job = start(*flags, *FAST_FLAGS, out=tmp_path / "run", extra_env={FAILPOINT_ENV: f"{point}:{marker}"})
    try:
        output = job.communicate(timeout=150)[0]
    finally:
        job.kill()
    assert marker.exists(), f"the chief never reached {point}:\n{output}"
    return job.returncode, output


def test_a_chief_killed_between_pause_and_resume_comes_back_and_the_job_finishes(tmp_path: Path) -> None:
    """Before the lease, the shards stayed paused for good and every push waited out the request timeout."""
    code, output = run_killing_the_chief_at(
        CHECKPOINT_PAUSED,
        tmp_path,
        "run",
        "backend=numpy",
        "train.steps=3000",
        "train.validate_every=0",
        "checkpoint.every_steps=1000",
    )
    assert code == 0, output
    assert "the checkpoint pause at version" in output and "ends, training goes on" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["restarts"] == {"worker 0": 1} and summary["global_step"] == 3000
    assert summary["workers"]["1"]["status"] == "finished"
    assert all_tasks_gone(tmp_path / "run")


def test_a_chief_killed_after_training_comes_back_and_writes_the_results(tmp_path: Path) -> None:
    code, output = run_killing_the_chief_at(
        TRAINED, tmp_path, "run", "backend=numpy", "train.steps=1000", "train.validate_every=0"
    )
    assert code == 0, output
    assert "worker 0 is back on a new connection" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["restarts"] == {"worker 0": 1} and summary["global_step"] == 1000
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*-1000.npz"))
    assert all_tasks_gone(tmp_path / "run")
