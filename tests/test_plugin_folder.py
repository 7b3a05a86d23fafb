"""A plugin's folder works on its own: copied out of this repository, its tests still pass.

A plugin author starts by copying ``plugins/torch_backend``; if its tests
found MNIST, a ps or the repository through paths relative to this checkout
(``Path(__file__).parents[3]``, ``cwd=REPO``), the copy would fail far from
here. So the folder, and nothing else, is copied to a scratch directory, and
pytest runs there in a subprocess: the copy's package first on the path (so
the copy's code is what runs), MNIST given only by ``PSDK_DATA_DIR``, psdk's
fixtures from its pytest plugin. The end-to-end jobs are left out for time;
everything else, the tests that use MNIST included, runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "torch_backend"
LEFT_OUT = ("tests/test_job.py", "tests/test_mixed.py")
"""Whole MNIST jobs: minutes of CPU, and they go through the same fixtures as the tests that run."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.timeout(600),
]


def copied_out(tmp_path: Path) -> Path:
    copy = tmp_path / "torch_backend"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info", "build", "dist")
    shutil.copytree(PLUGIN, copy, ignore=junk)
    return copy


def environment(copy: Path, psdk_mnist_dir: Path) -> dict[str, str]:
    """This environment, less any path into the repository's plugin folder, with the copy first and MNIST set."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in inherited if not Path(p).resolve().is_relative_to(PLUGIN)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), *kept]), PSDK_DATA_DIR=str(psdk_mnist_dir))
    env.pop("PSDK_TEST_DATA_DIR", None)  # this repository's own variable must not help the copy
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def test_the_torch_plugin_folder_passes_its_tests_when_copied_out(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    copy = copied_out(tmp_path)
    env = environment(copy, psdk_mnist_dir)
    where = subprocess.run(
        [sys.executable, "-c", "import psdk_torch; print(psdk_torch.__file__)"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).resolve().is_relative_to(copy), f"psdk_torch came from {where.stdout}"

    deselected = [arg for path in LEFT_OUT for arg in ("--deselect", path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *deselected],
        cwd=copy, env=env, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    summary = done.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 40 and "error" not in summary, report
    # The tests that take MNIST from psdk's fixture ran, and did not skip.
    assert "PASSED tests/test_mnist.py::test_psdks_mlp_learns_mnist" in done.stdout, report
