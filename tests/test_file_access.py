"""What psdk writes on a shared host is its owner's alone, unless file_access widens it (docs/security.md)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from psdk.runtime import access

from .jobs import FAST_FLAGS, psdk

pytestmark = pytest.mark.timeout(180)


def modes(folder: Path) -> dict[str, int]:
    """Every file and folder psdk wrote under ``folder`` (the folder too), with its permission bits."""
    found = {str(p.relative_to(folder.parent)): stat.S_IMODE(p.lstat().st_mode) for p in folder.rglob("*")}
    return {folder.name: stat.S_IMODE(folder.stat().st_mode), **found}


@pytest.mark.parametrize(("setting", "forbidden"), [([], 0o077), (["file_access=group"], 0o027)])
def test_a_run_folder_and_everything_in_it_is_the_owners_alone(
    tmp_path: Path, setting: list[str], forbidden: int
) -> None:
    out = tmp_path / "run"
    result = psdk(
        "run", "backend=numpy", "train.steps=60", "checkpoint.every_steps=30", "checkpoint.every_seconds=0",
        "report.tensorboard=true", *setting, *FAST_FLAGS, out=out,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    written = modes(out)
    assert {"run/params.npz", "run/summary.json", "run/metrics.jsonl", "run/checkpoints"} <= set(written)
    assert any(name.startswith("run/tensorboard/") and "events" in name for name in written), sorted(written)
    exposed = {name: f"{mode:04o}" for name, mode in written.items() if mode & forbidden}
    assert not exposed
    if setting:  # widened: the group reads what was written
        assert written["run/params.npz"] & stat.S_IRGRP and written["run"] & stat.S_IXGRP


def test_an_unknown_file_access_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    result = psdk("run", "backend=numpy", "file_access=everyone", out=tmp_path / "run")
    assert result.returncode == 2
    assert "file_access: must be one of owner, group, all, got 'everyone'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_setting_is_read_from_the_command_line_as_any_override() -> None:
    assert access.from_args(["backend=numpy", "file_access=all"]) == "all"
    assert access.from_args(["--file_access=group"]) == "group"
    assert access.from_args(["train.steps=5"]) == "owner"
    assert access.umask_for("owner") == 0o077
