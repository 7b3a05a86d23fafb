"""The launcher's progress display: reading the tasks' files, drawing the lines, and a real run in plain mode."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from psdk.errors import ConfigError
from psdk.launch.progress import (
    JobProgress,
    JsonlTail,
    LiveDisplay,
    PlainDisplay,
    ProgressMonitor,
    ps_progress_path,
    resolve_mode,
)

from .jobs import FAST_FLAGS, psdk


def point(task: int, local: int, global_step: int, loss: float, accuracy: float | None = None) -> dict:
    return {
        "task": f"worker{task}",
        "local_step": local,
        "global_step": global_step,
        "loss": loss,
        "accuracy": accuracy,
        "steps_per_s": 250.0,
        "time": 1.0,
    }


def append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_tail_keeps_partial_lines_skips_garbage_and_survives_missing_and_replaced_files(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not written yet
    line = json.dumps(point(0, 1, 1, 2.0))
    append(path, line[:10])
    assert tail.read() == []  # half a line: nothing yet
    append(path, line[10:] + "\n{not json\n")
    assert [p["loss"] for p in tail.read()] == [2.0]
    assert tail.read() == []
    path.write_text(json.dumps(point(1, 5, 5, 1.0)) + "\n")  # replaced by a shorter file: read from its start
    assert [p["task"] for p in tail.read()] == ["worker1"]
    path.unlink()
    assert tail.read() == []


def test_lines_show_each_worker_and_ps_and_keep_the_last_validation_accuracy(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    progress = JobProgress(tmp_path, num_workers=2, num_ps=1, target=600)
    progress.update()
    assert progress.lines() == ["worker 0: starting", "worker 1: starting", "ps 0: starting"]
    metrics = tmp_path / "metrics.jsonl"
    append(metrics, json.dumps(point(0, 100, 190, 0.5, 0.91)) + "\n" + json.dumps(point(0, 120, 230, 0.25)) + "\n")
    ps_progress_path(tmp_path, 0).write_text(json.dumps({"version": 231, "target": 600, "applied": 231, "dropped": 3}))
    progress.update()
    worker0, worker1, ps0 = progress.lines()
    assert re.fullmatch(
        r"worker 0: step +120 \| global step +230/600 \| loss 0\.2500 \| val acc 0\.9100 \| 250 steps/s", worker0
    )
    assert worker1 == "worker 1: starting"
    assert re.fullmatch(r"ps 0: global step +231/600 \| gradients applied 231 \| dropped 3", ps0)
    ps_progress_path(tmp_path, 0).write_text('{"version": 2')  # caught mid-rewrite: the last good counters stay
    progress.update()
    assert progress.lines()[2] == ps0


def test_live_display_redraws_its_block_in_place_and_passes_other_output_above_it(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    ps_progress_path(tmp_path, 0).write_text(json.dumps({"version": 300, "target": 600, "applied": 300, "dropped": 0}))
    progress = JobProgress(tmp_path, num_workers=1, num_ps=1, target=600)
    progress.update()
    out = io.StringIO()
    display = LiveDisplay(progress, out)
    display.render()
    first = out.getvalue()
    assert first.startswith("worker 0: starting\nps 0:  50%|") and "300/600" in first and first.count("\n") == 2
    display.emit("a warning from a task\n")
    display.render()
    text = out.getvalue()[len(first) :]
    # Each redraw moves up over the two lines drawn before and clears to the end of the screen.
    assert text.startswith("\x1b[2F\x1b[Ja warning from a task\nworker 0: starting\n")
    assert text.count("\x1b[2F\x1b[J") == 2


def test_modes(tmp_path: Path) -> None:
    assert resolve_mode("auto", io.StringIO()) == "plain"  # not a terminal
    assert resolve_mode("live", io.StringIO()) == "live"
    assert resolve_mode("off", io.StringIO()) == "off"
    with pytest.raises(ConfigError, match=r"progress\.mode"):
        resolve_mode("fancy", io.StringIO())


def test_monitor_prints_a_final_block_on_stop(tmp_path: Path) -> None:
    append(tmp_path / "metrics.jsonl", json.dumps(point(0, 10, 10, 0.5)) + "\n")
    out = io.StringIO()
    monitor = ProgressMonitor(PlainDisplay(JobProgress(tmp_path, 1, 0, 10), out, every_s=60)).start()
    monitor.stop()
    assert re.fullmatch(r"progress +[\d.]+s worker 0: step +10 \| global step +10/10 .*\n", out.getvalue())


@pytest.mark.slow
def test_plain_progress_lines_during_a_real_run(tmp_path: Path) -> None:
    result = psdk(
        "run",
        "backend=numpy",
        "train.steps=2000",
        "train.validate_every=200",
        "progress.mode=plain",
        "progress.every_s=0.1",  # the ps's counters follow (every 0.1 s): the ~1 s job gets lines mid-run
        "report.plot=false",
        *FAST_FLAGS,
        out=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("psdk done:")  # the job's last line is still the summary
    progress = [line for line in lines if line.startswith("progress ")]
    # The final block, printed when the chief has finished: every worker and the ps at the target.
    worker0, worker1, ps0 = (re.sub(r"^progress +[\d.]+s ", "", line) for line in progress[-3:])
    for worker in (worker0, worker1):
        assert re.match(r"worker \d: step +\d+ \| global step +2000/2000 \| loss \d\.\d{4} \| val acc 0\.\d{4}", worker)
    assert re.fullmatch(r"ps 0: global step +2000/2000 \| gradients applied 2000 \| dropped 0", ps0)
    # ... and lines while it trained, with the global step in between.
    steps = {int(m.group(1)) for line in progress if (m := re.search(r"ps 0: global step +(\d+)/", line))}
    assert any(0 < s < 2000 for s in steps), progress
    assert (tmp_path / "tasks" / "ps0.progress.json").is_file()


def test_progress_off_prints_no_progress_lines(tmp_path: Path) -> None:
    result = psdk(
        "run", "backend=numpy", "train.steps=100", "progress.mode=off", "report.plot=false", *FAST_FLAGS, out=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [line for line in result.stdout.splitlines() if line.startswith("progress ")]
    assert result.stdout.strip().splitlines()[-1].startswith("psdk done:")
