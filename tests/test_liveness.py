"""A task's liveness beat: the verdict on its file, the file a real process writes, and the launcher's loop on it.

The jobs in ``tests/test_hangs.py`` show whole runs; here each part is held
to its contract alone: :func:`~psdk.runtime.liveness.judge` on made-up readings,
:func:`~psdk.runtime.liveness.observe` on files, the writer in a child process that
beats, stalls or is stopped, and the launcher's supervision loop over small
child processes standing in for a ps and a chief.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from psdk.config.build import check_liveness
from psdk.config.options import (
    LivenessOptions,
    PsOptions,
    RecoveryOptions,
    TaskOptions,
    TransportOptions,
)
from psdk.errors import ConfigError, JobFailedError
from psdk.launch.local import LocalLauncher, Task
from psdk.launch.ray_actors import RemoteProcess, TaskRunner
from psdk.runtime import liveness
from psdk.runtime.liveness import Hang, Seen, cpu_seconds, judge, observe

from .conftest import REPO

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ the verdict
def test_a_task_whose_beats_move_within_the_limit_is_alive() -> None:
    assert judge(Seen(still_s=29.9, age_s=0.5, beats=10), 30.0, 1.0) is None
    assert judge(Seen(still_s=1e6, age_s=1e6, beats=10), None, 1.0) is None  # nobody judges


def test_a_loop_that_stopped_is_hung_whether_its_process_runs_or_not() -> None:
    stuck = judge(Seen(still_s=31.0, age_s=0.4, beats=10), 30.0, 1.0)
    assert stuck == Hang(31.0, "stuck", 30.0)
    assert stuck.describe("served") == (
        "has not served for 31.0 s (its process runs, its loop is stuck; liveness.stall_timeout_s=30)"
    )
    stopped = judge(Seen(still_s=31.0, age_s=31.0, beats=10), 30.0, 1.0)
    assert stopped == Hang(31.0, "stopped", 30.0)
    assert "(the whole process is stopped; liveness.stall_timeout_s=30)" in stopped.describe("trained")


def test_before_its_first_beat_a_running_task_has_its_own_allowance_and_a_stopped_one_none() -> None:
    """Imports and a device's set-up are slow on a busy host, not hung: judged by liveness.start_timeout_s."""
    assert judge(Seen(still_s=59.0, age_s=None, beats=None), 30.0, 1.0, 60.0) is None  # no file yet
    assert judge(Seen(still_s=59.0, age_s=0.2, beats=0), 30.0, 1.0, 60.0) is None  # its writer writes
    assert judge(Seen(still_s=61.0, age_s=None, beats=None), 30.0, 1.0, 60.0) == Hang(61.0, "starting", 60.0)
    assert judge(Seen(still_s=61.0, age_s=0.2, beats=0), 30.0, 1.0, 60.0) == Hang(61.0, "starting", 60.0)
    assert judge(Seen(still_s=1e6, age_s=0.2, beats=0), 30.0, 1.0, None) is None  # no allowance: for ever
    stopped = judge(Seen(still_s=40.0, age_s=31.0, beats=0), 30.0, 1.0, 60.0)  # its writer too: stopped
    assert stopped == Hang(31.0, "stopped", 30.0)
    starting = Hang(61.0, "starting", 60.0).describe("served")
    assert starting == "has not served for 61.0 s (since it was started or last used CPU; liveness.start_timeout_s=60)"


# ------------------------------------------------------------------ the settings
def options(**liveness_keys: float | None) -> TaskOptions:
    return TaskOptions(liveness=LivenessOptions(**liveness_keys))  # type: ignore[arg-type]


def test_with_the_defaults_a_hang_is_found_within_32_s_before_anyone_gives_up() -> None:
    assert LivenessOptions().detect_s == 30 + 2 * 1.0 < PsOptions().idle_timeout_s  # type: ignore[operator]
    check_liveness(TaskOptions())
    check_liveness(options(stall_timeout_s=None))  # nobody judges: nothing to check
    check_liveness(dataclasses.replace(options(stall_timeout_s=59), recovery=RecoveryOptions(enabled=False)))


@pytest.mark.parametrize(
    "changed, named",
    [
        ({"liveness": LivenessOptions(stall_timeout_s=59)}, "= 61 s, which must be shorter than ps.idle_timeout_s"),
        ({"ps": PsOptions(idle_timeout_s=20)}, "= 32 s, which must be shorter than ps.idle_timeout_s (20 s)"),
        ({"recovery": RecoveryOptions(timeout_s=30)}, "= 32 s, which must be shorter than recovery.timeout_s (30 s)"),
        ({"transport": TransportOptions(heartbeat_timeout_s=30)}, "longer than transport.heartbeat_timeout_s (30)"),
    ],
)
def test_a_limit_that_comes_too_late_is_refused_naming_the_keys(changed: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_liveness(dataclasses.replace(TaskOptions(), **changed))  # type: ignore[arg-type]
    assert caught.value.key == "liveness.stall_timeout_s" and named in str(caught.value)


def test_a_limit_within_two_intervals_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"must be longer than twice liveness\.interval_s"):
        LivenessOptions(stall_timeout_s=2.0, interval_s=1.0)


