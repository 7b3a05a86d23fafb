"""The MNIST job on PyTorch workers, end to end: `python -m psdk run backend=torch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from psdk.testing import assert_every_worker_contributed, run_job

from .conftest import MNIST_DIR, REPO


def psdk_run(out: Path, *args: str) -> tuple[dict, str]:
    return run_job(out, "backend=torch", *args, data_dir=MNIST_DIR, cwd=REPO)


def test_the_default_job_reaches_the_accuracy_bar(tmp_path: Path) -> None:
    summary, stdout = psdk_run(tmp_path)
    # The default recipe (cosine lr, 12,000 steps) sits near 0.980; the bar leaves room for async noise.
    assert summary["test_accuracy"] >= 0.975
    assert summary["global_step"] == 12000 and summary["workers"]["1"]["backend"] == "torch"
    assert_every_worker_contributed(summary, tmp_path / "metrics.jsonl")
    assert stdout.strip().splitlines()[-1].startswith("psdk done: backend=torch model=mlp sync=async")


def test_sync_mode_reaches_the_same(tmp_path: Path) -> None:
    summary, _ = psdk_run(tmp_path, "sync=sync", "train.steps=3000")
    assert summary["test_accuracy"] >= 0.97
    assert summary["gradients_applied"] == 6000 and summary["gradients_dropped"] == 0


def test_softmax_regression_reaches_its_bar(tmp_path: Path) -> None:
    summary, _ = psdk_run(tmp_path, "model=softmax", "topology.num_ps=2", "topology.num_workers=3", "train.steps=3000")
    assert summary["test_accuracy"] >= 0.91 and summary["num_workers"] == 3


def test_the_readme_example_script_trains(tmp_path: Path) -> None:
    """The example's docstring, command by command (a free port instead of 2222)."""
    env = dict(os.environ, PSDK_DATA_DIR=str(MNIST_DIR), PYTHONUNBUFFERED="1")
    announce = tmp_path / "ps.json"
    made = subprocess.run(
        [sys.executable, "-m", "psdk", "keys", "keys_dir=keys", "workers=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    ps = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psdk",
            "ps",
            "ps_hosts=127.0.0.1:0",
            "worker_hosts=localhost,localhost",
            f"transport.keys_dir={tmp_path / 'keys'}",
            "transport.startup_timeout_s=60",
            f"ps.announce_file={announce}",
            f"hydra.run.dir={tmp_path / 'ps'}",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: list[subprocess.Popen[str]] = []
    ps_log = ""
    try:
        deadline = time.monotonic() + 60
        while not announce.exists():
            assert ps.poll() is None and time.monotonic() < deadline, "the ps did not start"
            time.sleep(0.05)
        address = json.loads(announce.read_text())["address"]
        workers = [
            subprocess.Popen(
                [sys.executable, str(REPO / "examples" / "torch_worker.py"), str(i), address, "keys"],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in (0, 1)
        ]
        outputs = [w.communicate(timeout=180)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outputs
        ps_log = ps.communicate(timeout=30)[0]
    finally:
        for p in (ps, *workers):
            p.kill()
    assert ps.returncode == 0
    assert "CURVE on: 2 worker key(s) accepted" in ps_log, ps_log
    accuracy = float(outputs[0].strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert accuracy > 0.93


def test_a_mixed_framework_job_trains_one_set_of_parameters(tmp_path: Path) -> None:
    summary, stdout = psdk_run(tmp_path, "topology.worker_backends=[torch,numpy]", "train.steps=1500")
    assert {w["backend"] for w in summary["workers"].values()} == {"torch", "numpy"}
    assert_every_worker_contributed(summary, tmp_path / "metrics.jsonl")
    accuracies = summary["test_accuracy_by_backend"]
    assert set(accuracies) == {"torch", "numpy"} and abs(accuracies["torch"] - accuracies["numpy"]) <= 0.001
    assert "by backend" in stdout
