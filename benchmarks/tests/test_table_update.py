"""The table-update benchmark runs and prints psdk's apply and pull against the numpy floor."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.timeout(120)
def test_prints_the_push_and_the_pull_against_the_floor() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "table_update.py"), "--vocab", "20000", "--batch", "64",
         "--warmup", "20", "--steps", "10"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[3:]]
    assert [r[0].split(" (")[0].strip() for r in rows] == ["apply a push", "training pull"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].strip().endswith("×") for r in rows)
