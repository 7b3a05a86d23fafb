"""A workload's declared metrics flow through every report, and MNIST's read as before.

A fake click-through workload declares ``auc`` (higher is better, primary)
and ``log_loss`` (lower is better); its runs are written as files (points in
``metrics.jsonl``, ``summary.json``, the config), and the report functions
read them as they read a finished job's: no training needed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from psdk.errors import PluginError
from psdk.jobs.summary import metric_fields
from psdk.launch.progress import JobProgress
from psdk.plugins import builtins, registry
from psdk.plugins.hookspecs import WorkloadRecord
from psdk.plugins.metrics import MetricSpec, primary
from psdk.report.compare import markdown, target_for, write_comparison
from psdk.report.declared import report_target, run_metrics
from psdk.report.metrics import summary_line
from psdk.report.runs import load_run
from psdk.report.tensorboard import TensorBoardSink
from psdk.report.writer import SummaryWriter
from tests.test_report import events
from tests.test_workloads import manager

pytestmark = pytest.mark.timeout(60)

CTR_METRICS = (
    MetricSpec("auc", label="AUC", primary=True, target=0.75),
    MetricSpec("log_loss", higher_is_better=False, format=".3f"),
)
CTR = WorkloadRecord(
    "clicks",  # not "ctr": psdk's own click-through workload has that name
    "a click-through model on generated clicks",
    trainers={"*": "tests.test_workloads:toy_worker"},
    worker="tests.test_workloads:toy_worker",
    evaluate="tests.test_workloads:toy_worker",
    metrics=CTR_METRICS,
)


@pytest.fixture
def ctr_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake workload registered through the hook, beside psdk's own."""
    pm = manager([CTR])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)


