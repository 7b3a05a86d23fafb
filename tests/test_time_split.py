"""Where a job's time goes: ``summary.json``'s ``time_split``, per step on the workers and per push on each ps."""

from __future__ import annotations

from pathlib import Path

import pytest

from psdk.jobs.timesplit import job_split, split_line, worker_split
from psdk.testing.jobs import run_job

PARTS = ("generation_ms", "lookup_ms", "compute_ms", "wire_ms", "other_ms")


@pytest.mark.timeout(120)
def test_a_short_ctr_job_reports_where_its_steps_and_pushes_go(tmp_path: Path) -> None:
    summary, stdout = run_job(
        tmp_path, "workload=ctr", "backend=numpy", "topology.num_ps=2", "train.steps=30", "train.batch_size=128",
        "model.capacity=50000", "workload.vocab=10000", "workload.test_size=1000", "train.log_every=0",
        timeout_s=100,
    )  # fmt: skip
    split = summary["time_split"]
    worker, ps = split["worker"], split["ps"]
    assert worker["steps"] == sum(w["local_steps"] for w in summary["workers"].values()) > 0
    assert all(worker[part] >= 0 for part in PARTS), worker
    assert worker["compute_ms"] > 0 and worker["wire_ms"] > 0 and worker["lookup_ms"] > 0
    assert sum(worker[p] for p in PARTS if p != "other_ms") <= worker["step_ms"] + 0.01, worker
    assert sum(worker[p] for p in PARTS) == pytest.approx(worker["step_ms"], abs=0.01)
    for entry in summary["workers"].values():  # each worker's own figures too
        own = entry["time_split"]
        assert sum(own[p] for p in PARTS if p != "other_ms") <= own["step_ms"] + 0.01, own
    # Every push reaches both ps (each holds part of the table): each counts it, and times its index and rule.
    assert ps["pushes"] == sum(p["time_per_push"]["pushes"] for p in summary["ps"]) >= 2 * 30
    assert ps["index_ms"] > 0 and ps["rule_ms"] > 0
    assert all(p["time_per_push"]["index_ms"] >= 0 and p["time_per_push"]["rule_ms"] >= 0 for p in summary["ps"])
    assert "where a step's time goes (ms per step, workers' mean): generation" in stdout


def test_a_workers_split_accounts_the_rest_of_its_loop_as_other() -> None:
    split = worker_split({"loop": 1.0, "generation": 0.1, "lookup": 0.05, "compute": 0.5, "wire": 0.25}, 100)
    assert split == {"steps": 100, "generation_ms": 1.0, "lookup_ms": 0.5, "compute_ms": 5.0, "wire_ms": 2.5,
                     "other_ms": 1.0, "step_ms": 10.0}  # fmt: skip
    assert worker_split({}, 0) == {"steps": 0}


def test_the_jobs_split_weighs_each_task_by_its_steps_and_pushes() -> None:
    workers = {
        "0": {"time_split": worker_split({"loop": 3.0, "compute": 1.0}, 300)},
        "1": {"time_split": worker_split({"loop": 1.0, "compute": 0.8}, 100)},
        "2": {"time_split": {"steps": 0}},  # a worker that never stepped weighs nothing
    }
    shards = [{"time_per_push": {"pushes": 10, "index_ms": 1.0, "rule_ms": 3.0}}, {}]
    split = job_split(workers, shards)
    assert split["worker"]["steps"] == 400
    assert split["worker"]["step_ms"] == pytest.approx(10.0) and split["worker"]["compute_ms"] == pytest.approx(4.5)
    assert split["ps"] == {"pushes": 10, "index_ms": 1.0, "rule_ms": 3.0}
    assert "compute 4.50" in split_line(split) and "rule 3.00" in split_line(split)
    assert split_line(job_split({}, [])).endswith("index n/a, rule n/a")
