"""What every peer script shares: the command line, the data, the launcher and the JSON line.

This module imports neither torch nor TensorFlow (only numpy and psdk's
framework-free data/model helpers), so a launcher process that imports it
stays framework-free, and a TF task never pulls torch in (and vice versa).

The launcher (the process the harness starts) re-runs its own script once
per task with ``--role``/``--task-index``; each task is a child process in
its own session, so a Ctrl-C in a terminal reaches only the launcher, which
then kills every task it started. The tasks additionally ask the kernel to
SIGKILL them when the launcher dies (``PR_SET_PDEATHSIG``), so even a
SIGKILLed launcher leaves nothing behind. Tasks report back through small
JSON files in a private temporary folder; their stdout goes to the
launcher's stderr, so the launcher's stdout carries exactly one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_DATA = os.environ.get("PSDK_DATA_DIR") or str(Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist")
EXIT_FAILED = 2
EXTRA_FLAGS = ("vocab", "capacity", "dim", "zipf", "init_acc", "test_size", "warmup", "num_ps", "threads")
"""Flags some scripts add (the CTR peers'); passed on to the tasks when the script has them."""
EXIT_TIMEOUT = 124


def log(msg: str) -> None:
    """Everything but the final JSON line goes to stderr (with a wall-clock stamp)."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"{stamp} {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- command line


def parser(description: str, modes: Sequence[str] = ("async", "sync")) -> argparse.ArgumentParser:
    """The contract's flags, plus the hidden ones the launcher passes to its tasks."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--mode", choices=list(modes), default=modes[0])
    p.add_argument("--steps", type=int, default=2000, help="global steps (updates applied)")
    p.add_argument("--batch", type=int, default=100, help="batch size per worker step")
    p.add_argument("--lr", type=float, default=0.1, help="plain SGD learning rate")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data", default=DEFAULT_DATA, help="folder with the four MNIST IDX files (gzipped or not)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="overall limit in seconds; then every task is killed")
    # Set by the launcher for its tasks only.
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--task-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ports", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def task_argv(args: argparse.Namespace, role: str, index: int, run_dir: Path, ports: Sequence[int]) -> list[str]:
    """The command line that runs one task of this script."""
    argv = [sys.executable, "-u", str(Path(sys.argv[0]).resolve())]
    for name in ("mode", "steps", "batch", "lr", "workers", "data", "seed", "timeout"):
        argv += [f"--{name}", str(getattr(args, name))]
    for name in ("framework", "tp_transports", "tp_channels", *EXTRA_FLAGS):  # script-specific flags
        if hasattr(args, name):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += ["--role", role, "--task-index", str(index), "--run-dir", str(run_dir)]
    argv += ["--ports", ",".join(map(str, ports)), "--deadline", repr(time.time() + args.timeout)]
    return argv


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now, chosen below the kernel's ephemeral range.

    A port found free must stay free until a task binds it a few seconds
    later. Ports from the ephemeral range (what ``bind(0)`` hands out) are
    also what every outgoing connection on the machine takes, so on a busy
    shared machine one can be gone by then; below that range only explicit
    binds compete. Falls back to ``bind(0)`` if no such port is found.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = np.random.default_rng()
    ports: list[int] = []
    for _ in range(200):
        if len(ports) == n:
            break
        port = int(rng.integers(10000, max(10001, low)))
        if port not in ports and _bindable(port):
            ports.append(port)
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if (port := int(s.getsockname()[1])) not in ports:
                ports.append(port)
    return ports


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 and, where IPv6 exists, on ``[::]`` (TF's gRPC server)."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue  # no IPv6 here: gRPC falls back to IPv4
            return False
    return True


# ---------------------------------------------------------------- data


@dataclass
class Data:
    """One worker's shard (float32 in [0, 1], int64 labels) and the test set."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def load_data(folder: str, worker: int, num_workers: int, with_test: bool) -> Data:
    """Worker ``worker``'s contiguous shard of the 55,000 images after the 5,000 held out.

    psdk's own loader (numpy only) is used so every system sees the same bytes
    in the same order: the comparison is about the training systems, not I/O.
    """
    from psdk.data import mnist

    s = mnist.split(mnist.load(Path(folder)), worker, num_workers, validation_size=5000, with_test=with_test)
    return Data(s.train_x, s.train_y, s.test_x, s.test_y)


def initial_weights(seed: int) -> dict[str, np.ndarray]:
    """Glorot-uniform kernels and zero biases, the same numbers psdk starts from.

    Names: ``hidden1/kernel`` (784, 100), ``hidden1/bias``, ``logits/kernel``
    (100, 10), ``logits/bias``; kernels are (in, out) as in TF.
    """
    from psdk.plugins.models import ModelSpec, init_weights

    return init_weights(ModelSpec(), seed)


class Batches:
    """Endless batches of one shard, reshuffled every epoch (seeded per worker).

    Each step gathers its 100 rows through the epoch's permutation
    (``np.take``, ~40 us); a partial batch at the end of an epoch is
    dropped, as ``drop_remainder`` would. Every system uses this same
    iterator, so input handling costs all of them the same.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int, worker: int) -> None:
        if len(x) < batch:
            raise ValueError(f"shard of {len(x)} images is smaller than one batch of {batch}")
        self.x, self.y, self.batch = x, y, batch
        self.rng = np.random.default_rng([seed, worker])
        self.epoch = 0
        self._perm = np.arange(0)
        self._start = 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._start + self.batch > len(self._perm):
            self._perm = self.rng.permutation(len(self.x))
            self._start = 0
            self.epoch += 1
        idx = self._perm[self._start : self._start + self.batch]
        self._start += self.batch
        return np.take(self.x, idx, axis=0), np.take(self.y, idx, axis=0)


