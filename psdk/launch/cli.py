"""``python -m psdk <command> [overrides]``: Hydra has no subcommands, so psdk dispatches.

``run`` starts the whole job here; ``ps`` and ``worker`` run one task each,
as TensorFlow 1.x users ran ``--job_name=ps --task_index=0`` in separate
terminals (those flags are accepted too); ``plugins`` lists the backends, workloads and
the rest; ``data`` fetches and verifies the workload's data without training (TensorFlow's
old ``download_only``). ``worker``, ``evaluate`` and ``data`` run the entries of the
workload the config chooses (``workload=mnist`` by default), found in the plugin registry.
A bare comma-separated host list (``ps_hosts=h1:2222,h2:2222``), which Hydra
alone would read as a sweep, is taken as one list. When ``TF_CONFIG`` is set
(a Kubeflow or Kubernetes job), ``task``, ``ps`` and ``worker`` take the role
and the cluster from it; flags that say otherwise are an error, never ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from omegaconf import DictConfig, OmegaConf

from psdk.config import flags
from psdk.errors import USAGE_EXIT, BindError, ConfigError, DataError, PsdkError, closest
from psdk.launch import HANDOFF_ENV, LAUNCHED_ENV, tf_config
from psdk.launch.arguments import apply_tf_config, given_text, meant_config_key, normalize_args
from psdk.runtime import access, disks
from psdk.runtime.disks import WriteError
from psdk.runtime.logs import set_task_label

if TYPE_CHECKING:
    from psdk.config.check import OverrideChecker

log = logging.getLogger("psdk")

TASK_COMMANDS = ("run", "ps", "worker", "task", "evaluate")
COMMANDS = (*TASK_COMMANDS, "report", "plugins", "bench", "keys", "fuzz", "data", "export")
# Commands people type from other tools, and psdk's.
COMMAND_ALIASES = {"train": "run", "start": "run", "launch": "run", "download": "data", "eval": "evaluate"}
# Config groups chosen in config.yaml's defaults list: `+model=...` would be refused as a second value.
TF_FLAGS = flags.CLUSTER_FLAGS
# Runs of this process's multirun that failed: the sweep goes on, and its exit status says so at the end.
FAILED_RUNS: list[Path] = []

USAGE = """\
usage: python -m psdk <command> [key=value ...] [hydra options]

commands:
  run       start the whole job on this machine: ps and worker tasks as processes
  ps        run one ps task:      python -m psdk ps task_index=0 ps_hosts=... worker_hosts=...
  worker    run one worker task:  python -m psdk worker task_index=1 ps_hosts=... worker_hosts=...
  task      run the task named by job_name=ps|worker; `python -m psdk --job_name=ps ...` too;
            with TF_CONFIG set (Kubeflow, Kubernetes), the task it names: `python -m psdk task`
  evaluate  the workload's metrics of saved weights on any backend: evaluate weights=PATH backend=tf
  report    rebuild a run's curves.png, or a multirun's comparison: report PATH [target=0.97]
  plugins   list the installed backends, workloads, rules, models, datasets and who provides them
  fuzz      sequences of every op from real workers, then mutated single messages, against live ps tasks:
            fuzz sequences=300 steps=50 count=100000 seed=0
  keys      make CURVE keys for per-task runs: keys keys_dir=DIR workers=N ps=M [overwrite=true]
  bench     psdk against TensorFlow's and PyTorch's own parameter servers (conf/bench.yaml)
  data      fetch the workload's data and check it, nothing else; MNIST: download it (or check a folder:
            data.dir=...) and verify its checksums
  export    a checkpoint's embedding tables as ids.npy + rows.npy per table, for serving:
            export CHECKPOINT [OUT] [table=NAME]

