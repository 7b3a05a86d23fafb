"""What runs write for people: curves.png, TensorBoard event files, a multirun's comparison, `psdk report`."""

from __future__ import annotations

import csv
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from psdk.report.tensorboard import TensorBoardSink, crc32c

from .conftest import REPO
from .jobs import FAST_FLAGS, env, psdk

SHORT = ["backend=numpy", "train.steps=200", "train.validate_every=50", *FAST_FLAGS]


# ------------------------------------------------------------------ PNG and event-file readers
def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def check_png(path: Path, min_bytes: int = 10_000) -> None:
    width, height = png_size(path)
    assert 600 <= width <= 3000 and 300 <= height <= 2000, (width, height)
    assert path.stat().st_size > min_bytes  # drawn curves, not an empty canvas


def masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_records(path: Path) -> list[bytes]:
    """The payloads of a TFRecord file, checking each length and data CRC as TensorBoard does."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert length_crc == masked(crc32c(header))
        payload = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert data_crc == masked(crc32c(payload)) and len(payload) == length
        out.append(payload)
        pos += 16 + length
    return out


def varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def proto_fields(data: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of a protocol buffer message: varint, fixed64, bytes and fixed32 fields."""
    pos, out = 0, []
    while pos < len(data):
        key, pos = varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            length, pos = varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise AssertionError(f"wire type {wire}")
        out.append((number, value))
    return out


def events(path: Path) -> list[dict[str, Any]]:
    """Each ``Event`` as {wall_time, step, file_version | scalars}, decoded by the proto field numbers."""
    decoded = []
    for payload in tf_records(path):
        fields = dict(proto_fields(payload))
        event: dict[str, Any] = {"wall_time": struct.unpack("<d", fields[1])[0], "step": fields.get(2, 0)}
        if 3 in fields:
            event["file_version"] = fields[3].decode()
        if 5 in fields:
            scalars = {}
            for number, value in proto_fields(fields[5]):
                assert number == 1  # Summary.value
                entry = dict(proto_fields(value))
                scalars[entry[1].decode()] = struct.unpack("<f", entry[2])[0]
            event["scalars"] = scalars
        decoded.append(event)
    return decoded


# ------------------------------------------------------------------ TensorBoard event files
def test_crc32c_matches_the_standard_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert crc32c(b"") == 0


