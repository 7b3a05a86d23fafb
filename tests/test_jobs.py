"""Real local clusters: ps and workers as processes on 127.0.0.1, on real MNIST (numpy backend)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from psdk.testing import assert_every_worker_contributed

from .conftest import free_port
from .jobs import (
    FAST_FLAGS,
    all_tasks_gone,
    kill_task_when,
    progress_of,
    psdk,
    records,
    start,
    test_accuracy,
    wait_for,
)

pytestmark = pytest.mark.slow
SUMMARY_KEYS = {
    "test_accuracy",
    "global_step",
    "gradients_applied",
    "gradients_dropped",
    "gradients_refused",
    "global_steps_per_s",
    "training_s",
    "wall_s",
    "workers",
}


def check_run(out: Path, result: subprocess.CompletedProcess[str], steps: int) -> dict:
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert summary["global_step"] == steps
    assert 0 < summary["training_s"] < summary["wall_s"]  # the ps's first update to its last
    assert f"(training {summary['training_s']:.1f} s)" in result.stdout.strip().splitlines()[-1]
    # The chief's figure is the accuracy of the final parameters, recomputed here independently.
    assert summary["test_accuracy"] == pytest.approx(test_accuracy(out / "params.npz"), abs=1e-4)
    assert result.stdout.strip().splitlines()[-1].startswith("psdk done:")
    assert (out / "config.yaml").exists() and (out / ".hydra" / "config.yaml").exists()
    tasks = sorted(p.stem for p in (out / "tasks").glob("*.pid"))
    assert "ps0" in tasks and "worker0" in tasks
    for task in tasks:
        # Each task ran on the config the launcher handed it (psdk.launch.handoff), composing none itself.
        handed = json.loads((out / "tasks" / f"{task}.handoff.json").read_text().split("\n", 1)[1])
        assert not (out / "tasks" / task / ".hydra").exists()
        assert yaml.safe_load((out / "tasks" / task / "config.yaml").read_text()) == handed["config"]
    points = records(out)
    assert {"task", "local_step", "global_step", "loss", "accuracy", "time"} <= set(points[0])
    assert any(p["accuracy"] is not None for p in points)
    assert all_tasks_gone(out)
    return summary


def test_async_job_trains_and_every_worker_contributes(tmp_path: Path) -> None:
    """Async workers start when their process is ready, not together (CI once saw worker 0 alone for its first
    quarter of a 600-step job): each worker's share is judged over the steps trained once both were training."""
    steps = 2000
    result = psdk("run", "backend=numpy", f"train.steps={steps}", "train.validate_every=500", *FAST_FLAGS, out=tmp_path)
    summary = check_run(tmp_path, result, steps)
    assert summary["test_accuracy"] > 0.9
    assert summary["gradients_applied"] == steps and summary["gradients_dropped"] == 0
    assert_every_worker_contributed(summary, tmp_path / "metrics.jsonl")
    assert all(summary["workers"][worker]["status"] == "finished" for worker in ("0", "1"))
    assert "validation accuracy" in result.stdout
    # The job's epochs, from the global step: 2,000 steps of 550 batches an epoch reach 3.64.
    assert re.search(r"worker 1: epoch [0-3]\.\d\d, global step", result.stdout), result.stdout
    assert summary["epochs"] == pytest.approx(steps / 550, abs=1e-4) and summary["batches_per_epoch"] == 550


def test_every_worker_logs_its_final_test_accuracy(tmp_path: Path) -> None:
    """As each TensorFlow 1.x worker printed one: the chief of the final parameters, the others of their last pull."""
    steps = 300
    result = psdk(
        "run", "backend=numpy", f"train.steps={steps}", "topology.num_workers=3", "train.validate_every=100",
        *FAST_FLAGS, out=tmp_path,
    )  # fmt: skip
    summary = check_run(tmp_path, result, steps)
    chief = re.search(r"worker 0: test accuracy (\d\.\d{4}) of the final parameters", result.stdout)
    assert chief is not None and float(chief.group(1)) == pytest.approx(summary["test_accuracy"], abs=1e-4)
    assert summary["workers"]["0"]["test_accuracy"] == summary["test_accuracy"]
    for worker in ("1", "2"):
        line = rf"worker {worker}: test accuracy (\d\.\d{{4}}) of the parameters it pulled last \(global step (\d+)\)"
        found = re.search(line, result.stdout)
        assert found is not None, result.stdout
        figure = summary["workers"][worker]["test_accuracy"]
        assert float(found.group(1)) == pytest.approx(figure, abs=1e-4) and figure > 0.5  # chance is 0.1
        assert 0 < int(found.group(2)) <= steps


