"""Checkpoints belong to their run: a folder shared by runs never restores, prunes or overwrites another's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from psdk.client import checkpoint
from psdk.errors import ConfigError, DataError
from psdk.protocol.jobspec import check_run_id
from psdk.runtime.failpoints import FAILPOINT_ENV

from .jobs import FAST_FLAGS, psdk, start

pytestmark = pytest.mark.timeout(300)


def saved(folder: Path, run: str | None, *steps: int) -> list[Path]:
    paths = []
    for step in steps:
        state = checkpoint.Checkpoint(step, {"w": np.full(3, float(step), np.float32)}, run_id=run)
        paths.append(checkpoint.save(state, checkpoint.path_for(folder, step, run)))
    return paths


def test_a_checkpoint_carries_its_run_in_its_name_and_its_record(tmp_path: Path) -> None:
    (path,) = saved(tmp_path, "20261127-101010-abc123", 40)
    assert path.name == "ckpt-20261127-101010-abc123-40.npz" and checkpoint.step_of(path) == 40
    loaded = checkpoint.load(path)
    assert (loaded.run_id, loaded.global_step) == ("20261127-101010-abc123", 40)
    with pytest.raises(ConfigError, match="run_id"):
        check_run_id("../../etc")


def test_recovery_and_pruning_take_only_their_own_runs_files(tmp_path: Path) -> None:
    theirs = saved(tmp_path, "run-a", 200, 400, 600, 800, 1000)
    legacy = saved(tmp_path, None, 5000)
    mine = saved(tmp_path, "run-b", 200, 400, 600)
    found, _ = checkpoint.latest_valid(tmp_path, "run-b")
    assert found is not None and (found.run_id, found.global_step) == ("run-b", 600)
    assert checkpoint.prune(tmp_path, 2, "run-b") == [mine[0]]
    assert all(p.exists() for p in theirs + legacy + mine[1:])
    assert checkpoint.latest_valid(tmp_path, "run-c")[0] is None  # a new run finds none of the others'


def test_resume_from_a_folder_of_several_runs_is_refused_listing_them(tmp_path: Path) -> None:
    saved(tmp_path, "run-a", 100, 1000)
    saved(tmp_path, "run-b", 600)
    with pytest.raises(DataError) as refused:
        checkpoint.load(tmp_path)
    text = str(refused.value)
    assert "holds the checkpoints of 2 runs" in text and "run run-a" in text and "run run-b" in text
    assert "ckpt-run-a-1000.npz" in text and "name the file" in text
    assert checkpoint.load(tmp_path / "ckpt-run-b-600.npz").global_step == 600  # named: taken
    one = tmp_path / "one"
    saved(one, "run-c", 7, 9)
    assert checkpoint.load(one).global_step == 9  # one run's folder: its newest


def test_the_command_refuses_a_resume_folder_of_several_runs_with_exit_2(tmp_path: Path) -> None:
    saved(tmp_path / "mixed", "run-a", 100)
    saved(tmp_path / "mixed", "run-b", 200)
    result = psdk("run", "backend=numpy", f"resume={tmp_path / 'mixed'}", *FAST_FLAGS, out=tmp_path / "run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "holds the checkpoints of 2 runs" in result.stdout + result.stderr


def test_a_run_folder_used_three_times_restores_only_its_own_run(tmp_path: Path) -> None:
    """The issue's operator: runs A (1000 steps), B and C (600) in one folder; C's ps is killed at step 300+.

    Before run ids, B's final checkpoint was pruned as it was written (A's ranked higher) and C restored
    A's step-1000 checkpoint, exiting 0 at global step 1000 with "0 global steps lost".
    """
    out = tmp_path / "run"
    flags = ["backend=numpy", "train.validate_every=0", "checkpoint.every_steps=200", "checkpoint.every_seconds=0",
             "checkpoint.keep=2", *FAST_FLAGS]  # fmt: skip
    first = psdk("run", "train.steps=1000", *flags, out=out)
    assert first.returncode == 0, first.stdout + first.stderr
    a_files = sorted((out / "checkpoints").glob("ckpt-*.npz"))
    second = psdk("run", "train.steps=600", *flags, out=out)
    assert second.returncode == 0, second.stdout + second.stderr
    b_run = json.loads((out / "summary.json").read_text())["run_id"]
    assert list((out / "checkpoints").glob(f"ckpt-{b_run}-600.npz")), "run B's final checkpoint was pruned"
    assert all(p.exists() for p in a_files), "run B pruned run A's checkpoints"

    marker = tmp_path / "killed"
    job = start("run", "train.steps=600", *flags, out=out, extra_env={FAILPOINT_ENV: f"ps.update@330:{marker}"})
    try:
        output = job.communicate(timeout=180)[0]
    finally:
        job.kill()
    assert job.returncode == 0 and marker.exists(), output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 600 and summary["run_id"] not in (b_run, None)
    (recovery,) = summary["recoveries"]
    # Restored from run C's own checkpoint at ~200 (async: a few steps past it), not run A's at 1000.
    assert 200 <= recovery["global_step"] < 330 and recovery["lost_steps"] == summary["global_steps_lost"] <= 130
    assert "a lost ps restored 1x" in output  # the job's last line says so
    assert all(p.exists() for p in a_files)
