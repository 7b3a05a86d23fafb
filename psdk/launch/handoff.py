"""The config a launcher hands each task it starts, so the task need not compose it with Hydra.

``python -m psdk run`` composes the job's config once. Each task it starts
would compose it again from the same overrides plus its own (its role, the
cluster, its folders): about 0.3 s of CPU per task, with every task starting
at once on the same cores. Instead the launcher applies each task's own
overrides to its composed config, resolves it, and writes it with the
task's logging config to ``tasks/<task>.handoff.json`` in the run's folder;
the variable :data:`ENV` names that file and this run. The task reads it
instead of running Hydra, and writes the same ``config.yaml`` and log file.

The file holds the command line it was made for, the run it belongs to and
a checksum of the rest: a task refuses, with an error that says so, a file
that is damaged, that was made for another run (a stale :data:`ENV` in a
shell), or for another command. The command line a task is started with is
the one a user would type (the launcher logs it), and a task started by
hand (no :data:`ENV`) composes its config with Hydra exactly as before.

This module imports no Hydra: reading the file is the whole point.
"""

from __future__ import annotations

import hashlib
import json
import logging.config
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psdk.errors import ConfigError
from psdk.launch import HANDOFF_ENV

ENV = HANDOFF_ENV
"""``<run id>:<path>``: the handoff file of this task of that run (set only by a launcher)."""
FORMAT = 1
RERUN = (
    f"start the job again with `python -m psdk run`, or unset {ENV} to run this task by hand "
    "(it then composes its config from its own overrides)"
)


@dataclass(frozen=True)
class Handoff:
    """What a task needs besides its command line: its resolved config, logging, and folder."""

    config: dict[str, Any]
    logging: dict[str, Any]
    run_dir: Path


def file_for(out: Path, name: str) -> Path:
    """Where the launcher writes task ``name``'s (``worker0``) handoff in run folder ``out``."""
    return out / "tasks" / f"{name}.handoff.json"


def new_run_id() -> str:
    return os.urandom(8).hex()


def encode(run_id: str, argv: Sequence[str], handoff: Handoff) -> str:
    """The file's text: a checksum line, then the JSON it covers. ``TypeError`` if a value is no JSON."""
    body = json.dumps(
        {
            "format": FORMAT,
            "run": run_id,
            "argv": list(argv),
            "run_dir": str(handoff.run_dir),
            "logging": handoff.logging,
            "config": handoff.config,
        },
        indent=1,
        allow_nan=False,
    )
    return f"sha256 {hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def write(path: Path, run_id: str, argv: Sequence[str], handoff: Handoff) -> str:
    """Write the handoff for the task started with ``argv`` (after ``python -m psdk``); the value of :data:`ENV`."""
    text = encode(run_id, argv, handoff)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return f"{run_id}:{path}"