def test_a_run_folder_used_before_is_run_in_again(tmp_path: Path) -> None:
    """The earlier run's files (the ps's announced address among them) must not mislead the next."""
    for _ in range(2):
        result = psdk(
            "run", "backend=numpy", "train.steps=100", "train.validate_every=50", *FAST_FLAGS, out=tmp_path, timeout=120
        )
        check_run(tmp_path, result, 100)


def test_overlap_pushes_each_gradient_with_the_parameters_it_was_computed_from(tmp_path: Path) -> None:
    """One worker, so every staleness is its own doing: 0 in lockstep, 1 when it computes during its push."""
    staleness = {}
    for overlap in ("false", "true"):
        out = tmp_path / overlap
        result = psdk(
            "run", "backend=numpy", "topology.num_workers=1", "train.steps=300", "train.validate_every=100",
            f"train.overlap={overlap}", *FAST_FLAGS, out=out,
        )  # fmt: skip
        summary = check_run(out, result, 300)
        assert summary["test_accuracy"] > 0.85
        assert summary["gradients_applied"] == 300 and summary["gradients_dropped"] == 0
        staleness[overlap] = summary["workers"]["0"]["staleness_histogram"]
        timing = summary["workers"]["0"]["time_per_step"]
        assert timing["compute_ms"] > 0 and timing["compute_cpu_ms"] > 0 and timing["wait_ms"] > 0
    assert staleness["false"] == {"0": 300}
    # The first push goes before any reply came back; every later one was computed a step behind.
    assert staleness["true"] == {"0": 1, "1": 299}


def test_sync_job_over_two_ps_shards(tmp_path: Path) -> None:
    result = psdk(
        "run",
        "backend=numpy",
        "sync=sync",
        "topology.num_ps=2",
        "train.steps=300",
        "train.validate_every=100",
        *FAST_FLAGS,
        out=tmp_path,
    )
    summary = check_run(tmp_path, result, 300)
    assert summary["gradients_applied"] == 600 and summary["gradients_dropped"] == 0
    assert [ps["version"] for ps in summary["ps"]] == [300, 300]
    assert summary["test_accuracy"] > 0.88


def test_per_task_mode_as_in_tensorflow_1(tmp_path: Path) -> None:
    port = free_port()
    made = psdk("keys", f"keys_dir={tmp_path / 'keys'}", "workers=2")
    assert made.returncode == 0, made.stderr
    hosts = ["--ps_hosts", f"127.0.0.1:{port}", "--worker_hosts=localhost:0,localhost:0"]
    common = [*hosts, "backend=numpy", "train.steps=200", f"transport.keys_dir={tmp_path / 'keys'}", *FAST_FLAGS]
    ps = start("ps", "--task_index=0", *common, out=tmp_path / "ps")
    workers = [start("task", "--job_name=worker", f"--task_index={i}", *common, out=tmp_path / f"w{i}") for i in (1, 0)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in (*workers, ps)]
    finally:
        for p in (*workers, ps):
            p.kill()
    assert [p.returncode for p in (*workers, ps)] == [0, 0, 0], "\n".join(outputs)
    summary = json.loads((tmp_path / "w0" / "summary.json").read_text())
    assert summary["global_step"] == 200 and summary["num_workers"] == 2
    assert outputs[1].strip().splitlines()[-1].startswith("psdk done:")
    assert "CURVE on: 2 worker key(s) accepted" in outputs[2]


def test_a_dead_worker_in_async_mode_is_reported_and_the_job_goes_on(tmp_path: Path) -> None:
    job = start(
        "run",
        "backend=numpy",
        "train.steps=3000",
        "train.validate_every=0",
        "recovery.enabled=false",
        *FAST_FLAGS,
        out=tmp_path,
    )
    # At its first logged point (local step 20): a worker 1 that starts a second late still gets there.
    output = kill_task_when(job, tmp_path, "worker1", lambda: progress_of(tmp_path, "worker1") >= 20, timeout=90)
    assert job.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 3000
    assert summary["workers"]["1"]["status"] == "dead" and "heartbeat" in summary["workers"]["1"]["reason"]
    assert "worker 1 was killed by SIGKILL" in output
    assert all_tasks_gone(tmp_path)


