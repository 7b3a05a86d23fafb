"""Damaged and implausible checkpoints: refused naming the file, skipped by resume and recovery, never kept."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from psdk.client import checkpoint
from psdk.client.recovery import latest_or_none
from psdk.errors import DataError

from .jobs import FAST_FLAGS, psdk

CONFIG = "train:\n  steps: 6000\n"


def good(step: int = 5, **changes: object) -> checkpoint.Checkpoint:
    ckpt = checkpoint.Checkpoint(
        global_step=step,
        variables={"a/kernel": np.ones((2, 3), np.float32), "a/bias": np.zeros(3, np.float32)},
        slots={
            "m": {"a/kernel": np.full((2, 3), 0.5, np.float32), "a/bias": np.ones(3, np.float32)},
            "v": {"a/kernel": np.full((2, 3), 0.1, np.float32), "a/bias": np.ones(3, np.float32)},
        },
        rule={"name": "adam", "lr": 0.1},
        rule_step=step,
        config=CONFIG,
    )
    for name, value in changes.items():
        setattr(ckpt, name, value)
    return ckpt


def written(folder: Path, *steps: int) -> list[Path]:
    return [checkpoint.save(good(step), checkpoint.path_for(folder, step)) for step in steps]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte_of_data(path: Path) -> None:
    """One byte inside a stored array (not the zip's directory): only the CRC can tell."""
    data = bytearray(path.read_bytes())
    offset = data.index(b"\x00\x00\x00?\x00\x00\x00?")  # float32 1.0, 1.0 of a/kernel
    data[offset + 1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_a_byte_of_data], ids=["truncated", "flipped byte"])
def test_a_damaged_file_is_refused_naming_it(tmp_path: Path, damage: object) -> None:
    (path,) = written(tmp_path, 7)
    damage(path)  # type: ignore[operator]
    with pytest.raises(DataError) as caught:
        checkpoint.load(path)
    assert str(path) in str(caught.value) and "cannot be read as a psdk checkpoint" in str(caught.value)


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"global_step": 10**15}, "global step 1000000000000000 is beyond the train.steps=6000"),
        ({"variables": {"a/kernel": np.full((2, 3), np.nan, np.float32), "a/bias": np.zeros(3, np.float32)}},
         "variable a/kernel holds NaN or Inf"),
        ({"slots": {"m": {"a/kernel": np.ones((2, 3), np.float32), "a/bias": np.ones(3, np.float32)},
                    "v": {"a/kernel": np.full((2, 3), np.nan, np.float32), "a/bias": np.ones(3, np.float32)}}},
         "its adam slots are unusable: slot 'v' holds NaN or Inf"),
        ({"slots": {"v": {"a/kernel": -np.ones((2, 3), np.float32), "a/bias": np.ones(3, np.float32)}}},
         "slot 'v' holds negative values"),
        ({"slots": {"m": {"a/kernel": np.ones((3, 2), np.float32), "a/bias": np.ones(3, np.float32)}}},
         "slot m of a/kernel has shape (3, 2)"),
        ({"variables": {"a/kernel": np.ones((2, 3), np.int64), "a/bias": np.zeros(3, np.float32)}},
         "variable a/kernel holds int64, not floats"),
        ({"rule": {"name": "adam", "lr": -1.0}}, "its update rule"),
    ],
    ids=["global step", "nan variable", "nan slot", "negative v", "slot shape", "int variable", "bad rule"],
)  # fmt: skip
def test_an_implausible_checkpoint_is_refused_naming_it_and_why(tmp_path: Path, changes: dict, why: str) -> None:
    path = checkpoint.save(good(**changes), checkpoint.path_for(tmp_path, 9))
    with pytest.raises(DataError) as caught:
        checkpoint.load(path)
    assert str(path) in str(caught.value) and why in str(caught.value)


def test_resume_and_recovery_fall_back_to_the_newest_valid_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    _, middle, newest = written(tmp_path, 100, 200, 300)
    truncate(newest)
    assert checkpoint.load(tmp_path).global_step == 200  # resume=<folder>
    assert f"skipping checkpoint {newest} cannot be read" in caplog.text
    assert f"using {middle.name}, the newest valid checkpoint" in caplog.text
    restored = latest_or_none(tmp_path)  # what the chief restores a lost ps from
    assert restored is not None and restored.global_step == 200
    truncate(middle)
    flip_a_byte_of_data(tmp_path / "ckpt-100.npz")
    with pytest.raises(DataError) as caught:
        checkpoint.load(tmp_path)
    assert "holds no valid checkpoint" in str(caught.value) and "ckpt-100.npz" in str(caught.value)
    assert latest_or_none(tmp_path) is None  # recovery then falls back to the initial state


def test_keep_counts_only_valid_checkpoints(tmp_path: Path) -> None:
    written(tmp_path, 100, 200, 300, 400, 500)
    truncate(tmp_path / "ckpt-500.npz")
    flip_a_byte_of_data(tmp_path / "ckpt-300.npz")
    removed = checkpoint.prune(tmp_path, 2)
    # 400 and 200 are the two newest valid ones; the damaged 500 and 300 stay for a look; 100 goes.
    assert [p.name for p in removed] == ["ckpt-100.npz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-200.npz", "ckpt-300.npz", "ckpt-400.npz",
                                                           "ckpt-500.npz"]  # fmt: skip
    assert checkpoint.load(tmp_path).global_step == 400


def test_the_folder_is_fsynced_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("folder" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    written(tmp_path, 1)
    assert synced == ["file", "folder"]


def test_a_job_resumed_from_a_folder_with_a_truncated_newest_checkpoint_uses_the_one_before(tmp_path: Path) -> None:
    first = psdk(
        "run", "backend=numpy", "train.steps=300", "checkpoint.every_steps=100", *FAST_FLAGS, out=tmp_path / "a"
    )
    assert first.returncode == 0, first.stdout + first.stderr
    folder = tmp_path / "a" / "checkpoints"
    steps = sorted(checkpoint.step_of(p) or 0 for p in folder.glob("ckpt-*.npz"))
    assert len(steps) >= 2 and steps[-1] == 300, steps  # every 100 steps (async: a few past each), and the final
    newest = next(folder.glob("ckpt-*-300.npz"))
    truncate(newest)  # as a crash or a full disk in the middle of a copy leaves it
    second = psdk("run", "backend=numpy", "train.steps=400", f"resume={folder}", *FAST_FLAGS, out=tmp_path / "b")
    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert f"skipping checkpoint {newest} cannot be read" in output
    assert f"resumed from {folder} at global step {steps[-2]}" in output
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["global_step"] == 400 and summary["gradients_applied"] == 400 - steps[-2]


def test_the_chief_checkpoints_by_time_and_keeps_the_newest_valid_ones(tmp_path: Path) -> None:
    job = psdk(
        "run", "backend=numpy", "train.steps=3000", "checkpoint.every_seconds=0.2", "checkpoint.keep=3",
        *FAST_FLAGS, out=tmp_path,
    )  # fmt: skip
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    periodic = [line for line in output.splitlines() if "checkpoint at global step" in line]
    assert len(periodic) >= 3 and all("ms collecting" in line for line in periodic), output  # the final one too
    kept = sorted(checkpoint.step_of(p) or 0 for p in (tmp_path / "checkpoints").glob("ckpt-*.npz"))
    assert len(kept) == 3 and kept[-1] == 3000
