"""``python -m psdk run workload=ctr``: a short job on the numpy backend learns clicks, its rows pulled per batch."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from psdk.launch.mixed import final_weights
from psdk.testing.jobs import psdk_command, run_job

from .test_ctr import criteo_lines

pytestmark = pytest.mark.timeout(120)

SMALL = [
    "workload=ctr", "backend=numpy", "topology.num_workers=1", "train.batch_size=256", "model.capacity=100000",
    "workload.vocab=10000", "workload.test_size=5000", "train.log_every=50",
]  # fmt: skip


def test_a_short_ctr_job_beats_chance_and_reports_its_table(tmp_path: Path) -> None:
    summary, stdout = run_job(
        tmp_path, *SMALL, "train.steps=200", "workload.validation_size=2000", "train.validate_every=100",
        timeout_s=100,
    )  # fmt: skip
    assert summary["model"] == "dlrm" and summary["optimizer"]["lr"] == 0.3
    metrics = summary["metrics"]
    assert metrics["auc"] > 0.6, metrics  # chance is 0.5; 200 steps reach about 0.66
    assert 0.75 < metrics["best_auc"] < 0.95 and metrics["auc"] < metrics["best_auc"]
    assert metrics["logloss"] < 0.6
    table = summary["tables"]["emb"]
    assert 1000 < table["created"] == table["rows"] <= 100_000 and table["evicted"] == 0
    assert table["bytes_per_row"] >= 2 * 16 * 4  # the row and its Adagrad accumulator at least
    assert "table emb:" in stdout and "created" in stdout
    assert "validation AUC" in stdout
    points = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(p.get("auc") is not None for p in points)
    # psdk evaluate scores the final checkpoint's rows as the job did; params.npz holds no rows: refused
    same = [
        o for o in SMALL if o.split("=")[0] in ("workload", "model.capacity", "workload.vocab", "workload.test_size")
    ]
    evaluate = psdk_command(
        "evaluate", *same, "backend=numpy", f"weights={tmp_path / 'checkpoints'}", out=tmp_path / "e"
    )
    done = subprocess.run(evaluate, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    scored = json.loads((tmp_path / "e" / "evaluation.json").read_text())["metrics"]
    assert scored["auc"] == pytest.approx(metrics["auc"], abs=1e-6), (scored, metrics)
    evaluate[evaluate.index(f"weights={tmp_path / 'checkpoints'}")] = f"weights={tmp_path / 'params.npz'}"
    done = subprocess.run(evaluate, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "holds no embedding tables" in done.stdout + done.stderr


def test_a_ctr_job_trains_on_criteo_files(tmp_path: Path) -> None:
    folder = tmp_path / "criteo"
    folder.mkdir()
    (folder / "day_0").write_text("".join(criteo_lines(1200)))
    summary, _ = run_job(
        tmp_path / "run", *SMALL, f"workload.criteo_dir={folder}", "workload.test_size=100", "train.steps=20",
        "workload.validation_size=0", "train.validate_every=0", timeout_s=100,
    )  # fmt: skip
    assert summary["global_step"] == 20 and "best_auc" not in summary["metrics"]
    assert 0.0 <= summary["metrics"]["auc"] <= 1.0 and summary["tables"]["emb"]["created"] > 0


def test_mnist_models_are_refused_for_ctr(tmp_path: Path) -> None:
    done = subprocess.run(
        psdk_command("run", "workload=ctr", "model=mlp", "backend=numpy", out=tmp_path),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "use model=dlrm" in done.stdout + done.stderr
    done = subprocess.run(
        psdk_command("run", "workload=ctr", "train.overlap=true", "backend=numpy", out=tmp_path / "o"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "train.overlap: is not supported with embedding tables" in done.stdout + done.stderr


def test_table_settings_come_from_the_config_a_preallocated_range_table_on_two_ps(tmp_path: Path) -> None:
    summary, _ = run_job(
        tmp_path, *SMALL, "model.capacity=30000", "topology.num_ps=2", "+tables.emb.sharding=range",
        "+tables.emb.preallocate=true", "train.steps=20", "workload.validation_size=0", "train.validate_every=0",
        timeout_s=100,
    )  # fmt: skip
    table = summary["tables"]["emb"]
    assert table["rows"] == table["created"] == 30_000  # every row made on the ps at init, none by the pulls
    assert sorted(ps["tables"]["emb"]["rows"] for ps in summary["ps"]) == [15_000, 15_000]
    done = subprocess.run(
        psdk_command("run", *SMALL, "train.steps=5", "+tables.users.sharding=range", out=tmp_path / "bad"),
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "tables= names ['users']" in done.stdout + done.stderr


def test_a_mixed_job_with_tables_is_scored_on_other_backends_from_its_checkpoints(tmp_path: Path) -> None:
    """params.npz holds no rows: the launcher's evaluation on the other frameworks reads the final checkpoint."""
    (tmp_path / "summary.json").write_text(json.dumps({"tables": {}}))
    assert final_weights(tmp_path) == tmp_path / "params.npz"  # MNIST: no tables
    (tmp_path / "summary.json").write_text(json.dumps({"tables": {"emb": {"rows": 10}}}))
    assert final_weights(tmp_path) == tmp_path / "params.npz"  # no checkpoints: evaluate says what is missing
    (tmp_path / "checkpoints").mkdir()
    assert final_weights(tmp_path) == tmp_path / "checkpoints"
