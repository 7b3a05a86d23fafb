"""A task the launcher starts reads the config the launcher composed (psdk.launch.handoff) instead of composing it.

What it reads must be the config it would have composed from its own
command line, and a file that is damaged, from another run or for another
command must be refused, naming the problem. ``test_jobs`` runs whole jobs
over this path (``check_run`` looks at every task's folder).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose
from omegaconf import DictConfig, OmegaConf

import psdk.launch.cli as cli
from psdk.config import config_dir
from psdk.launch import handoff
from psdk.launch.local import OWN_KEYS, passed_on, task_args

from .conftest import REPO

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("hydra_context")]

OUT = Path("/tmp/psdk-handoff-run")
FOLDER = OUT / "tasks"
# What LocalLauncher._start_tasks gives each task besides the run's own overrides.
PS_OWN = ["ps_hosts='127.0.0.1:0'", "worker_hosts='127.0.0.1,127.0.0.1'", f"ps.announce_file={FOLDER}/ps0.json"]
WORKER_OWN = ["ps_hosts='127.0.0.1:0'", f"ps_hosts_from={FOLDER}", "worker_hosts='127.0.0.1,127.0.0.1'"]
COMMON_OWN = [f"output_dir={OUT}", "data.dir=/data/mnist", "transport.secure=true", f"transport.keys_dir={OUT}/keys"]


def maker(run_overrides: list[str]) -> handoff.HandoffMaker:
    """What the launcher of ``python -m psdk run <run_overrides>`` makes the tasks' handoffs with."""
    launcher = compose("config", overrides=run_overrides)  # as Hydra hands it to the launcher: no hydra node
    # The launcher is given the run's overrides of its config, not those of Hydra's (hydra.run.dir=...).
    overrides = [o for o in run_overrides if not o.startswith("hydra")]
    made = handoff.HandoffMaker.for_job(launcher, overrides, passed_on(overrides), OWN_KEYS)
    assert made is not None
    return made


def argv_of(job: str, index: int, run_overrides: list[str], live: bool = False, out: Path = OUT) -> list[str]:
    own = [*COMMON_OWN, *(["+hydra.job_logging.handlers.console.level=WARNING"] if live else [])]
    own += PS_OWN if job == "ps" else WORKER_OWN
    return task_args(job, index, out, [*passed_on(run_overrides), *own])


def composed(argv: list[str]) -> DictConfig:
    """The config the task started with ``argv`` composes by hand (``python -m psdk <argv>``)."""
    overrides = [f"job_name={argv[0]}", *(a for a in argv[1:] if not a.lstrip("+").startswith("hydra."))]
    return compose("config", overrides=overrides)


RUNS = [
    [],
    ["progress.mode=off", "hydra.run.dir=/tmp/elsewhere"],
    ["optimizer=adam", "optimizer.lr=0.003", "train.steps=300", "sync=sync", "sync.replicas_to_aggregate=2"],
    ["experiment=softmax_sgd", "checkpoint.every_steps=50", "transport.secure=false", "backend=numpy"],
    ["topology.num_workers=3", "train.overlap=true", "data.validation_size=100", "report.plot=false"],
]


@pytest.mark.parametrize("run_overrides", RUNS, ids=lambda r: " ".join(r) or "default")
@pytest.mark.parametrize(("job", "index"), [("ps", 0), ("worker", 0), ("worker", 1)])
def test_a_task_is_handed_the_config_it_would_compose(run_overrides: list[str], job: str, index: int) -> None:
    argv = argv_of(job, index, run_overrides)
    given = maker(run_overrides).make(argv)
    assert given is not None
    by_hand = composed(argv)
    assert OmegaConf.to_yaml(OmegaConf.create(given.config)) == OmegaConf.to_yaml(by_hand, resolve=True)
    assert given.run_dir == FOLDER / f"{job}{index}"
    assert given.logging["handlers"]["file"]["filename"] == f"{FOLDER}/{job}{index}/{job}{index}.log"
    assert "level" not in given.logging["handlers"]["console"]


def test_under_a_live_display_the_console_says_warnings_only() -> None:
    given = maker([]).make(argv_of("worker", 0, [], live=True))
    assert given is not None and given.logging["handlers"]["console"]["level"] == "WARNING"


def test_a_plain_run_hands_its_tasks_their_config() -> None:
    run = ["optimizer=adam", "transport.secure=false", "data.dir=/data", "task_index=3"]
    assert handoff.HandoffMaker.for_job(compose("config", overrides=run), run, passed_on(run), OWN_KEYS) is not None


@pytest.mark.parametrize(
    "run_overrides",
    [
        ["train.steps=${oc.env:STEPS,300}"],  # resolved in each task, in its own environment
        ["hydra.job.chdir=true"],  # a Hydra setting each task would act on, were it passed on
        ["ps.announce_file=/tmp/mine.json"],  # the launcher sets it for some tasks, the rest get the default
    ],
)
def test_what_a_task_would_see_otherwise_makes_it_compose_its_own(run_overrides: list[str]) -> None:
    """No handoff for these runs: each task composes its config with Hydra, as before."""
    launcher = compose("config", overrides=[])
    assert handoff.HandoffMaker.for_job(launcher, run_overrides, passed_on(run_overrides), OWN_KEYS) is None


