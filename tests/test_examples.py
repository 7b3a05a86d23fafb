"""The repository's example scripts run as their docstrings say.

examples/torch_worker.py is the README's "your own PyTorch script" example:
keys, one ps, two workers, each a process of its own (so torch never loads
in this pytest process). examples/tf1_mnist_softmax.py is one script for
every task, as TensorFlow 1.x scripts were: its ps is ``psdk.serve``. examples/torch_click_model.py
trains an embedding table on two ps tasks it serves itself. They live here, not in the torch plugin's tests,
because they are files of this repository, not of the plugin's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from psdk.launch import announce

from .conftest import REPO, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.timeout(300),
]


def test_the_readme_example_script_trains(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """The example's docstring, command by command (a free port instead of 2222)."""
    env = dict(os.environ, PSDK_DATA_DIR=str(psdk_mnist_dir), PYTHONUNBUFFERED="1")
    announced = announce.file_for(tmp_path, 0)
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
            f"ps.announce_file={announced}",
            f"hydra.run.dir={tmp_path / 'ps'}",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: list[subprocess.Popen[str]] = []
    ps_log = ""
    try:

        def ps_alive() -> None:
            assert ps.poll() is None, "the ps exited before it listened"

        (address,) = announce.wait_for(tmp_path, 1, 60.0, ps_alive)  # psdk's own wait, as `run` uses it
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


@pytest.mark.timeout(120)
def test_the_tf1_softmax_script_runs_as_ps_and_workers_with_keys(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """examples/tf1_mnist_softmax.py as its docstring runs it: one script, ps + 2 workers, keys; short steps."""
    env = dict(os.environ, PSDK_DATA_DIR=str(psdk_mnist_dir), PYTHONUNBUFFERED="1")
    made = subprocess.run(
        [sys.executable, "-m", "psdk", "keys", "keys_dir=keys", "workers=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    steps = 1000
    flags = [
        f"--ps_hosts=127.0.0.1:{free_port()}", "--worker_hosts=localhost,localhost", "--keys_dir=keys",
        f"--logs_path={tmp_path / 'logs'}",
    ]  # fmt: skip
    script = str(REPO / "examples" / "tf1_mnist_softmax.py")

    def task(job: str, index: int, *extra: str) -> subprocess.Popen[str]:
        argv = [sys.executable, script, f"--job_name={job}", f"--task_index={index}", *flags, *extra]
        return subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    tasks = [task("ps", 0), *(task("worker", i, f"--train_steps={steps}") for i in (0, 1))]
    try:
        outputs = [t.communicate(timeout=100)[0] for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert [t.returncode for t in tasks] == [0, 0, 0], outputs
    ps_log = outputs[0]
    assert "CURVE on: 2 worker key(s) accepted" in ps_log and "shut down by the chief" in ps_log, ps_log
    for index, output in enumerate(outputs[1:]):
        last = output.strip().splitlines()[-1]
        assert last.startswith(f"worker {index}: test accuracy "), output
        assert float(last.split()[4]) > 0.3, last  # chance is 0.1; 1,000 steps from a stddev-1 start reach ~0.5
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["global_step"] == steps and summary["num_workers"] == 2 and summary["model"] == "softmax"
    assert (tmp_path / "logs" / "curves.png").is_file()


@pytest.mark.timeout(150)
def test_the_click_model_script_trains_its_table_through_two_ps(tmp_path: Path) -> None:
    """examples/torch_click_model.py: a sparse nn.Embedding on 2 ps tasks it serves itself; its loss falls."""
    script = str(REPO / "examples" / "torch_click_model.py")
    done = subprocess.run(
        [sys.executable, script, "--steps=300", "--every=100"],
        cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()  # the ps tasks log to the console too
    steps = [line.split(":")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 100", "step 200", "step 300"], done.stdout
    assert lines[-1].startswith("loss fell from "), done.stdout
    first, last = (float(word) for word in lines[-1].split()[3::2])
    assert last < first - 0.03, done.stdout  # measured: 0.5162 -> 0.4508
    assert done.stdout.count("shut down by the chief at version 300") == 2, done.stdout
