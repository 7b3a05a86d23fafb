"""The start-up benchmark runs whole jobs and splits their wall time into phases that add up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.timeout(300)
def test_prints_each_phase_and_the_overhead_against_training(psdk_mnist_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "startup.py"), "--reps", "2", "backend=numpy", "train.steps=300",
         "report.plot=false"],
        capture_output=True, text=True, timeout=280, check=False, cwd=REPO,
        env=dict(os.environ, PSDK_DATA_DIR=str(psdk_mnist_dir)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == ["first", "warm 1", "warm median"]
    for row in rows[:2]:
        launcher, up, training, wrap, wall, overhead = (float(v) for v in row[1:7])
        assert min(launcher, up, training, wrap) > 0
        assert launcher + up + training + wrap == pytest.approx(wall, abs=0.02)
        assert overhead == pytest.approx(wall - training, abs=0.02)
    assert "warm overhead (wall - training):" in done.stdout