def read(value: str, argv: Sequence[str]) -> Handoff:
    """The handoff :data:`ENV` (``value``) names, checked against this task's command line ``argv``."""
    run_id, sep, name = value.partition(":")
    if not sep or not run_id or not name:
        raise ConfigError(ENV, f"is {value!r}, not <run id>:<file> as a launcher sets it; {RERUN}")
    path = Path(name)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(ENV, f"names {path}, which cannot be read ({exc.strerror or exc}); {RERUN}") from None
    head, _, body = text.partition("\n")
    if head != f"sha256 {hashlib.sha256(body.encode()).hexdigest()}":
        raise ConfigError(ENV, f"{path} is damaged: its checksum does not match its contents; {RERUN}")
    try:
        data = json.loads(body)
    except ValueError as exc:  # a checksum that matches text that is no JSON: not a file a launcher wrote
        raise ConfigError(ENV, f"{path} is not a launcher's handoff ({exc}); {RERUN}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(ENV, f"{path} is not a handoff of format {FORMAT}; {RERUN}")
    if data.get("run") != run_id:
        raise ConfigError(
            ENV, f"{path} was written for another run ({data.get('run')}) than this task's ({run_id}); {RERUN}"
        )
    if data.get("argv") != list(argv):
        raise ConfigError(
            ENV,
            f"{path} was written for the command `python -m psdk {' '.join(map(str, data.get('argv') or []))}`, "
            f"not for this one (`python -m psdk {' '.join(argv)}`); {RERUN}",
        )
    return Handoff(config=data["config"], logging=data["logging"], run_dir=Path(data["run_dir"]))


def configure_logging(handoff: Handoff) -> None:
    """What Hydra does with ``hydra.job_logging`` (its ``configure_log``), with the task's resolved config."""
    handoff.run_dir.mkdir(parents=True, exist_ok=True)
    if handoff.logging.get("root") is not None:
        logging.config.dictConfig(handoff.logging)


# ----------------------------------------------------------------- launcher side
# The only Hydra keys a launcher gives a task: its folder, its name, and a quieter console under a live display.
RUN_DIR, JOB_NAME, CONSOLE_LEVEL = "hydra.run.dir", "hydra.job.name", "hydra.job_logging.handlers.console.level"
# psdk's job_logging, which every task composes (config.yaml's defaults), and where it puts a task's log file.
LOGGING_FILE = "hydra/job_logging/psdk.yaml"
LOG_FILE = "${hydra.runtime.output_dir}/${hydra.job.name}.log"


class HandoffMaker:
    """Each task's :class:`Handoff`, made from the config the launcher composed.

    A task's config is the launcher's with the task's own overrides applied
    as Hydra applies them, resolved; its logging is psdk's ``job_logging``
    (``conf/hydra/job_logging/psdk.yaml``), which is what a task composes:
    the launcher passes on none of the run's ``hydra.*`` overrides.
    :meth:`for_job` says when the launcher's config cannot be the one a task
    would compose, and the tasks then compose theirs: a run override each
    task resolves itself (an interpolation), or a key the launcher sets for
    some tasks only (the others get its default, not the run's value).
    """

    def __init__(self, cfg: Any, passed: Sequence[str], job_logging: dict[str, Any]):
        self.cfg, self.passed, self.job_logging = cfg, set(passed), job_logging
        self.run_id = new_run_id()

    @classmethod
    def for_job(
        cls, cfg: Any, overrides: Sequence[str], passed: Sequence[str], own_keys: Sequence[str]
    ) -> HandoffMaker | None:
        """A maker for the job of launcher config ``cfg`` run with ``overrides``, ``passed`` on to the tasks."""
        from omegaconf import OmegaConf

        from psdk.config import config_dir

        for override in overrides:
            key = override.lstrip("+~").split("=", 1)[0]
            if "${" in override:
                return None  # resolved in each task, in its own environment and Hydra context
            if key in own_keys and key not in ALWAYS_SET:
                return None  # a task the launcher does not set it for gets the default, not this value
            if key.startswith("hydra") and key not in own_keys:
                return None  # passed on: a Hydra setting each task acts on
        job_logging = OmegaConf.to_container(OmegaConf.load(config_dir() / LOGGING_FILE), resolve=False)
        if not isinstance(job_logging, dict) or job_logging["handlers"]["file"]["filename"] != LOG_FILE:
            return None
        return cls(cfg, passed, job_logging)

    def make(self, argv: Sequence[str]) -> Handoff | None:
        """The handoff of the task started with ``argv`` (after ``python -m psdk``); None: it composes its own."""
        import copy

        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        cfg = copy.deepcopy(self.cfg)
        job_logging = copy.deepcopy(self.job_logging)
        run_dir = name = None
        OmegaConf.update(cfg, "job_name", argv[0], merge=True)  # what `python -m psdk <job>` prepends
        for override in OverridesParser.create().parse_overrides([a for a in argv[1:] if a not in self.passed]):
            key, value = override.key_or_group, override.value()
            if key == RUN_DIR:
                run_dir = Path(str(value))
            elif key == JOB_NAME:
                name = str(value)
            elif key == CONSOLE_LEVEL and override.is_add():
                job_logging["handlers"]["console"]["level"] = value
            elif key.startswith("hydra") or override.is_delete() or override.is_add() or override.is_force_add():
                return None
            else:
                OmegaConf.update(cfg, key, value, merge=True)
        if run_dir is None or name is None:
            return None
        job_logging["handlers"]["file"]["filename"] = f"{run_dir.absolute()}/{name}.log"
        resolved = OmegaConf.to_container(cfg, resolve=True)
        handoff = Handoff(config=resolved, logging=job_logging, run_dir=run_dir.absolute())
        try:
            text = encode(self.run_id, argv, handoff)
        except (TypeError, ValueError):
            return None  # a value JSON cannot carry as it is
        return None if "${" in text else handoff

    def write(self, out: Path, argv: Sequence[str]) -> str | None:
        """Write the handoff of the task started with ``argv`` into run folder ``out``; the value of :data:`ENV`."""
        handoff = self.make(argv)
        if handoff is None:
            return None
        return write(file_for(out, handoff.run_dir.name), self.run_id, argv, handoff)


ALWAYS_SET = (
    "job_name",
    "task_index",
    "ps_hosts",
    "worker_hosts",
    "output_dir",
    "run_id",
    "data.dir",
    "transport.secure",
    "liveness.file",
    "hydra.run.dir",
    "hydra.job.name",
)
"""Keys a launcher sets for every task, whatever the run's overrides said."""
