"""``python -m psdk data``: MNIST found or downloaded and verified, or a message that says how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psdk.data import mnist
from psdk.errors import USAGE_EXIT

from .conftest import REPO, free_port

pytestmark = pytest.mark.timeout(90)


def psdk_data(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m psdk data ...`` with no PSDK_DATA_DIR, so only the arguments say where MNIST is."""
    env = {k: v for k, v in os.environ.items() if k != "PSDK_DATA_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "psdk", "data", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


def test_a_folder_with_the_four_files_is_verified(psdk_mnist_dir: Path) -> None:
    result = psdk_data(f"data.dir={psdk_mnist_dir}")
    assert result.returncode == 0, result.stderr
    assert (
        f"MNIST is in {psdk_mnist_dir}" in result.stdout and "checksums of all four files are verified" in result.stdout
    )
    for stem, md5 in mnist.FILES.values():
        assert f"{stem}.gz" in result.stdout and md5 in result.stdout
    assert f"data.dir={psdk_mnist_dir}" in result.stdout


def test_missing_files_are_downloaded_into_the_cache(local_mirror: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = psdk_data(f"data.cache_dir={cache}", f"data.mirrors=[{local_mirror}]")
    assert result.returncode == 0, result.stderr
    assert f"MNIST is in {cache}" in result.stdout
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{stem}.gz" for stem, _ in mnist.FILES.values())


def test_without_internet_it_says_why_and_where_to_point(tmp_path: Path) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}/"  # nothing listens: as offline as this test can make it
    result = psdk_data(f"data.cache_dir={tmp_path / 'cache'}", f"data.mirrors=[{unreachable}]")
    text = result.stdout + result.stderr
    assert result.returncode == USAGE_EXIT, text
    assert "MNIST could not be downloaded" in text and "No mirror could be reached" in text
    assert "data.dir=" in text and "PSDK_DATA_DIR" in text and unreachable in text
    assert "Traceback" not in text


def test_a_bad_folder_says_so(tmp_path: Path) -> None:
    result = psdk_data(f"data.dir={tmp_path / 'nowhere'}")
    text = result.stdout + result.stderr
    assert result.returncode == USAGE_EXIT and "does not exist" in text and "Traceback" not in text