examples:
  python -m psdk run backend=torch
  python -m psdk run sync=sync sync.replicas_to_aggregate=2 topology.num_workers=3
  python -m psdk run -m sync=sync,async          # a Hydra multirun, ending with comparison.md
  python -m psdk report multirun/2026-01-31/12-00-00
  python -m psdk run experiment=softmax_sgd      # a preset (conf/experiment/, docs/experiments.md)
  python -m psdk run --cfg job                   # print the composed config

`python -m psdk run --help` shows every config group and key.
"""


class _HydraErrorsRaised:
    """Hydra's errors before the task starts reach psdk as exceptions; the task's are Hydra's to print, as usual.

    Hydra prints an exception and exits unless ``HYDRA_FULL_ERROR=1``. psdk
    sets it while Hydra composes, so that a composition that fails can be
    explained (:func:`_composition_failure`), and gives the user's value back
    as the task starts (before it starts any process, which would inherit it).
    """

    def __init__(self) -> None:
        self.saved: str | None = None
        self.active = False
        self.task_started = False

    def __enter__(self) -> None:
        self.saved, self.active, self.task_started = os.environ.get("HYDRA_FULL_ERROR"), True, False
        os.environ["HYDRA_FULL_ERROR"] = "1"

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.saved is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = self.saved

    def __exit__(self, *exc: object) -> None:
        self.restore()


HYDRA_ERRORS = _HydraErrorsRaised()


def _composition_failure(exc: Exception, checker: OverrideChecker | None, args: Sequence[str]) -> BaseException:
    """What to raise when Hydra failed before the task started: psdk's explanation, else Hydra's own message."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    explained = checker.explain(args) if checker is not None else None
    if explained is not None:
        return explained
    if not isinstance(exc, CompactHydraException):
        return exc
    cause = f"\n{exc.__cause__}" if isinstance(exc.__cause__, OmegaConfBaseException) else ""
    print(f"{exc}{cause}", file=sys.stderr)  # as Hydra prints it
    return SystemExit(1)