def test_a_dead_worker_that_sync_cannot_spare_stops_the_job_naming_it(tmp_path: Path) -> None:
    job = start(
        "run",
        "backend=numpy",
        "sync=sync",
        "train.steps=5000",
        "train.validate_every=0",
        "recovery.enabled=false",
        *FAST_FLAGS,
        out=tmp_path,
    )
    output = kill_task_when(job, tmp_path, "worker1", lambda: progress_of(tmp_path, "worker1") >= 40, timeout=90)
    assert job.returncode != 0
    assert "replicas_to_aggregate=2" in output and "worker 1 is dead" in output
    assert "the chief (worker 0) exited with code 1" in output
    assert all_tasks_gone(tmp_path)


@pytest.mark.parametrize(
    "victim, message",
    [("worker0", "the chief (worker 0) was killed by SIGKILL"), ("ps0", "ps 0 was killed by SIGKILL")],
)
def test_a_dead_chief_or_ps_stops_the_job_with_an_error_naming_it(tmp_path: Path, victim: str, message: str) -> None:
    job = start(
        "run",
        "backend=numpy",
        "train.steps=5000",
        "train.validate_every=0",
        "recovery.enabled=false",
        *FAST_FLAGS,
        out=tmp_path,
    )
    output = kill_task_when(job, tmp_path, victim, lambda: progress_of(tmp_path, "worker0") >= 60, timeout=60)
    assert job.returncode != 0 and message in output
    assert all_tasks_gone(tmp_path)


def test_ctrl_c_leaves_no_task_behind(tmp_path: Path) -> None:
    job = start("run", "backend=numpy", "train.steps=20000", "train.validate_every=0", *FAST_FLAGS, out=tmp_path)
    try:
        wait_for(lambda: progress_of(tmp_path, "worker1") >= 20, job)
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode != 0
    assert all_tasks_gone(tmp_path)


def test_a_killed_launcher_takes_its_tasks_with_it(tmp_path: Path) -> None:
    job = start("run", "backend=numpy", "train.steps=20000", "train.validate_every=0", *FAST_FLAGS, out=tmp_path)
    try:
        wait_for(lambda: progress_of(tmp_path, "worker1") >= 20, job)
        job.kill()
        job.communicate(timeout=30)
    finally:
        job.kill()
    assert all_tasks_gone(tmp_path, timeout=10)


def test_a_job_resumes_from_its_checkpoint_with_another_number_of_ps(tmp_path: Path) -> None:
    first = psdk("run", "backend=numpy", "optimizer=adam", "train.steps=300", *FAST_FLAGS, out=tmp_path / "a")
    assert first.returncode == 0, first.stdout + first.stderr
    saved = next((tmp_path / "a" / "checkpoints").glob("ckpt-*-300.npz"))
    second = psdk(
        "run",
        "backend=numpy",
        "optimizer=adam",
        "train.steps=500",
        "topology.num_ps=2",
        f"resume={saved}",
        *FAST_FLAGS,
        out=tmp_path / "b",
    )
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert second.returncode == 0 and summary["global_step"] == 500 and summary["resumed_from"] == str(saved)
    assert summary["gradients_applied"] == 200  # only the steps after the checkpoint
    assert min(r["global_step"] for r in records(tmp_path / "b")) > 300
    assert "resumed from" in second.stdout
    assert summary["test_accuracy"] > json.loads((tmp_path / "a" / "summary.json").read_text())["test_accuracy"] - 0.02


def test_the_default_job_authenticates_and_encrypts_on_one_host(tmp_path: Path) -> None:
    """No host names decide it: `run` makes a fresh key set per run, one keypair per task."""
    for run in ("first", "again"):  # the same folder twice: the run's keys are made anew
        result = psdk("run", "backend=numpy", "train.steps=200", "train.validate_every=50", *FAST_FLAGS, out=tmp_path)
        summary = check_run(tmp_path, result, 200)
        assert "CURVE on" in result.stdout, run
        assert summary["gradients_applied"] == 200
    keys = tmp_path / "keys"
    assert sorted(p.name for p in keys.rglob("*_secret")) == [
        "ps-0.key_secret",
        "worker-0.key_secret",
        "worker-1.key_secret",
    ]
    assert all(p.stat().st_mode & 0o077 == 0 for p in keys.rglob("*_secret"))


