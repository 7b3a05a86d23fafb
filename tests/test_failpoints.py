"""Failpoints act where and when a test says: the n-th time, killing, stalling or slowing the task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from psdk.runtime.failpoints import FAILPOINT_ENV, Spec, parse

pytestmark = pytest.mark.timeout(60)


def test_a_spec_names_the_point_the_count_and_the_action() -> None:
    assert parse("ps.update:/m") == Spec("ps.update", 1, "kill", 0.0, "/m")
    assert parse("ps.update@300=stall:/m") == Spec("ps.update", 300, "stall", 0.0, "/m")
    assert parse("worker.step@2=sleep1.5") == Spec("worker.step", 2, "sleep", 1.5, "")
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        parse("ps.update=explode:/m")


def run(spec: str, code: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    env = {FAILPOINT_ENV: spec, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


COUNT = (
    "from psdk.runtime.failpoints import failpoint\nfor i in range(5):\n    failpoint('p')\n    print(i, flush=True)\n"
)


def test_kill_acts_the_nth_time_and_once_only(tmp_path: Path) -> None:
    marker = tmp_path / "fired"
    first = run(f"p@3:{marker}", COUNT)
    assert first.returncode == -9 and first.stdout.split() == ["0", "1"] and marker.exists()
    again = run(f"p@3:{marker}", COUNT)  # a restarted task goes on
    assert again.returncode == 0 and again.stdout.split() == ["0", "1", "2", "3", "4"]


def test_stall_blocks_only_the_thread_that_reached_it(tmp_path: Path) -> None:
    code = (
        "import threading, time\nfrom psdk.runtime.failpoints import failpoint\n"
        "t = threading.Thread(target=lambda: failpoint('p'), daemon=True)\nt.start()\nt.join(1.0)\n"
        "print('stalled' if t.is_alive() else 'returned', flush=True)\n"
    )
    assert run(f"p=stall:{tmp_path / 'fired'}", code).stdout.strip() == "stalled"


def test_sleep_slows_every_time_from_the_nth_on() -> None:
    code = (
        "import time\nfrom psdk.runtime.failpoints import failpoint\nt = time.monotonic()\n"
        "for _ in range(4):\n    failpoint('p')\nprint(round(time.monotonic() - t, 1))\n"
    )
    assert 0.55 <= float(run("p@2=sleep0.2", code).stdout) < 3  # three sleeps of 0.2 s


def test_a_task_prefix_acts_in_that_task_only(tmp_path: Path) -> None:
    """Every task of a job inherits the launcher's environment: stalling one worker of two needs its name."""
    assert parse("worker1/worker.step@50=stall:/m") == Spec("worker.step", 50, "stall", 0.0, "/m", "worker1")
    marker = tmp_path / "fired"

    def in_task(label: str) -> subprocess.CompletedProcess[str]:
        return run(
            f"worker1/p@2:{marker}", f"from psdk.runtime.logs import set_task_label\nset_task_label({label!r})\n{COUNT}"
        )

    other = in_task("worker 0")
    assert other.returncode == 0 and other.stdout.split() == ["0", "1", "2", "3", "4"] and not marker.exists()
    named = in_task("worker 1")
    assert named.returncode == -9 and named.stdout.split() == ["0"] and marker.exists()
