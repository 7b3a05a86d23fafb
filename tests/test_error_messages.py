"""The mistakes a new user makes first, each answered by a message that names it and says how to fix it.

Every case runs ``python -m psdk ...`` as a user would, in a subprocess with a
timeout: it must exit non-zero (2 for a configuration the same command would
refuse again), print what was wrong and the fix, never a traceback, and
never hang or restart a task.
"""

from __future__ import annotations

import gzip
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psdk.errors import USAGE_EXIT

from .conftest import MNIST_DIR, free_port
from .jobs import psdk

pytestmark = pytest.mark.timeout(90)


def fails_with(tmp_path: Path, args: list[str], fragments: list[str], code: int | None = USAGE_EXIT) -> str:
    """Run psdk with ``args``; it must fail fast with every fragment in its output and no traceback."""
    started = time.monotonic()
    result = psdk(*args, out=tmp_path / "run", timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    if code is not None:
        assert result.returncode == code, text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    assert "Traceback" not in text, text
    assert "restarting" not in text.lower(), text
    assert time.monotonic() - started < 45, text
    return text


@pytest.mark.parametrize(
    "args, fragments",
    [
        # A typo in a config group's name: the group meant, and its options.
        (
            ["run", "optimiser=adam"],
            ["optimiser", "the config group optimizer=", "adagrad, adagrad_ctr, adam", "momentum_cosine"],
        ),
        # A typo in a group's option.
        (["run", "sync=asynch"], ["has no option 'asynch'", "did you mean sync=async?", "ssp"]),
        (["run", "model=mlpp"], ["has no option 'mlpp'", "did you mean model=mlp?", "softmax"]),
        (["run", "experiment=softmax_sdg"], ["did you mean experiment=softmax_sgd?"]),
        # A typo in a key, and a key named as in another framework.
        (["run", "train.step=100"], ["train.step: there is no such key", "did you mean train.steps?", "--cfg job"]),
        (["run", "optimizer.learning_rate=0.1"], ["optimizer.learning_rate", "did you mean optimizer.lr?"]),
        (["run", "max_steps=100"], ["did you mean train.steps?"]),
        # A value of the wrong type.
        (
            ["run", "train.steps=abc"],
            ["train.steps: must be a whole number in [1, 9223372036854775807] (int64), got 'abc'", "train.steps=12000"],
        ),
        # A command that is not psdk's, or none at all.
        (["train", "backend=numpy"], ["unknown command 'train'", "did you mean `python -m psdk run`?"]),
        (["backend=numpy"], ["is not a command", "python -m psdk run backend=numpy"]),
        # Several values without -m: a sweep is asked for with -m.
        (["run", "sync=sync,async"], ["gives several values", "python -m psdk run -m sync=sync,async"]),
    ],
)
def test_config_typos_name_the_key_and_the_fix(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    fails_with(tmp_path, args, fragments)


@pytest.mark.parametrize(
    "backend, fragments",
    [
        ("pytroch", ["no installed backend is called 'pytroch'", "did you mean backend=torch?"]),
        ("mxnet", ["no installed backend is called 'mxnet'", "python -m psdk plugins", "valid choices:", "numpy"]),
    ],
)
def test_a_misnamed_or_missing_backend_says_which_exist(tmp_path: Path, backend: str, fragments: list[str]) -> None:
    fails_with(tmp_path, ["run", f"backend={backend}", "train.steps=5"], fragments)


def test_a_data_folder_that_does_not_exist(tmp_path: Path) -> None:
    fails_with(
        tmp_path,
        ["run", "backend=numpy", "data.dir=/nonexistent/mnist"],
        ["MNIST files missing in /nonexistent/mnist", "does not exist", "Fix: point data.dir=", "PSDK_DATA_DIR"],
    )


def test_a_data_folder_one_level_above_the_files_points_at_them(tmp_path: Path) -> None:
    inner = tmp_path / "data" / "mnist"
    inner.mkdir(parents=True)
    for path in MNIST_DIR.glob("*-ubyte.gz"):
        (inner / path.name).symlink_to(path)
    fails_with(
        tmp_path,
        ["run", "backend=numpy", f"data.dir={tmp_path / 'data'}"],
        [f"They are in {inner}", f"Fix: use data.dir={inner}"],
    )


def corrupt_mnist(tmp_path: Path) -> Path:
    """A copy of MNIST whose test labels fail their MD5: only the workers, which read the data, see it."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    for path in MNIST_DIR.glob("*-ubyte.gz"):
        (folder / path.name).write_bytes(path.read_bytes())
    raw = bytearray(gzip.decompress((folder / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] ^= 0xFF
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    return folder


def test_a_corrupt_data_file_stops_the_job_without_restarts(tmp_path: Path) -> None:
    fails_with(
        tmp_path,
        ["run", "backend=numpy", f"data.dir={corrupt_mnist(tmp_path)}", "train.steps=20"],
        ["t10k-labels-idx1-ubyte.gz is corrupt", "put an intact copy there", "python -m psdk data"],
        code=None,  # the launcher reports the chief's exit code 2 and stops the job
    )


def test_the_launcher_names_why_a_worker_refused_the_job(tmp_path: Path) -> None:
    """Checked by the workers (they read the data): the launcher's own error carries a worker's reason.

    Which worker the launcher sees exit first, and whether the ps was
    listening by then, varies from run to run: its line says so either way.
    """
    folder = corrupt_mnist(tmp_path)
    reason = f"{folder / 't10k-labels-idx1-ubyte.gz'} is corrupt"
    text = fails_with(tmp_path, ["run", "backend=numpy", f"data.dir={folder}", "train.steps=20"], [reason], code=1)
    launcher = [line for line in text.splitlines() if "launcher ERROR" in line]
    assert launcher and f"exited with code 2 ({reason}" in launcher[-1], text


def test_a_task_exit_is_explained_only_by_what_this_start_of_it_recorded(tmp_path: Path) -> None:
    from psdk.launch.local import Task, forget_failure
    from psdk.report.runs import record_failure

    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    ended.wait(timeout=30)
    folder = tmp_path / "tasks" / "worker1"
    record_failure(folder, "model.input_dim: is 100")
    task = Task("worker", 1, ended, [], folder=folder)
    assert task.describe_exit() == "exited with code 2 (model.input_dim: is 100)"
    forget_failure(folder)  # what the launcher does before it starts (or restarts) the task
    assert task.describe_exit() == "exited with code 2"
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    killed.wait(timeout=30)
    record_failure(folder, "stale")
    assert Task("worker", 1, killed, [], folder=folder).describe_exit() == "was killed by SIGKILL"


def test_a_run_that_succeeds_where_one_failed_is_not_taken_for_failed(tmp_path: Path) -> None:
    from psdk.report.runs import load_run, record_failure

    out = tmp_path / "run"
    record_failure(out, "an earlier run in this folder failed")
    record_failure(out / "tasks" / "worker0", "so did its chief")
    done = psdk("run", "backend=numpy", "train.steps=20", out=out, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr
    run = load_run(out)
    assert run.status == "finished" and run.error is None
    assert not (out / "tasks" / "worker0" / "failed.json").exists()


def test_a_typo_in_a_sweep_is_explained_before_hydra_makes_its_folder(tmp_path: Path) -> None:
    fails_with(tmp_path, ["run", "-m", "trian.steps=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"], ["did you mean"])
    assert not (tmp_path / "sweep").exists()


def test_more_replicas_to_aggregate_than_workers(tmp_path: Path) -> None:
    fails_with(
        tmp_path,
        ["run", "backend=numpy", "sync=sync", "sync.replicas_to_aggregate=5"],
        ["sync.replicas_to_aggregate: is 5 but the job has only 2 workers", "sync.replicas_to_aggregate=2"],
    )


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["data.validation_size=60000"], ["data.validation_size: must be in [0, 60000), got 60000"]),
        (
            ["train.batch_size=40000"],
            ["train.batch_size: 40000 is more than a worker's shard of the training set (27500 images", "=100"],
        ),
        (["model.input_dim=100"], ["model.input_dim: is 100, but the mnist images have 784 pixels; must be 784"]),
    ],
)
def test_the_workload_refuses_a_model_or_split_that_does_not_fit_its_data_before_any_task_starts(
    tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    """MNIST's ``check`` entry, run by the launcher: no task is started, let alone restarted."""
    fails_with(tmp_path, ["run", "backend=numpy", *args], fragments)
    assert not list((tmp_path / "run" / "tasks").glob("*.pid"))


def test_resume_from_nothing_or_from_a_file_that_is_no_checkpoint(tmp_path: Path) -> None:
    what = "resume= takes a checkpoint the chief wrote"
    fails_with(tmp_path, ["run", "backend=numpy", f"resume={tmp_path / 'nothing'}"], ["no checkpoint at", what])
    (tmp_path / "empty").mkdir()
    fails_with(tmp_path, ["run", "backend=numpy", f"resume={tmp_path / 'empty'}"], ["holds no checkpoint", what])
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    fails_with(
        tmp_path,
        ["run", "backend=numpy", f"resume={tmp_path / 'notes.txt'}"],
        ["cannot be read as a psdk checkpoint", what],
    )


def test_a_busy_port_names_it_and_how_to_free_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        fails_with(
            tmp_path,
            ["ps", "backend=numpy", f"ps_hosts=127.0.0.1:{port}", "transport.secure=false"],
            [f"ps 0 cannot bind 127.0.0.1:{port}: the port is in use", "Pick another port in ps_hosts", f":{port}"],
            code=None,
        )


def test_a_task_index_beyond_the_host_list(tmp_path: Path) -> None:
    hosts = [f"ps_hosts=127.0.0.1:{free_port()}", f"worker_hosts=127.0.0.1:{free_port()},127.0.0.1:{free_port()}"]
    fails_with(
        tmp_path,
        ["worker", "backend=numpy", "task_index=2", *hosts],
        ["task_index: is 2 but worker_hosts lists 2 task(s)", "use task_index=0..1", "add this task's host:port"],
    )
    fails_with(tmp_path, ["ps", "task_index=1", *hosts], ["but ps_hosts lists 1 task(s)", "use task_index=0,"])


def test_host_lists_bare_with_commas_work_and_with_spaces_say_how(tmp_path: Path) -> None:
    result = psdk("worker", "ps_hosts=127.0.0.1:2222,127.0.0.1:2223", "worker_hosts=a:1", "--cfg", "job", timeout=60)
    assert result.returncode == 0 and "ps_hosts: 127.0.0.1:2222,127.0.0.1:2223" in result.stdout, result.stderr
    fails_with(
        tmp_path,
        ["worker", "backend=numpy", "ps_hosts=127.0.0.1:2222 127.0.0.1:2223", "worker_hosts=a:1"],
        ["is not host:port", "separate hosts with commas"],
    )


def test_hydra_flags_may_come_before_the_overrides() -> None:
    result = psdk("run", "--cfg", "job", "train.steps=7", timeout=60)
    assert result.returncode == 0 and "steps: 7" in result.stdout, result.stderr
