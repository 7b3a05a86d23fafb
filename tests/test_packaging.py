"""psdk installed from a wheel (not editable) still finds its config tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_a_wheel_carries_conf_and_composes_from_it(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("psdk-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "psdk/conf/config.yaml" in names and "psdk/conf/sync/sync.yaml" in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run(
        [sys.executable, "-c", "import psdk.config as c; print(c.config_dir())"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert Path(where.stdout.strip()) == target / "psdk" / "conf"
    composed = subprocess.run(
        [sys.executable, "-m", "psdk", "run", "sync=sync", "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert composed.returncode == 0, composed.stderr
    assert "mode: sync" in composed.stdout
