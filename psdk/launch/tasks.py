"""A task as the local launcher starts and watches it: its command line, its environment, its process.

Also what ties tasks to one run folder: the overrides the launcher sets for
each task itself, and the lock that makes it the folder's only launcher.
The Ray launcher starts its tasks with the same command lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from psdk.errors import JobFailedError
from psdk.launch import LAUNCHED_ENV
from psdk.report.runs import recorded_failure

# Keys the launcher sets for each task itself; the user's values for them are not passed on.
OWN_KEYS = (
    "transport.secure",
    "transport.keys_dir",
    "job_name",
    "task_index",
    "ps_hosts",
    "worker_hosts",
    "output_dir",
    "run_id",
    "ps.announce_file",
    "ps.progress_file",
    "liveness.file",
    "data.dir",
    "hydra.run.dir",
    "hydra.job.name",
)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the launcher dies."""
    with contextlib.suppress(OSError):  # not Linux: Ctrl-C and _stop_all still apply
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def passed_on(overrides: Sequence[str]) -> list[str]:
    """The run's overrides that every task should see."""
    return [o for o in overrides if _key_of(o) not in OWN_KEYS]


# Every task a launcher starts: unbuffered logs, one intra-op thread, and no summary line of its own.
TASK_ENV = {"PYTHONUNBUFFERED": "1", LAUNCHED_ENV: "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def task_args(job: str, index: int, out: Path, args: Sequence[str]) -> list[str]:
    """The arguments of ``python -m psdk`` for one task; its logs go to ``out/tasks/<job><index>``."""
    name = f"{job}{index}"
    return [
        job,
        f"task_index={index}",
        *args,
        f"liveness.file={alive_file(out, name)}",
        f"hydra.run.dir={out / 'tasks' / name}",
        f"hydra.job.name={name}",
    ]


def alive_file(out: Path, name: str) -> Path:
    """Where task ``name`` (``ps0``) writes its beats (:mod:`psdk.runtime.liveness`) in run folder ``out``."""
    return out / "tasks" / f"{name}.alive.json"


DOING = {"ps": "served", "worker": "trained"}
"""What a task's loop does, for "ps 0 has not served for 31 s"."""


class TaskProcess(Protocol):
    """What supervision needs of a task's process: a local ``Popen``, or one on a Ray node."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@contextlib.contextmanager
def only_launcher_of(out: Path) -> Iterator[None]:
    """Hold the run folder for this launcher alone, or fail at once.

    Two runs started in the same second in one directory get the same
    folder; the workers of one would read the addresses and keys of the
    other's tasks. An exclusive lock on ``tasks/launcher.lock`` (released
    by the kernel if this process dies) turns that into a clear error.
    """
    path = out / "tasks" / "launcher.lock"
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobFailedError(
                f"another launcher is running a job in {out} (runs started in the same second share a "
                "folder); start this one again, or give it its own folder with hydra.run.dir=..."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class Task:
    job: str
    index: int
    process: TaskProcess
    command: list[str]
    host: str | None = None  # where it runs, when that is not this machine
    env: dict[str, str] | None = None  # what it was started with, to start it again
    folder: Path | None = None  # its own folder (out/tasks/<job><index>), when the launcher can read it
    alive: Path | None = None  # its liveness file (psdk.runtime.liveness), on the host it runs on
    started: float = field(default_factory=time.monotonic)  # when it was last started, for its liveness
    hung: str | None = None  # why the launcher killed it as hung, until it is started again

    def starting_again(self) -> None:
        """Its next process is judged from its own start, never by its last one's beats."""
        self.started, self.hung = time.monotonic(), None

    @property
    def name(self) -> str:
        return f"{self.job} {self.index}" + (f" (on {self.host})" if self.host else "")

    def describe_exit(self) -> str:
        """How the task ended, with the reason it recorded (a refused configuration, bad data) if it did."""
        lost = getattr(self.process, "lost", None)  # a remote process can be lost with its node
        if lost:
            return str(lost)
        if self.hung:
            return self.hung
        code = self.process.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        reason = recorded_failure(self.folder) if self.folder is not None and code else None
        return f"exited with code {code}" + (f" ({reason})" if reason else "")