def ctr_run(folder: Path, aucs: list[float], losses: list[float], final: dict[str, float], recorded: bool) -> Path:
    """A finished run of the ``ctr`` workload: its points, its summary, its config."""
    folder.mkdir(parents=True)
    points = [
        {
            "task": "worker0",
            "global_step": 10 * (i + 1),
            "time": 1000.0 + i,
            "wall_s": float(i),
            "auc": a,
            "log_loss": b,
        }
        for i, (a, b) in enumerate(zip(aucs, losses, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    summary: dict[str, Any] = {"backend": "numpy", "sync": {"mode": "async"}, "num_workers": 1, "num_ps": 1}
    summary.update({"global_step": 30, "global_steps_per_s": 500.0, "wall_s": 3.0, "model": "ctr"})
    fields = metric_fields(final, CTR_METRICS)
    summary.update(fields if recorded else {"metrics": fields["metrics"]})  # a summary without its specs, too
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.yaml").write_text(OmegaConf.to_yaml({"workload": {"name": "clicks"}, "report": {"target": None}}))
    return folder


def test_the_summary_records_the_final_metrics_the_primary_and_the_specs() -> None:
    fields = metric_fields({"auc": 0.8, "log_loss": 0.45}, CTR_METRICS)
    assert fields["metrics"] == {"auc": 0.8, "log_loss": 0.45} and fields["primary_metric"] == "auc"
    assert run_metrics(fields, None) == CTR_METRICS  # read back without the workload installed
    assert primary(CTR_METRICS[1:]) == CTR_METRICS[1]  # none marked: the first declared


def test_the_last_line_shows_the_declared_metrics_in_their_formats() -> None:
    summary = {"sync": {"mode": "async"}, **metric_fields({"auc": 0.81234, "log_loss": 0.456789}, CTR_METRICS)}
    line = summary_line(summary)
    assert "test AUC 0.8123, test log loss 0.457" in line and "accuracy" not in line
    assert "test AUC n/a" in summary_line({**summary, "metrics": {}})


def test_mnist_summaries_old_and_new_read_as_before() -> None:
    old = {"sync": {"mode": "async"}, "test_accuracy": 0.9731}  # written before summaries had `metrics`
    assert "| test accuracy 0.9731 |" in summary_line(old)
    new = {**old, **metric_fields({"accuracy": 0.9731}, builtins.MNIST_METRICS)}
    new["test_accuracy_by_backend"] = {"numpy": 0.9731, "torch": 0.9702}
    assert "| test accuracy 0.9731 (numpy 0.9731, torch 0.9702) |" in summary_line(new)
    assert "| test accuracy n/a |" in summary_line({"sync": {}})


@pytest.mark.parametrize("recorded", [True, False], ids=["specs-in-summary", "specs-from-the-workload"])
def test_a_comparison_judges_runs_by_the_primary_metric(tmp_path: Path, recorded: bool, ctr_installed: None) -> None:
    ctr_run(tmp_path / "0", [0.6, 0.7, 0.8], [0.7, 0.6, 0.5], {"auc": 0.79, "log_loss": 0.51}, recorded)
    ctr_run(tmp_path / "1", [0.55, 0.6, 0.65], [0.9, 0.8, 0.7], {"auc": 0.66, "log_loss": 0.69}, recorded)
    assert load_run(tmp_path / "0").metrics == CTR_METRICS
    target = target_for(tmp_path, None)
    assert target == pytest.approx(0.75)  # the spec's default: the runs' configs set none
    rows = write_comparison(tmp_path, target, plot=False)
    assert [r["test_auc"] for r in rows] == pytest.approx([0.79, 0.66])
    assert [r["best_val_auc"] for r in rows] == pytest.approx([0.8, 0.65])
    assert rows[0]["time_to_target_s"] == pytest.approx(2.0, abs=1e-6) and rows[0]["step_at_target"] == 30
    assert rows[1]["time_to_target_s"] is None  # never validated at 0.75
    table = (tmp_path / "comparison.md").read_text()
    assert "Target validation AUC: 0.75" in table and "| test AUC | best val AUC |" in table
    assert "| 0.7900 | 0.8000 | 2.0 | 30 |" in table and "accuracy" not in table
    assert (tmp_path / "comparison.csv").read_text().splitlines()[0].startswith("run,status,overrides")
    assert target_for(tmp_path, {"target": 0.6}) == pytest.approx(0.6)  # report.target= wins


def test_a_lower_is_better_primary_is_reached_from_above(tmp_path: Path) -> None:
    specs = (MetricSpec("log_loss", higher_is_better=False, primary=True, format=".3f"),)
    ctr_run(tmp_path / "run", [0.6, 0.7, 0.8], [0.7, 0.6, 0.5], {"auc": 0.79, "log_loss": 0.51}, True)
    summary_path = tmp_path / "run" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(metric_fields(summary["metrics"], specs))
    summary_path.write_text(json.dumps(summary))
    run = load_run(tmp_path / "run")
    assert run.time_to_target(0.6) == (pytest.approx(1.0, abs=1e-6), 20)
    assert run.best_logged(specs[0]) == pytest.approx(0.5)
    rows = write_comparison(tmp_path, 0.6, plot=False)
    assert "validated at or below it" in markdown(rows, 0.6, "t") and rows[0]["best_val_log_loss"] == 0.5


def test_report_target_and_its_mnist_alias() -> None:
    accuracy = primary(builtins.MNIST_METRICS)
    assert accuracy is not None and accuracy.name == "accuracy"
    assert report_target({"target": None, "target_accuracy": None}, accuracy) == pytest.approx(0.97)
    assert report_target({"target": None, "target_accuracy": 0.9}, accuracy) == pytest.approx(0.9)
    assert report_target({"target": 0.95, "target_accuracy": 0.9}, accuracy) == pytest.approx(0.95)
    auc = CTR_METRICS[0]
    assert report_target({"target_accuracy": 0.9}, auc) == pytest.approx(0.75)  # MNIST's name: not the AUC's
    assert report_target({}, auc, default=False) is None


def test_progress_lines_and_tensorboard_tags_name_the_declared_metrics(tmp_path: Path) -> None:
    point = {"task": "worker0", "local_step": 5, "global_step": 9, "time": 1.0, "auc": 0.8, "log_loss": 0.4}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(point) + "\n" + json.dumps({**point, "auc": None}) + "\n")
    progress = JobProgress(tmp_path, num_workers=1, num_ps=0, target=100, metrics=CTR_METRICS)
    progress.update()
    line = progress.worker_line(0)
    assert "| val AUC 0.8000 | val log loss 0.400 |" in line  # the last validated AUC is kept
    mnist = JobProgress(tmp_path, num_workers=1, num_ps=0, target=100)  # the default workload's
    mnist.update()
    assert "| loss - | val acc - |" in mnist.worker_line(0)
    sink = TensorBoardSink(tmp_path / "tb", CTR_METRICS)
    sink.write({"global_step": 9, "auc": 0.8, "log_loss": 0.4, "loss": 1.0, "time": 5.0})
    sink.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = events(path)[1]["scalars"]  # float32 in the event file
    assert scalars == {
        "validation_auc": pytest.approx(0.8, abs=1e-6),
        "validation_log_loss": pytest.approx(0.4, abs=1e-6),
    }


def test_a_scripts_summary_writer_records_declared_metrics_and_draws_them(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as writer:
        for step, (auc, loss) in enumerate([(0.6, 0.7), (0.7, 0.6)]):
            writer.scalars({"auc": auc, "log_loss": loss}, step)
        summary = writer.write_summary(metrics={"auc": 0.7, "log_loss": 0.6, "calls": 3.0}, metric_specs=CTR_METRICS)
    assert summary["metrics"] == {"auc": 0.7, "log_loss": 0.6, "calls": 3.0} and summary["primary_metric"] == "auc"
    assert [s.name for s in run_metrics(summary, None)] == ["auc", "log_loss", "calls"]
    assert "test AUC 0.7000, test log loss 0.600, test calls 3.0000" in summary_line(summary)
    height = int.from_bytes((tmp_path / "curves.png").read_bytes()[20:24], "big")  # the PNG header's
    assert height == 1125  # a row of 3.75 inches (100 dpi) per metric: three rows, from the recorded specs


@pytest.mark.parametrize(
    ("metrics", "problem"),
    [
        ((MetricSpec("auc"), MetricSpec("auc")), "declares a metric twice"),
        ((MetricSpec("auc", primary=True), MetricSpec("log_loss", primary=True)), "marks more than one metric primary"),
        (("auc",), "lists something that is not a psdk.MetricSpec"),
    ],
)
def test_a_workload_whose_metrics_no_report_could_read_is_refused(metrics: tuple[Any, ...], problem: str) -> None:
    with pytest.raises(PluginError, match=f"workload 'clicks' {problem}"):
        dataclasses.replace(CTR, metrics=metrics)
    assert dataclasses.replace(CTR, metrics=list(CTR_METRICS)).metrics == CTR_METRICS  # a list is kept as a tuple