# ------------------------------------------------------------------ the task's side
def handed(tmp_path: Path, job: str = "worker") -> tuple[str, list[str], Path]:
    """A handoff written as the launcher writes it: the value of PSDK_TASK_CONFIG, the argv, the file."""
    make = maker([])
    argv = argv_of(job, 0, [], out=tmp_path)
    given = make.make(argv)
    assert given is not None
    path = tmp_path / "worker0.handoff.json"
    return handoff.write(path, make.run_id, argv, given), argv, path


def test_a_launched_task_runs_on_the_handed_config_without_hydra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    value, argv, _ = handed(tmp_path)
    ran: list[tuple[DictConfig, Path]] = []

    def never(*args: Any) -> None:
        raise AssertionError("the task composed its config with Hydra")

    monkeypatch.setattr(cli, "run_hydra", never)
    monkeypatch.setattr(cli, "_run_task", lambda cfg, out: ran.append((cfg, out)))
    monkeypatch.setattr(handoff, "configure_logging", lambda given: None)
    monkeypatch.setenv(handoff.ENV, value)
    assert cli.main(argv) == 0
    [(cfg, out)] = ran
    assert out == tmp_path / "tasks" / "worker0"
    assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(composed(argv), resolve=True)
    assert OmegaConf.is_struct(cfg)  # a key that is not there fails, as in Hydra's config
    monkeypatch.delenv(handoff.ENV)
    with pytest.raises(AssertionError, match="composed"):  # by hand: Hydra, as before
        cli.main(argv)


def test_a_launched_task_imports_no_hydra_composition(tmp_path: Path) -> None:
    """In a fresh process: the handed task reaches its job without Hydra's config loader."""
    value, argv, _ = handed(tmp_path)
    code = (
        "import sys, psdk.launch.cli as c\n"
        "c._run_task = lambda cfg, out: print('ran', cfg.job_name, cfg.task_index, out)\n"
        f"assert c.main({argv!r}) == 0\n"
        "print(sorted(m for m in ('hydra._internal.config_loader_impl', 'hydra.main') if m in sys.modules))\n"
    )
    env = {"PYTHONPATH": str(REPO), handoff.ENV: value, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [f"ran worker 0 {tmp_path / 'tasks' / 'worker0'}", "[]"]


def damage(path: Path) -> None:
    text = path.read_text()
    path.write_text(text.replace('"train"', '"trian"', 1))


@pytest.mark.parametrize(
    ("spoil", "fragment"),
    [
        (lambda value, argv, path: (damage(path), value)[1], "is damaged: its checksum does not match"),
        (lambda value, argv, path: (path.write_text("not json"), value)[1], "is damaged"),
        (lambda value, argv, path: "0123456789abcdef:" + value.split(":", 1)[1], "was written for another run"),
        (lambda value, argv, path: (path.unlink(), value)[1], "cannot be read"),
        (lambda value, argv, path: str(path), "not <run id>:<file>"),
    ],
    ids=["edited", "replaced", "another run", "gone", "no run id"],
)
def test_a_spoilt_handoff_is_refused_naming_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, spoil: Any, fragment: str
) -> None:
    value, argv, path = handed(tmp_path)
    monkeypatch.setattr(cli, "_run_task", lambda cfg, out: pytest.fail("a spoilt handoff was run"))
    monkeypatch.setenv(handoff.ENV, spoil(value, argv, path))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"psdk: error: {handoff.ENV}" in err and fragment in err and "unset" in err


def test_a_handoff_for_another_command_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable left in a shell meets a task run by hand with other overrides: refused, not obeyed."""
    value, argv, _ = handed(tmp_path)
    monkeypatch.setattr(cli, "_run_task", lambda cfg, out: pytest.fail("a handoff for another command was run"))
    monkeypatch.setenv(handoff.ENV, value)
    assert cli.main([*argv, "train.steps=10"]) == 2
    assert "was written for the command `python -m psdk worker task_index=0" in capsys.readouterr().err
    # The ps of the same run gets its own file: the worker's is not the ps's either.
    assert cli.main(["ps", *argv[1:]]) == 2


def test_the_file_is_json_with_a_checksum(tmp_path: Path) -> None:
    _, argv, path = handed(tmp_path)
    head, body = path.read_text().split("\n", 1)
    assert head.startswith("sha256 ") and json.loads(body)["argv"] == argv


# ------------------------------------------------------------------ a `run` that is surely one run
def test_a_run_is_one_run_unless_the_command_line_says_otherwise() -> None:
    assert cli.surely_one_run(["hydra.job.name=run", "train.steps=10", "hydra.run.dir=/tmp/x"])
    assert not cli.surely_one_run(["--multirun", "sync=sync,async"])
    assert not cli.surely_one_run(["hydra.mode=MULTIRUN"])
    assert not cli.surely_one_run(["--config-dir=/tmp/mine", "train.steps=10"])
    assert not cli.surely_one_run(["hydra/sweeper=basic"])


@pytest.mark.parametrize("experiment", [None, *(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))])
def test_the_shipped_config_leaves_the_mode_to_the_command_line(experiment: str | None) -> None:
    """What lets ``run`` skip Hydra's composition that only reads hydra.mode (:func:`psdk.launch.cli._one_run_only`)."""
    overrides = [] if experiment is None else [f"experiment={experiment}"]
    assert compose("config", overrides=overrides, return_hydra_config=True).hydra.mode is None
