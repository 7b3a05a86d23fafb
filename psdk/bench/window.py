"""psdk's measured window, taken as the CTR peers take theirs (``benchmarks/peers/_ctr.py``).

The window opens when the chief finishes its local step ``warmup // workers``
and closes when the first worker finishes its last step, while every task
still runs. The examples counted are those of every worker step that ended
inside it, and the CPU is every process of the job (the launcher, each ps,
each worker) between its two ends, read from ``/proc``.

psdk needs no marker files for this: a job run with ``report.step_ends=true``
keeps each worker's step end times in memory, as the peers do, and writes
them once at its end (``step_ends.jsonl``), so the window is found after the
job, and a thread samples
the job's CPU meanwhile (:class:`CpuSampler`, every 20 ms); the CPU at each
end is interpolated between the two samples around it. The 10 ms ticks of
``/proc`` and the interpolation cost well under 0.1 CPU-seconds on windows
of tens of CPU-seconds.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psdk.report.metrics import read_jsonl

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (one pass over ``/proc``: ~4 ms here, so not every sample)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := parent_of(int(entry))) is not None:
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@dataclass
class CpuSampler:
    """Every ``interval_s``, the CPU seconds of a process and its descendants (looked for every ``rescan_s``)."""

    root: int
    interval_s: float = 0.02
    rescan_s: float = 0.5
    samples: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        pids: list[int] = []
        scanned = 0.0
        while not self._stop.is_set():
            if time.monotonic() - scanned >= self.rescan_s:
                pids, scanned = descendants(self.root), time.monotonic()
            now = time.time()
            read = {pid: cpu for pid in pids if (cpu := cpu_s(pid)) is not None}
            if read:
                self.samples.append((now, read))
            self._stop.wait(self.interval_s)

    def at(self, moment: float) -> dict[int, float]:
        """Each process's CPU seconds at ``moment``: linear between the samples around it.

        A process not yet started counts 0; one already gone keeps its last reading.
        """
        times = [t for t, _ in self.samples]
        pids = {pid for _, read in self.samples for pid in read}
        after = bisect.bisect_left(times, moment)
        result = {}
        for pid in pids:
            before = next(((t, r[pid]) for t, r in reversed(self.samples[:after]) if pid in r), (moment, 0.0))
            later = next(((t, r[pid]) for t, r in self.samples[after:] if pid in r), before)
            (t0, c0), (t1, c1) = before, later
            result[pid] = c0 if t1 <= t0 else c0 + (c1 - c0) * (moment - t0) / (t1 - t0)
        return result


def step_ends(path: Path) -> dict[str, list[float]]:
    """Each worker's step end times, in local-step order, from a job's ``step_ends.jsonl`` (``report.step_ends``):
    a line per worker and training call, ``{task, first_local_step, ends}``."""
    ends: dict[str, list[tuple[int, float]]] = {}
    for line in read_jsonl(path) if path.exists() else []:  # none: the job wrote no step (measure says so)
        task, first, times = str(line.get("task", "")), line.get("first_local_step"), line.get("ends")
        if task.startswith("worker") and isinstance(first, int) and isinstance(times, list):
            ends.setdefault(task, []).extend((first + i, float(t)) for i, t in enumerate(times))
    return {task: [t for _, t in sorted(points)] for task, points in sorted(ends.items())}


@dataclass
class Window:
    """The window's ends, the examples trained inside it and each process's CPU seconds over it."""

    start: float
    end: float
    examples: int
    cpu: dict[str, float]

    def figures(self) -> dict[str, Any]:
        """The peers' figures: examples_per_s, cpu_s_per_1k_examples (every process summed), cpu_split."""
        seconds = self.end - self.start
        split = {name: round(s * 1000.0 / self.examples, 5) for name, s in self.cpu.items()} if self.examples else {}
        return {
            "examples_per_s": self.examples / seconds if seconds > 0 and self.examples else None,
            "cpu_s_per_1k_examples": round(sum(split.values()), 5) if split else None,
            "cpu_split": split,
        }


def measure(
    ends: Mapping[str, Sequence[float]],
    warm_steps: int,
    batch: int,
    sampler: CpuSampler,
    names: Mapping[int, str],
) -> Window:
    """The window of a finished job: from the chief's step ``warm_steps`` to the first worker's last step.

    ``names`` names the job's processes by pid (others are named by pid);
    raises ValueError when the job's steps cannot give a window.
    """
    chief = ends.get("worker0", [])
    if warm_steps < 1 or len(chief) <= warm_steps:
        raise ValueError(f"the chief recorded {len(chief)} step ends: none after its warm-up step {warm_steps}")
    start = chief[warm_steps - 1]
    end = min(times[-1] for times in ends.values() if times)
    if end <= start:
        raise ValueError("a worker finished before the chief's warm-up ended: more steps, or a shorter warmup")
    inside = sum(1 for times in ends.values() for t in times if start < t <= end)
    before, after = sampler.at(start), sampler.at(end)
    cpu: dict[str, float] = {}
    for pid in after:
        name = names.get(pid, f"pid{pid}")
        cpu[name] = cpu.get(name, 0.0) + after[pid] - before.get(pid, 0.0)
    return Window(start, end, batch * inside, cpu)
