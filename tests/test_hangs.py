"""A hung task is told from a slow one, and replaced: whole jobs whose ps or worker freezes, stalls or only slows.

Before, a ps stopped with SIGSTOP was never touched: the launcher restarted
the healthy workers three times, each waiting ``transport.init_timeout_s``,
and the job failed after 975 s. Every fault here is injected at measured
progress (a checkpoint on disk, a ps's n-th update, a worker's n-th step),
never after a sleep, and each job runs with a short stall limit:
``liveness.stall_timeout_s=3`` with ``liveness.interval_s=0.5`` finds a hang
within 3 + 2 x 0.5 = 4 s (``docs/recovery.md``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from psdk.runtime.failpoints import FAILPOINT_ENV

from .jobs import FAST_FLAGS, all_tasks_gone, pid_of, psdk, start, wait_for
from .test_ray_launcher import LOCAL_RAY, needs_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LIMIT_S, INTERVAL_S = 3.0, 0.5
LIVE = [f"liveness.stall_timeout_s={LIMIT_S:g}", f"liveness.interval_s={INTERVAL_S:g}"]
DETECT_S = LIMIT_S + 2 * INTERVAL_S
NODE = re.compile(r"ps 0 \(on ([0-9.]+)\) has not served")


def finished(job: subprocess.Popen[str], timeout: float = 180) -> str:
    """The job's output once it ended; it is killed whatever happens, so no cluster outlives a failed test."""
    try:
        return job.communicate(timeout=timeout)[0]
    finally:
        job.kill()


