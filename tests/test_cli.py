"""The command line: dispatch, TensorFlow-style flags, and errors that say how to fix them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from psdk.errors import USAGE_EXIT, ConfigError
from psdk.launch.cli import main, normalize_args

from .jobs import psdk


def test_tf_flags_and_bare_host_lists_become_overrides() -> None:
    args = [
        "--job_name=worker",
        "--task_index",
        "1",
        "--ps_hosts=a:1,b:2",
        "worker_hosts=c:3,d:4",
        "ps_hosts=[x:1]",
        "-m",
        "sync=sync,async",
        "+worker_hosts=e:1,f:2",
    ]
    assert normalize_args(args) == [
        "job_name=worker",
        "task_index=1",
        "ps_hosts='a:1,b:2'",
        "worker_hosts='c:3,d:4'",
        "ps_hosts=[x:1]",
        "-m",
        "sync=sync,async",
        "+worker_hosts='e:1,f:2'",
    ]
    with pytest.raises(ConfigError, match="task_index"):
        normalize_args(["--task_index"])


def test_usage_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0 and "python -m psdk run" in capsys.readouterr().out
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "plugins" in err and "run" in err


def test_plugins_lists_backends_and_their_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "numpy" in out and "built in" in out


def test_tf_style_job_name_without_a_command_runs_that_task(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:  # it got as far as the task's own dispatch
        main(["--job_name=chief", "--task_index=0", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == USAGE_EXIT and "job_name: got 'chief'" in capsys.readouterr().out


def test_the_ps_and_launcher_import_no_ml_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, psdk.launch.cli, psdk.ps.main, psdk.launch.local, psdk.jobs.worker; "
        "print(sorted(m for m in ('torch', 'tensorflow', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


COMPOSE_COUNTER = """
import os, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
import psdk.launch.cli

calls = []
load = ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda self, *a, **k: calls.append(1) or load(self, *a, **k)
seen = []
psdk.launch.cli._run_task = lambda cfg, out: seen.append((cfg.train.steps, os.environ.get("HYDRA_FULL_ERROR")))
os.chdir(sys.argv[1])
assert psdk.launch.cli.main(["run", "train.steps=7", "model=softmax"]) == 0
print(len(calls), seen, os.environ.get("HYDRA_FULL_ERROR"))
"""


@pytest.mark.timeout(60)
def test_a_run_with_right_overrides_composes_its_config_once(tmp_path: Path) -> None:
    """The overrides' check costs no composition of its own; Hydra's errors setting is the user's in the task."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run(
        [sys.executable, "-c", COMPOSE_COUNTER, str(tmp_path)], capture_output=True, text=True, timeout=50, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "1 [(7, None)] None"


def test_a_hydra_error_psdk_cannot_explain_is_hydras_message_without_a_traceback(tmp_path: Path) -> None:
    done = psdk("run", "hydra.no_such_key=1", "--cfg", "job", out=tmp_path / "run", timeout=60)
    assert done.returncode == 1
    assert "Could not override 'hydra.no_such_key'" in done.stderr and "Traceback" not in done.stderr


