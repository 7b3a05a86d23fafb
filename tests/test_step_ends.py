"""``report.step_ends``: each worker keeps its steps' end times in memory and writes them once, at its end.

``python -m psdk bench suite=ctr`` measures psdk's window from them, as the
CTR peers keep theirs, instead of from a log line per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from psdk.bench import window

from .jobs import FAST_FLAGS, psdk

pytestmark = pytest.mark.timeout(120)

JOB = ["run", "backend=numpy", "topology.num_workers=2", "train.steps=40", "train.validate_every=0", *FAST_FLAGS]


def test_each_worker_writes_one_line_of_its_step_ends_when_it_stops(tmp_path: Path) -> None:
    began = time.time()
    done = psdk(*JOB, "report.step_ends=true", out=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "step_ends.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(line["task"] for line in lines) == ["worker0", "worker1"]
    for line in lines:
        worker = summary["workers"][line["task"].removeprefix("worker")]
        assert line["first_local_step"] == 1 and len(line["ends"]) == worker["local_steps"] > 0
        assert line["ends"] == sorted(line["ends"]) and began <= line["ends"][0] and line["ends"][-1] <= time.time()
    ends = window.step_ends(tmp_path / "step_ends.jsonl")
    assert {task: len(times) for task, times in ends.items()} == {line["task"]: len(line["ends"]) for line in lines}


def test_without_it_no_step_ends_are_kept_or_written(tmp_path: Path) -> None:
    done = psdk(*JOB, out=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not (tmp_path / "step_ends.jsonl").exists()
    assert window.step_ends(tmp_path / "step_ends.jsonl") == {}  # the bench then says no step was recorded


def test_a_restarted_workers_lines_are_read_in_local_step_order(tmp_path: Path) -> None:
    path = tmp_path / "step_ends.jsonl"
    path.write_text(
        '{"task": "worker1", "first_local_step": 3, "ends": [30.0, 40.0]}\n'
        '{"task": "worker0", "first_local_step": 1, "ends": [1.0, 2.0]}\n'
        '{"task": "worker1", "first_local_step": 1, "ends": [10.0, 20.0]}\n'
        '{"task": "launcher", "first_local_step": 1, "ends": [5.0]}\n'
    )
    assert window.step_ends(path) == {"worker0": [1.0, 2.0], "worker1": [10.0, 20.0, 30.0, 40.0]}
