"""A task's liveness beat: a count its main loop bumps, a file a side thread rewrites, and the verdict on it.

A process can run while its work has stopped: stopped whole (SIGSTOP, a
frozen VM), or its loop stuck while other threads go on (a deadlock, a
stalled call). Nothing outside the task tells these apart from a slow task:
the ps's progress file is written by a thread of its own, its ZeroMQ I/O
threads keep TCP alive, and the workers waiting on a hung ps only stop
hearing it, so they look failed themselves. So the task says it itself:

* its main loop calls :func:`beat` on every turn (a ps: each turn of its
  serving loop; a worker: each training step, and each turn of every wait it
  blocks in, so a worker waiting on the network is not taken for hung). Only
  that thread beats: a side thread that beat would vouch for a stopped loop;
* while :func:`beating` runs, a daemon thread rewrites a small file every
  ``interval_s`` (``liveness.interval_s``): the count, when the writer first
  saw that count (``moved``), when it wrote (``mono``), and the pid;
* the launcher, or the Ray actor on the task's node, reads it
  (:func:`observe`) and :func:`judge` says whether the task is hung: its
  count has not moved for ``liveness.stall_timeout_s``. A process stopped
  whole stops its writer too, so its ``moved`` goes stale all the same; a
  stale ``mono`` only tells the two apart in the message.

Times are ``time.monotonic()``: Linux keeps one such clock for all the
processes of a host, a wall-clock step (NTP) never makes a task look hung,
and the reader is always on the task's host (the local launcher, or the Ray
actor that started the task). Before its first beat a task gets an
allowance of its own, ``liveness.start_timeout_s``, counted from the last
time its process used CPU: see :func:`judge`, :func:`cpu_seconds` and
``docs/recovery.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STALE_WRITES = 3
"""A file this many intervals old was not written by a running writer: the whole process is stopped."""
STARTING_CPU_S = 0.5
"""CPU seconds a task must use, before its first beat, to count as still starting rather than stuck."""
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_start_marks: dict[int, tuple[float, float, float]] = {}
"""pid -> (when it was started, its CPU seconds at the last mark, when that mark was made)."""

_beats = 0


def beat() -> None:
    """One turn of this task's main loop (cheap: one global increment)."""
    global _beats
    _beats += 1


def beats() -> int:
    """This process's beats so far."""
    return _beats


def write(path: Path, count: int, moved: float, now: float) -> None:
    """The file the reader sees, replaced whole (never half written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"beats": count, "moved": moved, "mono": now, "time": time.time(), "pid": os.getpid()}))
    os.replace(tmp, path)


@contextlib.contextmanager
def beating(path: Path | None, interval_s: float) -> Iterator[None]:
    """While the block runs, rewrite ``path`` every ``interval_s`` with this process's beats (nothing if None)."""
    if path is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        seen, moved = beats(), time.monotonic()
        while True:
            now, count = time.monotonic(), beats()
            if count != seen:
                seen, moved = count, now
            with contextlib.suppress(OSError):  # a full disk must not take the task down
                write(path, count, moved, now)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=loop, name="psdk-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@dataclass(frozen=True)
class Seen:
    """One look at a task's liveness file."""

    still_s: float
    """How long its beat count has not moved; before its first beat, how long since it was started."""
    age_s: float | None
    """How long since its writer last wrote; None while it has no file (of this process)."""
    beats: int | None
    """Its beats so far; None while it has no file."""


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process ``pid`` has used (user and system), or None where it cannot be read (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime and stime: fields 14 and 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


def _starting_since(pid: int | None, started: float, now: float) -> float:
    """When a task that has not beaten yet last showed progress: its start, or the last time it used CPU.

    Before its first beat a task imports its framework, loads data and
    sets up devices; with many tasks on few cores (8 workers importing torch
    on 2 busy cores took over 50 s) that is slow, not hung. A process that
    keeps using CPU is taken to be starting; one that sits idle (a deadlock,
    a stalled call) is not, and is judged from when it stopped.
    """
    if pid is None:
        return started
    cpu = cpu_seconds(pid)
    mark = _start_marks.get(pid)
    if cpu is None:
        return started
    if mark is None or mark[0] != started:
        _start_marks[pid] = mark = (started, cpu, started)
    if cpu - mark[1] >= STARTING_CPU_S:
        _start_marks[pid] = mark = (started, cpu, now)
    return mark[2]


def observe(path: Path, pid: int | None, started: float, now: float | None = None) -> Seen:
    """What ``path`` says of the process ``pid`` started at ``started`` (``time.monotonic()`` on this host).

    A file that is missing, unreadable, half-formed or written by another
    process (the task's earlier self) counts as no file. Before its first
    beat, ``still_s`` counts from the last time the process used CPU
    (:func:`_starting_since`).
    """
    now = time.monotonic() if now is None else now
    since_start = max(0.0, now - _starting_since(pid, started, now))
    try:
        data = json.loads(path.read_text())
        count, moved, wrote, writer = int(data["beats"]), float(data["moved"]), float(data["mono"]), data["pid"]
    except (OSError, ValueError, TypeError, KeyError):
        return Seen(since_start, None, None)
    if pid is not None and writer != pid:
        return Seen(since_start, None, None)
    age = max(0.0, now - wrote)
    if count == 0:  # not a turn of its loop yet: judged from its start, as if it had no file
        return Seen(since_start, age, 0)
    return Seen(max(0.0, now - moved), age, count)


@dataclass(frozen=True)
class Hang:
    """A task found hung: for how long, how, and by which limit (for the message)."""

    still_s: float
    how: str
    """``stuck``: its process runs, its loop does not turn; ``stopped``: the whole process, its writer too;
    ``starting``: no beat in ``liveness.start_timeout_s`` since it was started."""
    limit_s: float

    def describe(self, doing: str) -> str:
        """``doing``: what its loop does (``served``), as in "ps 0 has not served for 31.2 s (...)"."""
        if self.how == "starting":
            why, key = "since it was started or last used CPU", "liveness.start_timeout_s"
        else:
            why = "the whole process is stopped" if self.how == "stopped" else "its process runs, its loop is stuck"
            key = "liveness.stall_timeout_s"
        return f"has not {doing} for {self.still_s:.1f} s ({why}; {key}={self.limit_s:g})"


def judge(seen: Seen, limit_s: float | None, interval_s: float, start_s: float | None = None) -> Hang | None:
    """The hang of a task, or None while it is alive (or nobody judges: ``limit_s`` None).

    Hung once it has beaten: its count has not moved for more than
    ``limit_s``, whether its writer still writes (a stuck loop) or not (a
    stopped process). Before its first beat (imports, the framework's and
    the device's set-up) a running task is slow, not hung, up to ``start_s``
    since it was started (None: for ever); a stopped one is hung as soon
    as its file is ``limit_s`` old.
    """
    if limit_s is None:
        return None
    if not seen.beats:
        if seen.age_s is not None and seen.age_s > limit_s:
            return Hang(seen.age_s, "stopped", limit_s)
        if start_s is not None and seen.still_s > start_s:
            return Hang(seen.still_s, "starting", start_s)
        return None
    if seen.still_s <= limit_s:
        return None
    if seen.age_s is not None and seen.age_s > STALE_WRITES * interval_s:
        return Hang(seen.still_s, "stopped", limit_s)
    return Hang(seen.still_s, "stuck", limit_s)