def test_job_name_must_agree_with_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps", "job_name=worker"]) == 2
    assert "job_name" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["run", "backend=tensorflw"], ["backend", "'tensorflw'", "numpy"]),
        (
            ["run", "backend=numpy", "sync=sync", "sync.replicas_to_aggregate=3"],
            ["sync.replicas_to_aggregate", "only 2 workers"],
        ),
        (["worker", "backend=numpy", "ps_hosts=127.0.0.1", "worker_hosts=a,b"], ["ps_hosts", "no port"]),
        (
            ["worker", "backend=numpy", "ps_hosts=127.0.0.1:1", "worker_hosts=a,b", "task_index=2"],
            ["task_index", "0..1"],
        ),
        (["worker", "backend=numpy", "ps_hosts=127.0.0.1:1"], ["worker_hosts"]),
        (["run", "backend=numpy", "sync=sync", "train.overlap=true"], ["train.overlap", "sync=async"]),
        (["run", "sync=synchronous"], ["sync", "async"]),
        (["run", "train.stpes=10"], ["stpes"]),
        (["run", "backend=numpy", "data.dir=/nonexistent/mnist"], ["/nonexistent/mnist", "PSDK_DATA_DIR"]),
    ],
)
def test_configuration_errors_fail_fast_naming_the_key(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    result = psdk(*args, out=tmp_path, timeout=60)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    for fragment in fragments:
        assert fragment in text, text
    assert "Traceback" not in text


@pytest.mark.slow
def test_a_busy_port_is_reported_with_how_to_fix_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = psdk("ps", f"ps_hosts=127.0.0.1:{port}", "transport.secure=false", out=tmp_path, timeout=60)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert f"127.0.0.1:{port}" in text and "in use" in text and "ps 0" in text


@pytest.mark.timeout(30)
def test_tf1_training_flags_become_the_psdk_overrides_they_mean() -> None:
    args = [
        "--batch_size=100",
        "--learning_rate",
        "0.01",
        "--train_steps=500",
        "--replicas_to_aggregate=2",
        "--data_dir=/data/mnist",
        "--sync_replicas=true",
        "--cfg",
        "job",
    ]
    assert normalize_args(args) == [
        "train.batch_size=100",
        "optimizer.lr=0.01",
        "train.steps=500",
        "sync.replicas_to_aggregate=2",
        "data.dir=/data/mnist",
        "sync=sync",
        "--cfg",
        "job",
    ]
    # A boolean flag alone is true, as TF1's flags take it; --noflag and =false are false.
    assert normalize_args(["--sync_replicas"]) == ["sync=sync"]
    assert normalize_args(["--sync_replicas", "false"]) == ["sync=async"]
    assert normalize_args(["--nosync_replicas", "-m"]) == ["sync=async", "-m"]
    # Hydra's own flags are Hydra's.
    assert normalize_args(["--multirun", "--config-dir=/x", "--info", "defaults"]) == [
        "--multirun",
        "--config-dir=/x",
        "--info",
        "defaults",
    ]
    with pytest.raises(ConfigError, match="--sync_replicas: takes true or false, got 'maybe'"):
        normalize_args(["--sync_replicas=maybe"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flag, line",
    [
        ("--task_idx=1", "--task_idx: psdk takes no such flag; did you mean --task_index?"),
        ("--batchsize=64", "--batchsize: psdk takes no such flag; did you mean --batch_size?"),
        ("--sync-replicas", "--sync-replicas: psdk takes no such flag; did you mean --sync_replicas?"),
        ("--seed=3", "--seed: psdk takes no such flag; settings are key=value overrides: did you mean seed=3?"),
        ("--lr=0.1", "did you mean optimizer.lr=0.1?"),
        ("--validate_every=5", "did you mean train.validate_every=5?"),
        ("--num_epochs=50", "train.epochs=<N x workers>"),
        ("--train_dir=/tmp/x", "hydra.run.dir=DIR"),
        ("--no_such_thing=1", "settings are key=value overrides without dashes"),
    ],
)
def test_any_other_flag_is_one_line_with_what_was_meant(
    flag: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not argparse's bare usage: the flag, or the psdk key, that was probably meant, and exit code 2."""
    assert main(["worker", flag, "--cfg", "job"]) == USAGE_EXIT
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"psdk: error: {flag.split('=')[0]}: "), captured.err
    assert line in lines[0] and "usage:" not in captured.err + captured.out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, meant",
    [
        ("sync_replicas=true", "did you mean sync=sync?"),
        ("sync_replicas=false", "did you mean sync=async?"),
        ("batch_size=100", "did you mean train.batch_size?"),
        ("learning_rate=0.01", "did you mean optimizer.lr?"),
        ("train_steps=10", "did you mean train.steps?"),
        ("replicas_to_aggregate=2", "did you mean sync.replicas_to_aggregate?"),
        ("data_dir=/x", "did you mean data.dir?"),
        ("num_epochs=3", "did you mean train.epochs?"),
    ],
)
def test_tf1_names_as_overrides_point_to_the_psdk_key(
    override: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", override, "--cfg", "job"]) == USAGE_EXIT
    err = capsys.readouterr().err
    assert f"psdk: error: {override.split('=')[0]}: there is no such key; {meant}" in err, err
    assert "sync.replicas_to_aggregate" not in err or "replicas_to_aggregate=" in override, err


@pytest.mark.timeout(60)
def test_train_steps_and_train_epochs_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "train.epochs=2", "train.steps=100", "--cfg", "job"]) == USAGE_EXIT
    err = capsys.readouterr().err
    assert "train.epochs: and train.steps are both given" in err and "give one of them" in err
    # A preset's steps yield to the command line's epochs: only the command line's two are a conflict.
    assert main(["run", "experiment=softmax_sgd", "train.epochs=2", "--cfg", "job"]) == 0
    assert "epochs: 2" in capsys.readouterr().out