def test_curve_off_takes_an_explicit_setting_and_the_ps_says_what_it_exposes(tmp_path: Path) -> None:
    result = psdk(
        "run", "backend=numpy", "train.steps=100", "train.validate_every=50", "transport.secure=false", *FAST_FLAGS,
        out=tmp_path,
    )  # fmt: skip
    check_run(tmp_path, result, 100)
    ps_log = (tmp_path / "tasks" / "ps0" / "ps0.log").read_text()
    assert "CURVE is off (transport.secure=false): anyone who can reach" in ps_log
    assert "can read the parameters, push gradients, take any worker's id" in ps_log
    assert not (tmp_path / "keys").exists()


@pytest.mark.parametrize(
    "overlap",
    [[], ["train.overlap=true", "optimizer=sgd"]],  # overlap adds staleness, which wants no momentum
    ids=["lockstep", "overlap"],
)
def test_a_killed_ps_is_restarted_and_restored_from_the_last_checkpoint(tmp_path: Path, overlap: list[str]) -> None:
    job = start(
        "run",
        "backend=numpy",
        "topology.num_ps=2",
        "train.steps=4000",
        "train.validate_every=0",
        *overlap,
        "checkpoint.every_steps=500",
        *FAST_FLAGS,
        out=tmp_path,
    )
    checkpoints = tmp_path / "checkpoints"

    def second_checkpoint() -> bool:  # measured progress, not a sleep
        return bool(list(checkpoints.glob("ckpt-*-1000.npz"))) or len(list(checkpoints.glob("ckpt-*.npz"))) >= 2

    output = kill_task_when(job, tmp_path, "ps1", second_checkpoint, timeout=120)
    assert job.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 4000 and summary["restarts"] == {"ps 1": 1}
    (recovery,) = summary["recoveries"]
    assert recovery["lost_steps"] <= 500 + 2 * 2  # one checkpoint interval, plus pushes in flight
    assert "restarting it (1/3)" in output and "restored every shard" in output
    assert summary["test_accuracy"] > 0.9
    assert all_tasks_gone(tmp_path)


def test_a_killed_worker_is_restarted_and_rejoins(tmp_path: Path) -> None:
    """Sync mode, so the job cannot end without it: the ps holds the round until worker 1 is back. (In async,
    worker 0 can finish the job alone while the restarted worker waits out the ps's heartbeat timeout and its
    own start-up: CI saw the new worker 1 "dead" at the end of a 3000-step job.)"""
    job = start(
        "run", "backend=numpy", "sync=sync", "train.steps=2000", "train.validate_every=0", *FAST_FLAGS, out=tmp_path
    )
    output = kill_task_when(job, tmp_path, "worker1", lambda: progress_of(tmp_path, "worker1") >= 100, timeout=120)
    assert job.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == {"worker 1": 1} and summary["workers"]["1"]["status"] == "finished"
    assert "for worker 1 to come back" in output and "back on a new connection" in output
    assert summary["global_step"] == 2000 and summary["gradients_applied"] == 4000
    assert all_tasks_gone(tmp_path)


def test_a_killed_worker_in_sync_mode_with_a_backup_is_not_missed(tmp_path: Path) -> None:
    job = start(
        "run",
        "backend=numpy",
        "sync=sync",
        "sync.replicas_to_aggregate=2",
        "topology.num_workers=3",
        "train.steps=2000",  # worker 2 may start a second after the others; 600 steps took ~1.3 s
        "train.validate_every=100",
        "recovery.enabled=false",
        *FAST_FLAGS,
        out=tmp_path,
    )
    output = kill_task_when(job, tmp_path, "worker2", lambda: progress_of(tmp_path, "worker2") >= 40, timeout=120)
    assert job.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 2000 and summary["workers"]["2"]["status"] == "dead"
    assert summary["test_accuracy"] > 0.9
