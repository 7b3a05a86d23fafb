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
        [sys.executable, str(REPO / "benchmarks" / "table_transport.py"), "--batch", "128", "--vocab", "20000",
         "--count", "10", "--warmup", "3", "--reps", "1", "--pool", "4", "--json"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split("|")[1:-1] for line in lines[4:-1]]
    assert [r[0].strip() for r in rows] == [
        "sparse push + pull, rows written where they go (frames)",
        "sparse push + pull, rows copied in by the push (frames)",
        "dense push + pull of the same bytes, a new gradient each step (frames)",
        "dense push + pull of the rows' bytes alone, a new gradient each step (frames)",
        "dense push + pull, one unchanged gradient (frames)",
        "sparse push + pull, rows written where they go (shared memory)",
        "sparse push + pull, rows copied in by the push (shared memory)",
        "dense push + pull of the same bytes, a new gradient each step (shared memory)",
        "dense push + pull of the rows' bytes alone, a new gradient each step (shared memory)",
        "dense push + pull, one unchanged gradient (shared memory)",
        "dense: the new gradient written into its buffer (frames)", "sparse: the rows written where they go (frames)",
        "dense: the new gradient written into its buffer (shared memory)",
        "sparse: the rows written where they go (shared memory)", "sparse: worker's sort and cut of the ids",
        "sparse: ps's id checks, index, rows gathered and created (frames)",
        "sparse: ps's id checks, index, rows gathered and created (shared memory)",
        "sparse: the same, timed alone", "dense transport, frames (a new gradient, its write not counted)",
        "sparse transport, frames (encode to decode, the rows' write not counted)",
        "sparse transport, frames, rows copied in by the push",
        "dense transport, shared memory (a new gradient, its write not counted)",
        "sparse transport, shared memory (encode to decode, the rows' write not counted)",
        "sparse transport, shared memory, rows copied in by the push",
        "sparse transport ÷ the dense transport of the rows' bytes alone (frames)",
        "sparse transport ÷ the dense round trip, both with their writes (frames)",
        "sparse transport, rows copied in ÷ the unchanged dense gradient (frames)",
        "sparse transport ÷ the dense transport of the rows' bytes alone (shared memory)",
        "sparse transport ÷ the dense round trip, both with their writes (shared memory)",
        "sparse transport, rows copied in ÷ the unchanged dense gradient (shared memory)",
    ]  # fmt: skip
    assert all(r[-1].strip().endswith("×") for r in rows[-12:])
    out = json.loads(lines[-1])
    assert isinstance(out["ratio_shm"], float) and isinstance(out["sparse_transport_shm_us"], float)
    for kind in ("sparse", "sparse-copied", "dense", "dense-rows", "dense-unchanged", "sparse-shm",
                 "sparse-copied-shm", "dense-shm", "dense-rows-shm", "dense-unchanged-shm"):  # fmt: skip
        assert out[kind]["total_us"] == pytest.approx(out[kind]["client_us"] + out[kind]["ps_us"], abs=0.2)
        assert out[kind]["client_us"] >= 0 and out[kind]["ps_us"] >= 0
    assert 0 < out["unique_ids"] <= 128 * 26 and out["bytes"]["dense_rows_each_way"] == out["bytes"]["sparse_down"]
    b = out["bytes"]  # the dense round trip moves what the sparse one does, rows and ids
    assert 2 * b["dense_each_way"] == b["sparse_up"] + b["sparse_down"]
    assert out["sorting_us"] >= 0 and out["ps_table_alone_us"] >= 0 and isinstance(out["ratio"], float)
    assert out["ps_table_us"] > 0 and out["ps_table_shm_us"] > 0  # the ps timed its tables in the sparse runs
    # Each dense step wrote a new gradient of ~200 KB (at least 1 µs even at 200 GB/s; a bare clock read is 0.2).
    assert out["gradient_write_us"] >= 1.0 and out["gradient_write_shm_us"] >= 1.0
    assert out["row_write_us"] >= 1.0 and out["row_write_shm_us"] >= 1.0  # and each sparse step its rows
    for key in ("", "_shm"):
        assert isinstance(out[f"ratio_with_write{key}"], float) and isinstance(out[f"ratio_unchanged{key}"], float)
        assert out[f"dense_transport{key}_us"] > 0 and isinstance(out[f"ratio_copied{key}"], float)
        assert isinstance(out[f"ratio_rows_only{key}"], float)
