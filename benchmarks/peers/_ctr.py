"""What the click-through (CTR) peers share: the click log, the DLRM's shape, the test set, the measured window.

Every CTR peer trains psdk's ``workload=ctr`` job: the same generated
Criteo-shaped log (:class:`psdk.workloads.ctr.data.ClickLog`, numpy only),
the same DLRM shape and initial dense weights
(:class:`psdk.workloads.ctr.model.DlrmSpec`), one table ``emb`` of
``--capacity`` rows x ``--dim`` shared by the 26 fields, Adagrad with
TensorFlow 1.x's initial accumulator, and the same test set and AUC.
Worker ``i`` trains on the stream psdk's worker ``i`` trains on (seed
``seed * 1000 + i``); the single process takes the workers' batches in turn,
so it sees the same examples the workers see together.

**The measured window.** Throughput and CPU are measured between the chief
passing ``--warmup`` global steps (its local step ``warmup // workers``) and
the first worker finishing its last step, while every task still runs. The
launcher reads every task's CPU time from ``/proc`` at both ends
(:func:`measure_window`); the workers record when each of their steps ended
(:class:`StepClock`), so the examples trained inside the window are counted,
never estimated. Figures are per 1,000 examples, summed over every process
of the job.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as c
import numpy as np

from psdk.workloads.ctr.data import DENSE, FIELDS, TEST, TRAIN, ClickLog, auc, log_loss
from psdk.workloads.ctr.model import DlrmSpec

KEYS = (
    "system",
    "framework",
    "mode",
    "workload",
    "steps",
    "batch",
    "examples",
    "examples_per_s",
    "cpu_s_per_1k_examples",
    "cpu_split",
    "test_auc",
    "test_logloss",
    "best_auc",
    "wall_s",
    "ps_max_rss_mb",
    "time_split",
)
"""The CTR peers' JSON line (``notes`` is added last)."""

WARM, DONE = "warm", "done"
"""Marker files in the run folder: the chief passed the warm-up; a worker finished training."""


def parser(description: str, modes: Sequence[str] = ("async",)) -> argparse.ArgumentParser:
    """The MNIST peers' flags with the CTR recipe's defaults, plus the table's and the window's."""
    p = c.parser(description, modes)
    p.set_defaults(steps=2000, batch=1024, lr=0.3)
    p.add_argument("--num-ps", type=int, default=2, help="parameter servers (the table is split over them)")
    p.add_argument("--vocab", type=int, default=10_000_000, help="the largest field's vocabulary")
    p.add_argument("--capacity", type=int, default=10_000_000, help="the table's rows: ids are in [0, capacity)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--init-acc", type=float, default=0.1, help="Adagrad's initial accumulator (TF1's default)")
    p.add_argument("--test-size", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=100, help="global steps left out of the measured window")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    return p


