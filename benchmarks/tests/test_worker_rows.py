"""The worker's row cut-and-assemble benchmark runs, checks both ways' rows, and prints its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.timeout(120)
def test_prints_each_tables_cut_and_assembly_against_plain_numpy() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "worker_rows.py"), "--batch", "64", "--vocab", "50000",
         "--steps", "5", "--pool", "3", "--json"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("|")[1].strip() for line in lines[3:-1]] == ["hash, 1 ps", "hash, 2 ps", "range, 1 ps",
                                                                    "range, 2 ps"]  # fmt: skip
    out = json.loads(lines[-1])
    for case in out["cases"].values():
        assert set(case) == {"cut_us", "numpy_cut_us", "assemble_us", "numpy_assemble_us"}
        assert all(value >= 0 for value in case.values())
    assert 0 < out["unique_ids"] <= 64 * 26
