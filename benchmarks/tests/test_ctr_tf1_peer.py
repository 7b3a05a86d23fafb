"""The CTR TF 1.x ps/worker peer: its JSON line, learning at all, clean-up and the timeout.

The runs are subprocesses on a small table (10k ids) and a short run: 60
steps of 512 at lr 0.05, as the torch CTR peers' tests (at the recipe's 0.3,
60 async steps read a test AUC of 0.52-0.65 run to run); 2 ps and 2 async
workers as the recipe. This pytest process imports no framework.
"""

from __future__ import annotations

import json
import re

import pytest
from test_peers import finish, start

SCRIPT = "ctr_tf1_ps_worker.py"
KEYS = [
    "system", "framework", "mode", "workload", "steps", "batch", "examples", "examples_per_s",
    "cpu_s_per_1k_examples", "cpu_split", "test_auc", "test_logloss", "best_auc", "wall_s", "ps_max_rss_mb",
    "time_split", "notes",
]  # fmt: skip
SMALL = ["--steps", "60", "--batch", "512", "--capacity", "10000", "--vocab", "10000", "--test-size", "4000"]
SMALL += ["--lr", "0.05", "--warmup", "10", "--num-ps", "2", "--workers", "2"]


@pytest.mark.timeout(150)
def test_a_short_run_learns_and_reports_every_key(token: str) -> None:
    """Five TF processes start on a shared 2-core machine: most of the wall time is their imports."""
    code, out, err = finish(start(SCRIPT, [*SMALL, "--timeout", "130"], token), token, timeout=140)
    assert code == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got {lines!r}"
    result = json.loads(lines[0])
    assert list(result) == KEYS
    assert (result["system"], result["framework"], result["mode"], result["workload"]) == (
        "ctr_tf1_ps_worker", "tensorflow", "async", "ctr",
    )  # fmt: skip
    assert (result["steps"], result["batch"], result["examples"]) == (60, 512, 60 * 512)
    assert 0.58 < result["test_auc"] < result["best_auc"] + 0.02, result  # chance is 0.5
    assert 0.6 < result["best_auc"] <= 1.0
    assert result["examples_per_s"] > 0 and result["cpu_s_per_1k_examples"] > 0
    assert set(result["cpu_split"]) == {"ps0", "ps1", "worker0", "worker1"}
    assert result["ps_max_rss_mb"] > 10
    split = result["time_split"]
    assert set(split) == {"step", "pull_rows", "compute", "push_and_apply", "step_in_window"}
    assert all(v > 0 for k, v in split.items() if k != "push_and_apply")
    # embedding_lookup moves every looked-up row, duplicates included: B x 26 each way.
    assert f"rows per step: {512 * 26} pulled, {512 * 26} pushed" in result["notes"]


@pytest.mark.timeout(60)
def test_timeout_kills_every_task_and_exits_124(token: str) -> None:
    # 100,000 steps never end in 2 s; the tasks may or may not have imported TensorFlow and warmed up by then.
    code, out, err = finish(start(SCRIPT, [*SMALL, "--steps", "100000", "--timeout", "2"], token), token, timeout=40)
    assert code == 124, err[-3000:]
    assert out == ""
    assert re.search(r"timed out waiting for (the warm-up to end|a worker to finish)", err), err[-3000:]


@pytest.mark.timeout(30)
def test_bad_flags_fail_fast_in_the_launcher(token: str) -> None:
    code, out, err = finish(start(SCRIPT, [*SMALL, "--warmup", "60"], token), token, timeout=25)
    assert code == 2
    assert out == ""
    assert "--warmup 60 must be in [0, --steps 60)" in err


@pytest.mark.timeout(30)
def test_launcher_imports_no_framework() -> None:
    """The launcher side (module import + argument parsing) stays TF-free, as every peer's."""
    from test_peers import test_launcher_imports_no_framework as check

    check(SCRIPT)