def check(args: argparse.Namespace) -> None:
    """Fail fast in the launcher on flags every task would fail on."""
    if args.workers < 1 or args.steps < 2 or args.batch < 1 or args.timeout <= 0:
        raise c.TaskFailed("need --workers >= 1, --steps >= 2, --batch >= 1 and --timeout > 0")
    if not 0 <= args.warmup < args.steps:
        raise c.TaskFailed(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")
    if min(args.capacity, args.vocab, args.dim, args.num_ps, args.test_size, args.threads) < 1:
        raise c.TaskFailed("--capacity, --vocab, --dim, --num-ps, --test-size and --threads must be positive")


def run_launcher(args: argparse.Namespace, system: str, framework: str, body: Any) -> int:
    """:func:`_common.run_launcher` with the CTR checks and JSON keys."""

    def with_workload(launcher: c.Launcher) -> dict[str, Any]:
        result = dict(body(launcher))
        result.setdefault("workload", "ctr")
        result.setdefault("steps", args.steps)
        result.setdefault("batch", args.batch)
        return result

    return c.run_launcher(args, system, framework, with_workload, check=check, keys=KEYS)


# ---------------------------------------------------------------- data and model


def click_log(args: argparse.Namespace) -> ClickLog:
    return ClickLog(seed=args.seed, vocab=args.vocab, zipf=args.zipf, capacity=args.capacity)


def spec(args: argparse.Namespace) -> DlrmSpec:
    """psdk's ``model=dlrm`` at this run's table size: bottom 13-64-dim, top (dim+351)-64-1."""
    return DlrmSpec(dim=args.dim, capacity=args.capacity)


def initial_weights(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """psdk's initial dense weights (``bottom0/kernel`` (13, 64), ... ``top1/bias``; kernels are (in, out)).

    Rows are each system's own: N(0, ``spec.init_scale``**2), as psdk's ps draws them.
    """
    return spec(args).init_weights(args.seed)


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]
"""dense float32 [B, 13], cat int64 [B, 26] (ids of the one table), labels float32 [B]."""


def worker_batches(args: argparse.Namespace, worker: int) -> Iterator[Arrays]:
    """Worker ``worker``'s endless batches: psdk's worker of that task index gets the same ones."""
    log, number = click_log(args), 0
    while True:
        batch = log.batch(TRAIN, args.seed * 1000 + worker, number, args.batch)
        yield batch.inputs["dense"], batch.inputs["cat"], np.asarray(batch.targets, np.float32)
        number += 1


def interleaved_batches(args: argparse.Namespace) -> Iterator[Arrays]:
    """The single process's batches: the workers' streams in turn (the examples they train together)."""
    streams = [worker_batches(args, w) for w in range(args.workers)]
    while True:
        for stream in streams:
            yield next(stream)


@dataclass
class TestSet:
    dense: np.ndarray
    cat: np.ndarray
    labels: np.ndarray
    best_auc: float


def test_set(args: argparse.Namespace) -> TestSet:
    """psdk's test set (``workload.test_size`` examples of its own stream) and the hidden model's AUC on it."""
    batch, hidden = click_log(args).held_out(TEST, args.test_size)
    labels = np.asarray(batch.targets, np.float32)
    assert batch.inputs["dense"].shape[1] == DENSE and batch.inputs["cat"].shape[1] == FIELDS
    return TestSet(batch.inputs["dense"], batch.inputs["cat"], labels, auc(hidden, labels))


def score(logits: np.ndarray, test: TestSet) -> dict[str, float]:
    """test_auc, test_logloss and best_auc of the logits on the test set."""
    z = np.asarray(logits, np.float64).reshape(-1)
    return {"test_auc": auc(z, test.labels), "test_logloss": log_loss(z, test.labels), "best_auc": test.best_auc}


# ---------------------------------------------------------------- the measured window


class StepClock:
    """A worker's record of when each of its steps ended, and its part in the window's markers.

    Call :meth:`tick` after every training step. The chief (worker 0) writes
    the ``warm`` marker once its local step reaches ``warm_steps``; every
    worker writes ``done.<i>`` after its last step (:meth:`finish`).
    """

    def __init__(self, run_dir: str, worker: int, steps: int, warm_steps: int) -> None:
        self.run_dir, self.worker, self.warm_steps = run_dir, worker, warm_steps
        self.ends = np.zeros(steps, np.float64)
        self.count = 0
        if worker == 0 and warm_steps == 0:
            self._mark(WARM)

    def _mark(self, name: str) -> None:
        """Atomically: the launcher never reads half a time."""
        tmp = Path(self.run_dir, f".{name}.tmp")
        tmp.write_text(repr(time.time()))
        os.replace(tmp, Path(self.run_dir, name))

    def tick(self) -> None:
        self.ends[self.count] = time.time()
        self.count += 1
        if self.worker == 0 and self.count == self.warm_steps:
            self._mark(WARM)

    def finish(self) -> None:
        self._mark(f"{DONE}.{self.worker}")

    def times(self) -> list[float]:
        """For the task's result (``step_ends``)."""
        return self.ends[: self.count].tolist()


def local_steps(args: argparse.Namespace, worker: int) -> int:
    """Worker ``worker``'s share of ``--steps`` (the first workers take the remainder)."""
    return args.steps // args.workers + (1 if worker < args.steps % args.workers else 0)


def warm_steps(args: argparse.Namespace) -> int:
    """The chief's local step at which the window opens."""
    return args.warmup // args.workers


@dataclass
class Window:
    """Both ends of the measured window and every task's CPU seconds at each."""

    start: float
    end: float
    cpu: dict[str, tuple[float | None, float | None]]

    def examples(self, step_ends: Sequence[Sequence[float]], batch: int) -> int:
        """Examples trained inside the window: the steps of every worker that ended in it."""
        inside = ((np.asarray(t) > self.start) & (np.asarray(t) <= self.end) for t in step_ends)
        return batch * sum(int(np.count_nonzero(mask)) for mask in inside)

    def figures(self, step_ends: Sequence[Sequence[float]], batch: int) -> dict[str, Any]:
        """examples_per_s, cpu_s_per_1k_examples (every task summed) and cpu_split (each task's)."""
        examples = self.examples(step_ends, batch)
        seconds = self.end - self.start
        split = {
            name: (after - before) * 1000.0 / examples
            for name, (before, after) in self.cpu.items()
            if before is not None and after is not None and examples
        }
        total = sum(split.values()) if len(split) == len(self.cpu) and split else math.nan
        return {
            "examples_per_s": examples / seconds if seconds > 0 else None,
            "cpu_s_per_1k_examples": None if math.isnan(total) else round(total, 5),
            "cpu_split": {k: round(v, 5) for k, v in split.items()},
        }


def measure_window(launcher: c.Launcher, tasks: Sequence[str], workers: int) -> Window:
    """Wait for the window's two ends, reading every task's CPU at each (the launcher's side).

    The window opens at the chief's ``warm`` marker and closes at the first
    ``done.<i>``; a task failing, a stop signal or the deadline ends the wait.
    """
    run_dir = launcher.run_dir

    def sample() -> dict[str, float | None]:
        return {name: c.cpu_s(launcher.procs[name].pid) for name in tasks}

    def wait_for(found: Any, what: str) -> float:
        while not found():
            launcher.check()
            for name, proc in launcher.procs.items():
                code = proc.poll()
                if code is not None and code != 0 and name not in launcher.killed:
                    raise c.TaskFailed(f"{launcher.system}: task {name} exited with code {code}")
            if time.time() > launcher.deadline:
                raise c.TaskFailed(f"{launcher.system}: timed out waiting for {what}", c.EXIT_TIMEOUT)
            time.sleep(0.002)
        return time.time()

    wait_for(lambda: (run_dir / WARM).exists(), "the warm-up to end")
    before = sample()
    start = float((run_dir / WARM).read_text())
    wait_for(lambda: any((run_dir / f"{DONE}.{i}").exists() for i in range(workers)), "a worker to finish")
    after = sample()
    end = min(float(p.read_text()) for p in run_dir.glob(f"{DONE}.*"))
    return Window(start, end, {name: (before[name], after[name]) for name in tasks})