# ------------------------------------------------------------------ reading the file
PID = 2**22 + 7


def test_observe_reads_the_count_and_the_times_of_the_process_it_watches(tmp_path: Path) -> None:
    path = tmp_path / "ps0.alive.json"  # PID: above Linux's largest pid, so no process it reads uses CPU
    started = 100.0
    assert observe(path, PID, started, now=130.0) == Seen(30.0, None, None)  # no file yet
    path.write_text(json.dumps({"beats": 5, "moved": 110.0, "mono": 128.0, "time": 0.0, "pid": PID}))
    assert observe(path, PID, started, now=130.0) == Seen(20.0, 2.0, 5)
    assert observe(path, PID + 1, started, now=130.0) == Seen(30.0, None, None)  # its earlier self's file
    path.write_text(json.dumps({"beats": 0, "moved": 101.0, "mono": 129.0, "time": 0.0, "pid": PID}))
    assert observe(path, PID, started, now=130.0) == Seen(30.0, 1.0, 0)  # no beat yet: from its start
    path.write_text('{"beats": 5, "moved"')  # never written so, but read defensively
    assert observe(path, PID, started, now=130.0) == Seen(30.0, None, None)


# ------------------------------------------------------------------ the writer, in a real process
CHILD = """
import sys, threading, time
from pathlib import Path
from psdk.runtime import liveness
gap_s, turns = float(sys.argv[2]), int(sys.argv[3])
with liveness.beating(Path(sys.argv[1]), 0.1):
    for _ in range(turns):
        liveness.beat()
        time.sleep(gap_s)
    print("stalled", flush=True)
    threading.Event().wait()
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Callable[[float, int], tuple[subprocess.Popen[str], Path, float]]]:
    """Start a child that beats ``turns`` times ``gap_s`` apart, then stalls its main thread for ever."""
    started: list[subprocess.Popen[str]] = []

    def start(gap_s: float, turns: int) -> tuple[subprocess.Popen[str], Path, float]:
        path = tmp_path / f"child{len(started)}.alive.json"
        when = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(gap_s), str(turns)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        started.append(process)
        return process, path, when

    yield start
    for process in started:
        process.kill()
        process.wait(timeout=10)


def until(condition: Callable[[], object], timeout_s: float = 20.0) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)
    return value


def test_a_slow_loop_is_never_hung_a_stalled_one_is_and_so_is_a_stopped_one(child: Callable[..., tuple]) -> None:
    process, path, started = child(0.3, 10)  # a turn every 0.3 s for 3 s: slow, against a limit of 1 s
    limit = 1.0  # above the gap plus one write interval (0.1 s), as docs/recovery.md says, with room for a busy host
    while not said_it_stalled(process):
        seen = observe(path, process.pid, started)
        assert judge(seen, limit, 0.1) is None or not seen.beats, seen  # (Python's start-up is not the loop)
        time.sleep(0.02)
    stuck = until(lambda: judge(observe(path, process.pid, started), limit, 0.1))
    assert isinstance(stuck, Hang) and stuck.how == "stuck"  # the writer goes on: only the loop stopped
    os.kill(process.pid, signal.SIGSTOP)
    try:
        until(lambda: (hang := judge(observe(path, process.pid, started), limit, 0.1)) and hang.how == "stopped")
    finally:
        os.kill(process.pid, signal.SIGCONT)


def said_it_stalled(process: subprocess.Popen[str]) -> bool:
    """Whether the child printed that it stalled (its one line), without blocking."""
    assert process.stdout is not None and process.poll() is None, "the child ended"
    return bool(select.select([process.stdout], [], [], 0)[0]) and process.stdout.readline().strip() == "stalled"


def test_the_ray_actor_reads_its_tasks_file_on_its_node(child: Callable[..., tuple]) -> None:
    """Ray cannot run end to end in every test run: the actor's method and the launcher's handle on it, bare."""
    process, path, started = child(0.05, 10**6)
    runner = TaskRunner("ps 0")
    runner.process, runner.started = process, started
    seen = until(lambda: (s := runner.liveness(str(path))) is not None and s.beats and s)
    assert isinstance(seen, Seen) and seen.age_s is not None and seen.age_s < 1.0

    class FakeRay:  # what RemoteProcess needs of the ray module
        class exceptions:  # as ray names it
            RayError = RuntimeError
            GetTimeoutError = TimeoutError

        @staticmethod
        def get(value: object, timeout: float) -> object:
            return value

    class Method:
        def __init__(self, call: Callable[..., object]):
            self.remote = call

    class Actor:
        liveness = Method(runner.liveness)

    remote = RemoteProcess(FakeRay, Actor())
    assert isinstance(remote.liveness(str(path)), Seen)
    process.kill()
    process.wait(timeout=10)
    assert remote.liveness(str(path)) is None  # a task that ended is not judged


# ------------------------------------------------------------------ the launcher's loop
FAKE_PS = """
import sys, threading, time
from pathlib import Path
from psdk.runtime import liveness
first, second, alive = (Path(a) for a in sys.argv[1:4])
with liveness.beating(alive, 0.1):
    if not first.exists():  # its first life: one beat, then stuck for ever
        first.touch()
        liveness.beat()
        threading.Event().wait()
    second.touch()
    for _ in range(40):  # its second: 2 s of beats, then the job is over
        liveness.beat()
        time.sleep(0.05)