def test_event_file_holds_a_version_record_then_one_scalar_event_per_point(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.write({"global_step": 20, "loss": 0.5, "accuracy": None, "steps_per_s": 100.0, "time": 1000.25})
    sink.write({"global_step": 40, "loss": 0.25, "accuracy": 0.875, "time": 1001.5})
    sink.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    first, second, third = events(path)
    assert first["file_version"] == "brain.Event:2"
    assert second == {"wall_time": 1000.25, "step": 20, "scalars": {"loss": 0.5, "local_steps_per_s": 100.0}}
    assert third == {"wall_time": 1001.5, "step": 40, "scalars": {"loss": 0.25, "validation_accuracy": 0.875}}


# ------------------------------------------------------------------ a run: curves.png, TensorBoard, `psdk report`
@pytest.mark.slow
def test_run_writes_curves_and_tensorboard_files_and_report_rebuilds_the_curves(tmp_path: Path) -> None:
    result = psdk("run", *SHORT, "report.tensorboard=true", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("psdk done:")
    check_png(tmp_path / "curves.png")
    points = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for worker in ("worker0", "worker1"):
        (path,) = (tmp_path / "tensorboard" / worker).glob("events.out.tfevents.*")
        logged = [e for e in events(path) if "scalars" in e]
        mine = [p for p in points if p["task"] == worker]
        assert [e["step"] for e in logged] == [p["global_step"] for p in mine]
        # the same numbers rounded to float32 by the event file: a relative error, so rel= alone
        assert [e["scalars"]["loss"] for e in logged] == pytest.approx([p["loss"] for p in mine], rel=1e-6)
        accuracies = [e["scalars"].get("validation_accuracy") for e in logged]
        assert [a for a in accuracies if a is not None] == pytest.approx(
            [p["accuracy"] for p in mine if p["accuracy"] is not None], rel=1e-6
        )

    (tmp_path / "curves.png").unlink()
    rebuilt = psdk("report", str(tmp_path))
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    check_png(tmp_path / "curves.png")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert f"| {summary['test_accuracy']:.4f} |" in rebuilt.stdout and "| finished |" in rebuilt.stdout
    assert rebuilt.stdout.strip().splitlines()[-1].startswith("psdk done:")


# ------------------------------------------------------------------ multiruns: the comparison
def multirun(sweep: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psdk", "run", "-m", *args, f"hydra.sweep.dir={sweep}"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env(),
        cwd=REPO,
    )


def comparison_rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "comparison.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_multirun_ends_with_a_comparison_and_report_rebuilds_it_with_failed_and_unfinished_runs(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep"
    result = multirun(sweep, *SHORT, "sync=sync,async", "report.target_accuracy=0.8")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = comparison_rows(sweep)
    assert [(r["run"], r["status"], r["backend"], r["sync"], r["workers"]) for r in rows] == [
        ("0", "finished", "numpy", "sync(2)", "2"),
        ("1", "finished", "numpy", "async", "2"),
    ]
    for number, r in enumerate(rows):
        summary = json.loads((sweep / str(number) / "summary.json").read_text())
        # the CSV holds the summary's own numbers, written with repr(): pytest.approx's defaults suffice
        assert float(r["test_accuracy"]) == pytest.approx(summary["test_accuracy"])
        assert float(r["steps_per_s"]) == pytest.approx(summary["global_steps_per_s"])
        assert float(r["wall_s"]) == pytest.approx(summary["wall_s"])
        assert 0 < float(r["time_to_target_s"]) < float(r["wall_s"])  # 0.8 is reached in 200 steps
        assert "sync=sync" in r["overrides"] if number == 0 else "sync=async" in r["overrides"]
        check_png(sweep / str(number) / "curves.png")
    check_png(sweep / "comparison.png")
    markdown = (sweep / "comparison.md").read_text()
    assert markdown.count("| finished |") == 2 and "Target validation accuracy: 0.8" in markdown

    # One run failed (recorded why), one never finished (killed: no summary, no record): both still listed.
    shutil.copytree(sweep / "1", sweep / "2")
    (sweep / "2" / "summary.json").unlink()
    (sweep / "2" / "failed.json").write_text(json.dumps({"error": "ps 0 exited with code 1"}))
    shutil.copytree(sweep / "1", sweep / "3")
    (sweep / "3" / "summary.json").unlink()
    with (sweep / "3" / "metrics.jsonl").open("a") as f:
        f.write('{"task": "worker0", "glo')  # killed mid-line
    for name in ("comparison.csv", "comparison.md", "comparison.png"):
        (sweep / name).unlink()
    report = psdk("report", str(sweep), "target_accuracy=0.999")
    assert report.returncode == 1, report.stdout + report.stderr  # not every run finished
    rows = comparison_rows(sweep)
    assert [(r["run"], r["status"]) for r in rows] == [
        ("0", "finished"),
        ("1", "finished"),
        ("2", "failed"),
        ("3", "unfinished"),
    ]
    assert rows[2]["sync"] == "async" and rows[2]["test_accuracy"] == ""  # from its config; no figures
    assert all(r["time_to_target_s"] == "" for r in rows)  # 0.999 is never reached
    assert "- 2: ps 0 exited with code 1" in (sweep / "comparison.md").read_text()
    check_png(sweep / "comparison.png")


@pytest.mark.slow
def test_a_failing_run_does_not_stop_the_sweep_and_is_reported_as_failed(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = multirun(sweep, "backend=numpy", "train.batch_size=100,100000", "train.steps=100", *FAST_FLAGS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 run(s) of the multirun failed" in result.stdout
    rows = comparison_rows(sweep)
    assert [(r["run"], r["status"]) for r in rows] == [("0", "finished"), ("1", "failed")]
    assert "train.batch_size" in json.loads((sweep / "1" / "failed.json").read_text())["error"]
    check_png(sweep / "comparison.png")


def test_report_refuses_a_folder_without_runs(tmp_path: Path) -> None:
    result = psdk("report", str(tmp_path))
    assert result.returncode == 2 and "no runs" in result.stderr
