"""The apply-cost benchmark runs and prints one row per update rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.timeout(120)
def test_prints_both_safe_applies_against_the_bare_one_for_every_rule() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "apply_cost.py"), "--size", "1000", "--reps", "1", "--count", "20"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["sgd", "momentum", "adam", "adagrad", "rmsprop"]
    assert all(len(r) == 6 and all(float(r[i]) > 0 for i in (1, 2, 4)) and r[5].strip().endswith("×") for r in rows)
