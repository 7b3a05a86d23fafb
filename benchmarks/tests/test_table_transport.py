"""The sparse-against-dense transport benchmark runs and prints its table and figures (never judged on speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.timeout(120)
def test_prints_the_sparse_and_dense_round_trips_and_the_ratio() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "table_transport.py"), "--batch", "32", "--vocab", "20000",
         "--count", "10", "--warmup", "3", "--reps", "1", "--pool", "4", "--json"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split("|")[1:-1] for line in lines[4:-1]]
    assert [r[0].strip() for r in rows] == [
        "sparse push + pull (frames)", "dense push + pull (frames)", "sparse push + pull (shared memory)",
        "dense push + pull (shared memory)", "sparse: worker's sort and cut of the ids",
        "sparse: ps's id checks, index, rows gathered and created (frames)",
        "sparse: ps's id checks, index, rows gathered and created (shared memory)",
        "sparse: the same, timed alone", "sparse transport, frames (encode to decode)",
        "sparse transport, shared memory (encode to decode)",
    ]  # fmt: skip
    assert rows[-1][-1].strip().endswith("×") and rows[-2][-1].strip().endswith("×")
    out = json.loads(lines[-1])
    assert isinstance(out["ratio_shm"], float) and isinstance(out["sparse_transport_shm_us"], float)
    for kind in ("sparse", "dense", "sparse-shm", "dense-shm"):
        assert out[kind]["total_us"] == pytest.approx(out[kind]["client_us"] + out[kind]["ps_us"], abs=0.2)
        assert out[kind]["client_us"] >= 0 and out[kind]["ps_us"] >= 0
    assert 0 < out["unique_ids"] <= 32 * 26 and out["bytes"]["dense_each_way"] == out["bytes"]["sparse_down"]
    assert out["sorting_us"] >= 0 and out["ps_table_alone_us"] >= 0 and isinstance(out["ratio"], float)
    assert out["ps_table_us"] > 0 and out["ps_table_shm_us"] > 0  # the ps timed its tables in the sparse runs