# ---------------------------------------------------------------- measurement


def rate(count: int, first: float | None, last: float | None) -> float | None:
    """Updates per second as psdk counts them: updates applied ÷ (last update - first update)."""
    if first is None or last is None or last <= first or count < 2:
        return None
    return count / (last - first)


def max_rss_mb() -> float:
    """Peak RSS of this process: VmHWM, as psdk reports its ps (``ru_maxrss`` survives exec: a spawned
    process would report its parent's peak)."""
    found = vmhwm_mb(os.getpid())
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def vmhwm_mb(pid: int) -> float | None:
    """Peak RSS of another live process, from /proc/<pid>/status (VmHWM, KiB)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process so far (this one when ``pid`` is None)."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_result(run_dir: str, name: str, result: dict[str, Any]) -> None:
    """A task's report, written atomically so the launcher never reads half a file."""
    tmp = Path(run_dir) / f".{name}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(run_dir) / f"{name}.json")


def read_result(run_dir: Path, name: str) -> dict[str, Any] | None:
    path = run_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def barrier(run_dir: str, name: str, me: int, n: int, deadline: float, poll_s: float = 0.002) -> None:
    """Wait until tasks 0..n-1 have all reached barrier ``name`` (marker files; no framework involved)."""
    Path(run_dir, f"{name}.{me}").touch()
    while not all(Path(run_dir, f"{name}.{i}").exists() for i in range(n)):
        if time.time() > deadline:
            raise TimeoutError(f"barrier {name!r}: not every task arrived")
        time.sleep(poll_s)


def wait_for_file(run_dir: str, name: str, deadline: float, poll_s: float = 0.005) -> None:
    while not Path(run_dir, name).exists():
        if time.time() > deadline:
            raise TimeoutError(f"{name} never appeared")
        time.sleep(poll_s)