def _task(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    HYDRA_ERRORS.task_started = True
    HYDRA_ERRORS.restore()
    _run_task(cfg, Path(HydraConfig.get().runtime.output_dir))


def run_handed(args: Sequence[str]) -> None:
    """A task a launcher started: its config is the one the launcher handed it (no Hydra composition)."""
    from psdk.launch import handoff

    given = handoff.read(os.environ[HANDOFF_ENV], args)
    handoff.configure_logging(given)
    cfg = OmegaConf.create(given.config)
    OmegaConf.set_struct(cfg, True)  # as Hydra leaves it: a key that is not there is an error, not None
    _run_task(cfg, given.run_dir)


def _run_task(cfg: DictConfig, output_dir: Path) -> None:
    """Run the task ``cfg.job_name`` names (None: the launcher); ``output_dir`` is its folder."""
    from psdk.config import build
    from psdk.report.runs import forget_failure

    job = cfg.job_name
    set_task_label("launcher" if job is None else f"{job} {cfg.task_index}")
    with contextlib.suppress(OSError):  # a folder used before: its last failure is not this start's
        forget_failure(output_dir)
    try:
        access.apply(cfg.get(access.KEY, access.DEFAULT))  # as the config says, where a file set it
        from_tf = tf_config.from_environ(os.environ) if job in ("ps", "worker") else None
        if from_tf is not None:
            log.info("%s %d: role and cluster from %s", job, cfg.task_index, from_tf.origin)
        if job in (None, "worker"):
            from psdk.jobs.epochs import resolve_steps

            resolve_steps(cfg)  # train.epochs, when given, sets train.steps before anything reads it
        from psdk.config.capacity import check_settings

        check_settings(cfg)  # every numeric key in its range, before any task starts
        write_resolved_config(cfg, output_dir)
        if job is None:
            from hydra.core.hydra_config import HydraConfig

            build.launcher(cfg).launch(cfg, list(HydraConfig.get().overrides.task))
        elif job == "ps":
            from psdk.ps.main import run_ps

            with _beating(cfg):
                code = run_ps(cfg)
            if code:
                raise SystemExit(code)
        elif job == "worker":
            from psdk.plugins.loading import run_entry

            with _beating(cfg):
                run_entry(cfg, "worker")
        elif job == "evaluate":
            from psdk.plugins.loading import run_entry

            run_entry(cfg, "evaluate")
        else:
            raise ConfigError("job_name", f"got {job!r}", ["ps", "worker"])
    except (ConfigError, DataError, BindError, WriteError) as exc:  # the same command would fail again: not retried
        log.error("%s", exc)
        _failed(job, USAGE_EXIT, str(exc), output_dir)
    except OSError as exc:
        if not disks.is_write_failure(exc):
            raise
        error = WriteError(exc.filename or output_dir, exc, _setting_for(exc.filename, cfg, output_dir))
        log.error("%s", error)  # a full or read-only disk: one line naming the file and the fix
        _failed(job, USAGE_EXIT, str(error), output_dir)
    except PsdkError as exc:
        log.error("%s", exc)
        _failed(job, 1, str(exc), output_dir)
    except KeyboardInterrupt:
        log.error("interrupted")
        _failed(job, 130, "interrupted", output_dir, stop=True)


def _setting_for(path: object, cfg: DictConfig, output_dir: Path) -> str:
    """The setting that placed ``path``: ``checkpoint.dir``, ``data.cache_dir``, else the run's folder."""
    if path is not None:
        where = Path(os.path.abspath(str(path)))
        for key in ("checkpoint.dir", "data.cache_dir"):
            try:
                folder = OmegaConf.select(cfg, key)
            except Exception:  # an interpolation that does not resolve places nothing
                continue
            if folder and where.is_relative_to(os.path.abspath(str(folder))):
                return key
    return "hydra.run.dir"


def _beating(cfg: DictConfig) -> contextlib.AbstractContextManager[None]:
    """The task's liveness file (``liveness.file``, which a launcher sets), rewritten while it runs."""
    from psdk.config.options import options_from
    from psdk.runtime.liveness import beating

    live = options_from(cfg).liveness
    return beating(Path(live.file) if live.file else None, live.interval_s)


def _failed(job: object, code: int, error: str, output_dir: Path, stop: bool = False) -> None:
    """A task or a launcher ends with ``code``, recording why in its folder; in a multirun the sweep goes on.

    A launcher names a task's recorded reason in its own error (the chief
    refused its configuration, and why), not only the task's exit code.
    """
    from psdk.report.runs import record_failure

    with contextlib.suppress(OSError):  # the log line said it already
        record_failure(output_dir, error)
    if job is None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode == RunMode.MULTIRUN and not stop:
            FAILED_RUNS.append(output_dir)
            return
    raise SystemExit(code) from None


def write_resolved_config(cfg: DictConfig, folder: Path) -> None:
    """``config.yaml``: the task's config with every interpolation resolved."""
    try:
        text = OmegaConf.to_yaml(cfg, resolve=True)
    except Exception as exc:  # an interpolation that cannot resolve is a config error
        raise ConfigError("config", f"cannot be resolved: {exc}") from None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(text)


def run_hydra(command: str, args: list[str]) -> None:
    import hydra

    from psdk.config import config_dir, prepare_hydra
    from psdk.config.check import OverrideChecker, hydra_order, split_flags
    from psdk.config.readers import refuse_ignored

    prepare_hydra()
    if command in ("ps", "worker", "task"):
        from_tf = tf_config.from_environ(os.environ)
        if from_tf is not None:
            args = apply_tf_config(from_tf, command, args)
    elif command == "run" and os.environ.get(tf_config.ENV, "").strip():
        raise ConfigError(
            tf_config.ENV,
            "is set, so this is one task of a cluster job (Kubeflow, Kubernetes): run `python -m psdk task` "
            "there, which takes its role from TF_CONFIG; unset TF_CONFIG to start a whole job here with `run`",
        )
    if command in ("ps", "worker", "evaluate"):
        given = given_text(args, "job_name")
        if given is not None and given != command:
            raise ConfigError("job_name", f"is {given!r} but the command is {command!r}")
        if given is None:
            args = [f"job_name={command}", *args]
    elif command == "task" and given_text(args, "job_name") is None:
        raise ConfigError(
            "job_name", "`python -m psdk task` needs job_name=ps or job_name=worker, or TF_CONFIG in the environment"
        )
    elif command == "run" and given_text(args, "job_name") not in (None, "null"):
        raise ConfigError("job_name", "`run` starts every task itself; use `ps` or `worker` for one task")
    if given_text(args, "hydra.job.name") is None:
        # Prepended: Hydra's parser wants overrides before flags such as `--cfg job`.
        args = [f"hydra.job.name={command if command != 'task' else given_text(args, 'job_name')}", *args]
    if "-m" in args or "--multirun" in args:
        # First as well: after the prepended override, argparse would take the sweep's overrides for extra arguments.
        args = ["--multirun", *(a for a in args if a not in ("-m", "--multirun"))]
    checker = None
    if not os.environ.get(LAUNCHED_ENV):  # a launcher checked the overrides it passes on
        checker = OverrideChecker(config_dir())
        # What needs composing is explained once Hydra's composition fails; a multirun's is checked first, as
        # Hydra writes the sweep's folder before it composes the jobs.
        checker.check(args, compose="--multirun" in args)
        refuse_ignored(command, (split_flags(args) or ([], False))[0])
        if command == "run" and surely_one_run(args):
            _one_run_only()
    elif command in ("ps", "worker", "task") and "--multirun" not in args:
        _one_run_only()
    if not os.environ.get(LAUNCHED_ENV):  # a launcher's tasks write into the folder it checked
        check_run_folder(args)
    sys.argv = [f"psdk {command}", *hydra_order(args)]
    try:
        with HYDRA_ERRORS:
            hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(_task)()
    except Exception as exc:
        if HYDRA_ERRORS.task_started:
            raise
        if disks.is_write_failure(exc):  # Hydra could not make or fill the run's folder after all
            key = "hydra.sweep.dir" if "--multirun" in args else "hydra.run.dir"
            raise WriteError(exc.filename or ".", exc, key) from None
        raise _composition_failure(exc, checker, args) from None
    if FAILED_RUNS:
        print(f"psdk: {len(FAILED_RUNS)} run(s) of the multirun failed: {', '.join(map(str, FAILED_RUNS))}")
        raise SystemExit(1)


def check_run_folder(args: Sequence[str]) -> None:
    """Refuse (exit 2, no traceback) a run folder that cannot be created or written, before Hydra makes it.

    The folder is ``hydra.run.dir`` (``hydra.sweep.dir`` for a multirun) as
    given, or the shipped default (``outputs/<date>/<time>`` under the
    current folder); the part before its first interpolation is probed by
    writing a file there (:func:`psdk.runtime.disks.probe_folder`). A folder that
    starts with an interpolation is left to Hydra, whose failure to write it
    is explained the same way.
    """
    from psdk.config.check import split_flags

    split = split_flags(args)
    if split is None or any(a.split("=", 1)[0] in PRINT_ONLY for a in args):
        return  # the config is printed, or Hydra judges alone: no folder is made
    key = "hydra.sweep.dir" if split[1] else "hydra.run.dir"
    value = given_text(args, key)
    folder = literal_folder(str(value) if value is not None else _shipped(key))
    if folder is not None:
        disks.probe_folder(folder, key)


PRINT_ONLY = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")
"""Hydra flags after which it prints and exits, making no run folder."""


def literal_folder(value: str) -> Path | None:
    """The folder ``value`` names up to its first interpolation (None: it starts with one, e.g. an env var)."""
    text = os.path.expanduser(value.strip().strip("'\""))
    if "${" in text:
        text = text[: text.index("${")]
        if not text:
            return None
        text = text[: text.rfind("/") + 1] or "."
    return Path(text or ".")


def _shipped(key: str) -> str:
    """``hydra.run.dir`` or ``hydra.sweep.dir`` as the shipped config.yaml sets it, unresolved."""
    from psdk.config import config_dir

    node: object = OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml"), resolve=False)
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return str(node) if node else "outputs/"


def surely_one_run(args: Sequence[str]) -> bool:
    """Whether ``args`` make one run, whatever the config says: no ``-m``, no ``hydra.mode``, psdk's config tree.

    The shipped config sets no ``hydra.mode`` (a test says so), so the mode Hydra would compose is RUN.
    """
    from psdk.config.check import split_flags

    split = split_flags(args)  # None: a flag such as --config-dir, after which psdk leaves all to Hydra
    if split is None or split[1]:
        return False
    return not any("hydra.mode" in arg or arg.lstrip("+~").startswith("hydra/") for arg in split[0])


def _one_run_only() -> None:
    """Spare a task or a launcher a whole second composition of the config (about 0.1 to 0.2 s of its start-up).

    Before it composes the config to run, Hydra composes it once more only
    to read ``hydra.mode`` (RUN or MULTIRUN). A task a launcher started is
    one run by construction, and so is a ``run`` that :func:`surely_one_run`.
    Should Hydra's internals move, the probe simply stays.
    """
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:
        return
    if callable(getattr(Hydra, "get_mode", None)):
        # None, as the probe finds in a config that sets no hydra.mode: Hydra then runs once and records
        # hydra.mode=RUN among its overrides, as it would have.
        Hydra.get_mode = lambda self, config_name, overrides: None


def unknown_command(command: str) -> str:
    """What was typed, and the command that was probably meant."""
    if "=" in command or command.startswith("-"):
        return f"{command!r} is not a command: the command comes first, e.g. python -m psdk run {command}"
    meant = COMMAND_ALIASES.get(command.lower()) or closest(command, COMMANDS)
    hint = f"; did you mean `python -m psdk {meant}`?" if meant else ""
    return f"unknown command {command!r}{hint}"


def task_exit(code: int) -> NoReturn:
    """End a task process without the interpreter's teardown, once everything it wrote is out.

    Tearing down a process that imported torch takes about half a second
    (its modules and thread pools), and the job's end waits for every task.
    By the time a task's ``main`` returns, its sockets, shared memory and
    files are closed and its results written atomically; what is left is
    flushing the logs and the standard streams.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command = args[0]
    if command not in COMMANDS and any(a.lstrip("-").startswith("job_name") for a in args):
        command, args = "task", ["task", *args]  # `python -m psdk --job_name=ps --task_index=0 ...`
    try:
        if command not in COMMANDS:
            raise ConfigError("command", unknown_command(command), COMMANDS)
        access.apply(access.from_args(args[1:]))  # before anything is written, by this process or its tasks
        if command in ("plugins", "fuzz", "keys", "data", "bench", "export"):
            from psdk.launch.commands import run_command

            return run_command(command, normalize_args(args[1:], meant_config_key if command == "data" else None))
        if command == "report":
            from psdk.report.command import report

            return report(args[1:])
        if command in ("ps", "worker") and os.environ.get(HANDOFF_ENV):
            run_handed(args)
            return 0
        run_hydra(command, normalize_args(args[1:], meant_config_key))
    except PsdkError as exc:
        print(f"psdk: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if not disks.is_write_failure(exc):
            raise
        # A command's own folder (keys, a report's figures) on a full or read-only disk: one line, no traceback.
        print(f"psdk: error: {WriteError(exc.filename or '.', exc, FOLDER_KEYS.get(command))}", file=sys.stderr)
        return 2
    return 0


FOLDER_KEYS = {"keys": "keys_dir"}
"""The setting that places what a command outside Hydra writes, to name in the fix of a refused write."""
