"""Smoke tests of the torch CTR peers: the CTR JSON line, learning at all, clean-up, the timeout.

Every run is a subprocess with a small table (10k ids) and a short run (60
steps of 512 at lr 0.05: at the recipe's 0.3 the test AUC after so few steps
swung from 0.48 to 0.64 run to run, at 0.05 it read 0.64-0.65), so the AUC
only has to beat chance (0.5) clearly; leftover
processes are found through the token in the launcher's environment, as in
``test_peers.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from conftest import PEERS
from test_peers import finish, start

CTR_KEYS = [
    "system", "framework", "mode", "workload", "steps", "batch", "examples", "examples_per_s",
    "cpu_s_per_1k_examples", "cpu_split", "test_auc", "test_logloss", "best_auc", "wall_s", "ps_max_rss_mb",
    "time_split", "notes",
]  # fmt: skip
SMALL = [
    "--steps",
    "60",
    "--batch",
    "512",
    "--capacity",
    "10000",
    "--vocab",
    "10000",
    "--test-size",
    "4000",
    "--lr",
    "0.05",
]
SMALL += ["--warmup", "10", "--workers", "2", "--num-ps", "2"]


def check_ctr_contract(out: str, err: str, system: str, mode: str, tasks: set[str], phases: set[str]) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got {lines!r}\nstderr:\n{err[-3000:]}"
    result = json.loads(lines[0])
    assert list(result) == CTR_KEYS
    assert (result["system"], result["framework"], result["mode"], result["workload"]) == (system, "torch", mode, "ctr")
    assert (result["steps"], result["batch"], result["examples"]) == (60, 512, 60 * 512)
    assert result["examples_per_s"] > 0 and result["cpu_s_per_1k_examples"] > 0
    assert set(result["cpu_split"]) == tasks
    assert result["cpu_s_per_1k_examples"] == pytest.approx(sum(result["cpu_split"].values()), abs=1e-4)
    assert 0.58 < result["test_auc"] < result["best_auc"] + 0.02, result  # chance is 0.5
    assert 0 < result["test_logloss"] < 0.69
    assert set(result["time_split"]) == phases and all(v >= 0 for v in result["time_split"].values())
    return result


@pytest.mark.timeout(60)
def test_single_trains_and_reports_the_ctr_line(token: str) -> None:
    code, out, err = finish(start("ctr_single.py", [*SMALL, "--timeout", "50"], token), token, timeout=55)
    assert code == 0, err[-3000:]
    result = check_ctr_contract(
        out, err, "ctr_single", "single", {"train"}, {"batch", "forward", "backward", "optimizer"}
    )
    assert result["ps_max_rss_mb"] is None


@pytest.mark.timeout(90)
def test_rpc_ps_trains_and_reports_the_ctr_line(token: str) -> None:
    code, out, err = finish(start("ctr_torch_rpc_ps.py", [*SMALL, "--timeout", "80"], token), token, timeout=85)
    assert code == 0, err[-3000:]
    phases = {"batch", "pull", "compute", "push", "ps_pull", "ps_apply"}
    result = check_ctr_contract(out, err, "ctr_torch_rpc_ps", "async", {"ps0", "ps1", "worker0", "worker1"}, phases)
    assert result["ps_max_rss_mb"] > 10
    assert "2 ps (id % num_ps)" in result["notes"]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("script", ["ctr_single.py", "ctr_torch_rpc_ps.py"])
def test_timeout_kills_every_task(script: str, token: str) -> None:
    # 100,000 steps never end in 2 s; a fast machine imports torch and ends the warm-up in less, a slow one not.
    code, out, err = finish(start(script, [*SMALL, "--steps", "100000", "--timeout", "2"], token), token, timeout=30)
    assert code == 124, err[-3000:]
    assert out == ""
    assert re.search(r"timed out waiting for (the warm-up to end|a worker to finish)", err), err[-3000:]


@pytest.mark.timeout(30)
def test_bad_flags_fail_fast_in_the_launcher(token: str) -> None:
    code, out, err = finish(
        start("ctr_torch_rpc_ps.py", ["--steps", "100", "--warmup", "100"], token), token, timeout=25
    )
    assert code == 2
    assert out == ""
    assert "--warmup 100 must be in [0, --steps 100)" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", ["ctr_single.py", "ctr_torch_rpc_ps.py"])
def test_launcher_imports_no_framework(script: str) -> None:
    """The launcher side (module import + argument parsing) stays framework-free: torch only in the tasks."""
    code = (
        "import runpy, sys; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(PEERS / script)], capture_output=True, text=True, timeout=25)
    assert done.returncode == 0, done.stderr
