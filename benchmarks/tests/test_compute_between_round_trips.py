"""The compute-between-round-trips benchmark runs and prints its table (in a subprocess: it imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "benchmarks" / "compute_between_round_trips.py"


@pytest.mark.timeout(120)
def test_prints_cpu_per_pass_for_each_situation_against_back_to_back(psdk_mnist_dir: Path) -> None:
    env = dict(os.environ, PSDK_DATA_DIR=str(psdk_mnist_dir), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "30", "--reps", "1"],
        capture_output=True, text=True, timeout=110, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    table = {cells[0].strip(): (float(cells[1]), cells[2].strip()) for cells in rows[1:]}
    assert set(table) == {"back to back", "4 x 318 KB copies between", "32 MB swept between", "1 ms sleep between"}
    assert table["back to back"][1] == "1.00×"
    assert all(ms > 0 for ms, _ in table.values())