def task_pid(run_dir: str, name: str) -> int | None:
    """The pid of another task of this run, as the launcher recorded it."""
    try:
        return int(Path(run_dir, f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def cpu_per_update_ms(cpu: dict[str, tuple[float | None, float | None]], updates: int) -> str:
    """'ps0 1.2, worker0 0.9' : CPU milliseconds per update of each task over the measured interval."""
    parts = []
    for name, (before, after) in cpu.items():
        if before is not None and after is not None and updates > 0:
            parts.append(f"{name} {1000 * (after - before) / updates:.2f}")
    return "CPU ms per update: " + ", ".join(parts) if parts else ""


MNIST_KEYS = ("system", "framework", "mode", "steps", "updates_per_s", "test_accuracy", "wall_s", "ps_max_rss_mb")


def emit(result: dict[str, Any], keys: Sequence[str] = MNIST_KEYS) -> None:
    """The contract's single JSON line, last on stdout."""
    line = {k: result.get(k) for k in keys}
    line["notes"] = result.get("notes", "")
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- tasks (child side)


def task_setup() -> None:
    """First thing a task does: die with the launcher, and make sure it is still there."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        sys.exit("launcher is gone")


def single_thread_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a task: one OpenMP/MKL thread, quiet TF C++ logs, loopback-only sockets.

    The thread counts are also set through each framework's own API in the task;
    the variables only stop OpenMP/MKL from starting a pool first.
    """
    env = dict(os.environ if env is None else env)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Gloo and TensorPipe pick an interface from the hostname unless told; in a
    # network namespace with only loopback that guess can fail.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("TP_SOCKET_IFNAME", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------- launcher (parent side)


class TaskFailed(RuntimeError):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class Interrupted(TaskFailed):
    """Ctrl-C, SIGTERM or SIGHUP reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name}: every task was killed", 128 + signum)


@dataclass
class Launcher:
    """Starts the tasks, waits for them under the overall deadline, and always cleans up.

    Use as a context manager: leaving it (normally, by exception, Ctrl-C,
    SIGTERM or SIGHUP) kills every task still running and removes the
    temporary folder.
    """

    system: str
    timeout_s: float
    started: float = field(default_factory=time.time)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)  # tasks the launcher ended on purpose
    signalled: int = 0  # the signal that asked the launcher to stop, if any
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="psdk-peer-")))

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def __enter__(self) -> Launcher:
        # The handlers only take note; ``check`` raises at points of our choosing. An
        # exception raised straight from a handler can land in code that swallows it
        # (Python's at-fork hooks inside ``Popen`` do), and the run would go on.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = self.signalled or signum

    def check(self) -> None:
        """Raise :class:`Interrupted` if a stop signal has arrived."""
        if self.signalled:
            raise Interrupted(self.signalled)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.check()
        self.procs[name] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # keep the launcher's stdout for the JSON line
            env=single_thread_env(env),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        # Tasks may sample each other's CPU time (see ``task_pid``).
        (self.run_dir / f"{name}.pid").write_text(str(self.procs[name].pid))
        self.check()

    def wait(self, names: Sequence[str], deadline: float | None = None, what: str = "") -> None:
        """Wait until every task in ``names`` has exited; any task failing fails the run."""
        deadline = self.deadline if deadline is None else min(deadline, self.deadline)
        pending = list(names)
        while pending:
            self.check()
            for name, proc in self.procs.items():
                code = proc.poll()
                if code is not None and code != 0 and name not in self.killed:
                    raise TaskFailed(f"{self.system}: task {name} exited with code {code}")
            pending = [n for n in pending if self.procs[n].poll() is None]
            if not pending:
                return
            if time.time() > deadline:
                if deadline < self.deadline:
                    raise TimeoutError(pending[0])
                raise TaskFailed(
                    f"{self.system}: timed out after {self.timeout_s:.0f} s waiting for task {pending[0]}"
                    + (f" ({what})" if what else ""),
                    EXIT_TIMEOUT,
                )
            time.sleep(0.02)

    def peak_rss_mb(self, name: str) -> float | None:
        return vmhwm_mb(self.procs[name].pid)

    def kill(self, *names: str, grace_s: float = 3.0) -> None:
        """SIGTERM the tasks' process groups, SIGKILL what is left after ``grace_s``."""
        live = [n for n in names if self.procs[n].poll() is None]
        for name in live:
            self.killed.add(name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGTERM)
        end = time.time() + grace_s
        for name in live:
            try:
                self.procs[name].wait(timeout=max(0.0, end - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.procs[name].pid, signal.SIGKILL)
                self.procs[name].wait()

    def kill_all(self) -> None:
        self.kill(*self.procs)

    def result(self, name: str) -> dict[str, Any]:
        res = read_result(self.run_dir, name)
        if res is None:
            raise TaskFailed(f"{self.system}: task {name} left no result")
        return res

    def elapsed(self) -> float:
        return time.time() - self.started


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the launcher dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def check_args(args: argparse.Namespace) -> None:
    """Fail fast in the launcher, before any task starts, on what every task would fail on."""
    from psdk.data import mnist
    from psdk.errors import DataError

    if args.workers < 1 or args.steps < 2 or args.batch < 1 or args.timeout <= 0:
        raise TaskFailed("need --workers >= 1, --steps >= 2, --batch >= 1 and --timeout > 0")
    try:
        mnist.resolve_dir(args.data, allow_download=False)
    except DataError as exc:
        raise TaskFailed(str(exc)) from None


def run_launcher(
    args: argparse.Namespace,
    system: str,
    framework: str,
    body: Any,
    check: Any = check_args,
    keys: Sequence[str] = MNIST_KEYS,
) -> int:
    """Run ``body(launcher) -> result dict`` and print the JSON line; map failures to exit codes."""
    mode = "single" if system.endswith("single") else args.mode
    try:
        check(args)
        with Launcher(system, args.timeout) as launcher:
            result = body(launcher)
            result.setdefault("system", system)
            result.setdefault("framework", framework)
            result.setdefault("mode", mode)
            result["wall_s"] = round(launcher.elapsed(), 3)
            launcher.check()  # a signal during the last steps still means: no result
    except TaskFailed as exc:
        log(f"error: {exc}")
        return exc.code
    except KeyboardInterrupt:  # before the launcher's handlers were in place
        log(f"{system}: interrupted")
        return 130
    emit(result, keys)
    return 0