"""
FAKE_CHIEF = """
import sys, time
from pathlib import Path
from psdk.runtime import liveness
with liveness.beating(Path(sys.argv[2]), 0.1):
    deadline = time.monotonic() + 30
    while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:  # until the ps's second life
        liveness.beat()
        time.sleep(0.05)
"""


def launcher_of(tmp_path: Path, restarts: int) -> tuple[LocalLauncher, Task]:
    """A local launcher supervising a stand-in chief and a stand-in ps that hangs once, as ``_launch`` leaves it."""
    launcher = LocalLauncher(shutdown_timeout_s=10)
    launcher.options = TaskOptions(
        liveness=LivenessOptions(stall_timeout_s=1.0, interval_s=0.1),
        recovery=RecoveryOptions(enabled=restarts > 0, max_restarts=restarts),
    )
    launcher.max_restarts = launcher.options.recovery.restarts
    launcher.out = tmp_path
    tasks = tmp_path / "tasks"
    (tasks / "ps0").mkdir(parents=True)
    second, alive = tasks / "ps0.second-life", tasks / "ps0.alive.json"
    ps_command = [sys.executable, "-c", FAKE_PS, str(tasks / "ps0.first"), str(second), str(alive)]
    ps_command.append(f"hydra.run.dir={tasks / 'ps0'}")  # where a restart writes its pid
    chief_command = [sys.executable, "-c", FAKE_CHIEF, str(second), str(tasks / "worker0.alive.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ps = Task("ps", 0, subprocess.Popen(ps_command, env=env), ps_command, env=env, alive=alive)
    chief_process = subprocess.Popen(chief_command, env=env)
    chief = Task("worker", 0, chief_process, chief_command, env=env, alive=tasks / "worker0.alive.json")
    launcher.tasks = [ps, chief]
    return launcher, ps


@pytest.fixture
def stopped_afterwards() -> Iterator[list[LocalLauncher]]:
    launchers: list[LocalLauncher] = []
    yield launchers
    for launcher in launchers:
        launcher._stop_all()


def test_the_launcher_kills_a_hung_ps_and_starts_it_again(
    tmp_path: Path, stopped_afterwards: list[LocalLauncher], caplog: pytest.LogCaptureFixture
) -> None:
    launcher, ps = launcher_of(tmp_path, restarts=3)
    stopped_afterwards.append(launcher)
    first = ps.process
    with caplog.at_level("WARNING", logger="psdk.launch.local"):
        launcher._supervise()  # returns once the chief exits 0 and the ps after it
    assert first.returncode == -signal.SIGKILL and ps.process is not first and ps.process.returncode == 0
    assert launcher.restarts == {"ps 0": 1}
    assert "ps 0 has not served for 1." in caplog.text and "killing and restarting it" in caplog.text
    assert "(its process runs, its loop is stuck; liveness.stall_timeout_s=1)" in caplog.text


def test_with_recovery_off_a_hung_ps_is_killed_and_the_job_stops_naming_it(
    tmp_path: Path, stopped_afterwards: list[LocalLauncher]
) -> None:
    launcher, ps = launcher_of(tmp_path, restarts=0)
    stopped_afterwards.append(launcher)
    with pytest.raises(JobFailedError, match=r"ps 0 has not served for 1\.\d s .* and was killed by the launcher"):
        launcher._supervise()
    assert ps.process.returncode == -signal.SIGKILL and launcher.restarts == {}


# ------------------------------------------------------------------ before the first beat
BUSY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"
IDLE = "import time\ntime.sleep(60)\n"


@pytest.mark.skipif(cpu_seconds(os.getpid()) is None, reason="a process's CPU time is read from /proc (Linux)")
@pytest.mark.parametrize(("code", "hung"), [(BUSY, False), (IDLE, True)], ids=["busy start", "idle start"])
def test_a_start_that_uses_cpu_is_starting_and_an_idle_one_is_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, hung: bool
) -> None:
    """8 workers importing torch on 2 busy cores took over 50 s to beat: slow, not hung, while they use CPU."""
    start_s = 1.5
    monkeypatch.setattr(liveness, "STARTING_CPU_S", 0.05)  # a busy process gets this within 0.5 s on a loaded host
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        # Judged for 3 start allowances: a busy process never, an idle one once the allowance is gone.
        verdicts = []
        while time.monotonic() < started + 3 * start_s:
            seen = observe(tmp_path / "none.alive.json", process.pid, started)
            verdicts.append(judge(seen, 30.0, 1.0, start_s))
            time.sleep(0.1)
        found = [v for v in verdicts if v is not None]
        if hung:
            assert found and found[-1].how == "starting" and found[-1].still_s > start_s
        else:
            assert not found, found[0]
    finally:
        process.kill()
        process.wait(timeout=10)