def summary(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return result


def with_failpoint(spec: str, tmp_path: Path) -> dict[str, str]:
    return {FAILPOINT_ENV: f"{spec}:{tmp_path / 'failpoint-fired'}"}


def test_a_ps_frozen_mid_training_is_killed_restarted_and_restored(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = start(
        "run", "backend=numpy", "topology.num_ps=2", "train.steps=4000", "train.validate_every=0",
        "checkpoint.every_steps=500", *FAST_FLAGS, *LIVE, out=out,
    )  # fmt: skip
    try:
        wait_for(lambda: len(list((out / "checkpoints").glob("ckpt-*.npz"))) >= 2, job)  # measured progress
        frozen = pid_of(out, "ps1")
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: pid_of(out, "ps1") != frozen, job)  # the launcher started it again
        replaced_s = time.monotonic() - stopped_at
    finally:
        output = finished(job)
    print(f"SIGSTOP to a new ps 1: {replaced_s:.2f} s (found within {DETECT_S:g} s, then killed and started)")
    assert job.returncode == 0, output
    assert replaced_s <= DETECT_S + 10, output  # + the kill and a new process, on a busy 2-core host
    assert "ps 1 has not served for" in output and "(the whole process is stopped;" in output
    assert "killing and restarting it" in output
    result = summary(out)
    assert result["restarts"] == {"ps 1": 1}, "the healthy workers were never touched"
    (recovery,) = result["recoveries"]
    assert recovery["lost_steps"] <= 500 + 2 * 2  # one checkpoint interval, plus pushes in flight
    assert result["global_step"] == 4000
    assert all_tasks_gone(out)


def test_a_ps_whose_serving_loop_stalls_is_replaced_though_its_side_threads_go_on(tmp_path: Path) -> None:
    """Its progress file and ZeroMQ's I/O threads go on; only the serving thread is stuck, in its 1500th update."""
    out = tmp_path / "run"
    job = start(
        "run", "backend=numpy", "train.steps=3000", "train.validate_every=0", "checkpoint.every_steps=500",
        *FAST_FLAGS, *LIVE, out=out, extra_env=with_failpoint("ps.update@1500=stall", tmp_path),
    )  # fmt: skip
    output = finished(job)
    assert (tmp_path / "failpoint-fired").exists(), output
    assert job.returncode == 0, output
    assert "ps 0 has not served for" in output and "(its process runs, its loop is stuck;" in output
    result = summary(out)
    assert result["restarts"] == {"ps 0": 1} and result["global_step"] == 3000
    assert result["recoveries"][0]["global_step"] >= 1000  # restored from a checkpoint, not from scratch
    assert all_tasks_gone(out)


def test_a_hung_worker_is_killed_and_restarted(tmp_path: Path) -> None:
    """Sync mode: the job cannot end without worker 1, whose heartbeats go on while its training loop is stuck."""
    out = tmp_path / "run"
    job = start(
        "run", "backend=numpy", "sync=sync", "train.steps=1000", "train.validate_every=0", *FAST_FLAGS, *LIVE,
        out=out, extra_env=with_failpoint("worker1/worker.step@100=stall", tmp_path),
    )  # fmt: skip
    output = finished(job)
    assert (tmp_path / "failpoint-fired").exists(), output
    assert job.returncode == 0, output
    assert "worker 1 has not trained for" in output and "(its process runs, its loop is stuck;" in output
    result = summary(out)
    assert result["restarts"] == {"worker 1": 1} and result["workers"]["1"]["status"] == "finished"
    assert all_tasks_gone(out)


def test_a_ps_slow_to_answer_is_never_killed(tmp_path: Path) -> None:
    """Each update from the 500th blocks the serving loop 1 s; the limit is 6 s (the heartbeats' 5 s, and more).

    With the heartbeats' limit at 3 s, a host with three more busy processes than cores made
    the workers take the ps for dead (its loop answers heartbeats between updates): the limits
    leave 5 s, as a deployment would keep its heartbeat timeout well above its slowest update.
    """
    out = tmp_path / "run"
    started = time.monotonic()
    job = start(
        "run", "backend=numpy", "train.steps=514", "train.validate_every=0", *FAST_FLAGS,
        "transport.heartbeat_timeout_s=5", "liveness.stall_timeout_s=6", f"liveness.interval_s={INTERVAL_S:g}",
        out=out, extra_env=with_failpoint("ps.update@500=sleep1", tmp_path),
    )  # fmt: skip
    output = finished(job)
    assert job.returncode == 0, output
    assert time.monotonic() - started > 2 * 6, "the slow stretch outlasted the limit twice"
    assert "has not served" not in output and "killing" not in output
    assert summary(out)["restarts"] == {}
    assert all_tasks_gone(out)


def test_a_worker_slow_to_step_is_never_killed(tmp_path: Path) -> None:
    """Both workers (the chief too) take 2 s per step from their 50th on; the limit is 3.5 s."""
    out = tmp_path / "run"
    started = time.monotonic()
    job = start(
        "run", "backend=numpy", "sync=sync", "train.steps=56", "train.validate_every=0", "train.log_every=1",
        *FAST_FLAGS, "liveness.stall_timeout_s=3.5", f"liveness.interval_s={INTERVAL_S:g}",
        out=out, extra_env=with_failpoint("worker.step@50=sleep2", tmp_path),
    )  # fmt: skip
    output = finished(job)
    assert job.returncode == 0, output
    assert time.monotonic() - started > 2 * 3.5, "the slow stretch outlasted the limit twice"
    assert "has not trained" not in output and "killing" not in output
    assert summary(out)["restarts"] == {}
    assert all_tasks_gone(out)


def test_a_stall_limit_the_ps_would_not_wait_out_is_refused_before_any_task_starts(tmp_path: Path) -> None:
    result = psdk("run", "backend=numpy", "liveness.stall_timeout_s=59", out=tmp_path)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "liveness.stall_timeout_s: a hang is found within liveness.stall_timeout_s + 2 x liveness.interval_s" in text
    assert "= 61 s, which must be shorter than ps.idle_timeout_s (60 s)" in text
    assert not list((tmp_path / "tasks").glob("*.pid"))


@pytest.mark.timeout(300)
def test_on_ray_a_frozen_ps_is_killed_through_its_actor_and_comes_back_as_a_new_one(tmp_path: Path) -> None:
    """The launcher asks the ps's actor, on the ps's node, for its liveness; here the node is this machine."""
    needs_ray()
    out = tmp_path / "run"
    job = start(
        "run", *LOCAL_RAY, "backend=numpy", "train.steps=4000", "train.validate_every=0",
        "checkpoint.every_steps=500", *FAST_FLAGS, *LIVE, out=out,
    )  # fmt: skip
    try:
        wait_for(lambda: len(list((out / "checkpoints").glob("ckpt-*.npz"))) >= 2, job, timeout=120)
        frozen = pid_of(out, "ps0")
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: pid_of(out, "ps0") != frozen, job)
        replaced_s = time.monotonic() - stopped_at
    finally:
        output = finished(job, timeout=240)
    print(f"on Ray, SIGSTOP to a new ps 0: {replaced_s:.2f} s (found within {DETECT_S:g} s, then a new actor)")
    assert job.returncode == 0, output
    assert re.search(r"ps 0 \(on [0-9.]+\) has not served for [0-9.]+ s \(the whole process is stopped;", output)
    assert "restarting it as a new Ray actor (1/3)" in output
    result = summary(out)
    assert result["restarts"] == {f"ps 0 (on {NODE.search(output).group(1)})": 1}  # type: ignore[union-attr]
    assert result["global_step"] == 4000
    assert all_tasks_gone(out)
