"""``python -m psdk bench suite=ctr``: psdk measured as the CTR peers measure themselves, and the table's ratios."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from psdk.bench import ctr, window
from psdk.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

TINY = [
    "suite=ctr", "reps=1", "ctr.peers=[]", "ctr.backends=[numpy]", "ctr.steps=40", "ctr.warmup=10",
    "ctr.batch_size=256", "ctr.capacity=50000", "ctr.vocab=10000", "ctr.test_size=2000", "timeout_s=120",
]  # fmt: skip


def recipe(**extra: object) -> DictConfig:
    """A ``ctr:`` block with every recipe key (all 1) and no overrides, for building commands."""
    keys = ("vocab", "test_size", "capacity", "dim", "lr", "init_acc", "steps", "batch_size", "workers", "num_ps")
    return OmegaConf.create({"psdk_overrides": [], **dict.fromkeys(keys, 1), **extra})


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One real psdk-only CTR suite: 2 ps, 2 async numpy workers, 40 steps."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "psdk", "bench", *TINY, f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


def test_psdk_is_measured_over_the_window_with_every_process_of_its_job(tiny_suite: tuple[dict, str]) -> None:
    report, text = tiny_suite
    (run,) = report["runs"]["psdk-numpy"]
    assert run["error"] is None, run
    assert run["examples"] == 40 * 256  # trained by the job (the window's own count: the test below)
    # An AUC was scored (40 async steps at lr 0.3 can end below 0.5: the recipe's early steps are unstable)
    assert run["examples_per_s"] > 0 and 0.3 < run["test_auc"] < run["best_auc"] < 1
    assert set(run["cpu_split"]) == {"launcher", "ps0", "ps1", "worker0", "worker1"}, run["cpu_split"]
    assert run["cpu_s_per_1k_examples"] == pytest.approx(sum(run["cpu_split"].values()), abs=1e-3)
    assert run["cpu_split"]["worker0"] > 0 and run["ps_max_rss_mb"] > 0
    assert "worker0 compute_cpu_ms" in run["time_split"]  # the workers' own split, from summary.json
    assert "| psdk-numpy |" in text and "### Targets (psdk)" in text and "ps0 " in text


def test_psdk_also_runs_without_curve_as_the_peers_do(tiny_suite: tuple[dict, str]) -> None:
    """``ctr.plaintext`` (on by default): a second psdk row with transport.secure=false, its targets too."""
    report, text = tiny_suite
    (run,) = report["runs"]["psdk-numpy-plaintext"]
    assert run["error"] is None and run["cpu_s_per_1k_examples"] > 0, run
    assert "| psdk-numpy-plaintext |" in text and "- psdk-numpy-plaintext: CPU per example" in text
    ctr_cfg = recipe()
    assert "transport.secure=false" in ctr.psdk_command(ctr_cfg, "numpy", 0, "/tmp/x", plaintext=True)
    assert "transport.secure=false" not in ctr.psdk_command(ctr_cfg, "numpy", 0, "/tmp/x")


def test_psdk_preallocates_its_table_as_the_peers_do_and_also_runs_it_lazy(tiny_suite: tuple[dict, str]) -> None:
    """``ctr.preallocate`` (on by default): every row made at init; ``ctr.lazy``: a third row, rows on first pull."""
    report, text = tiny_suite
    (whole,) = report["runs"]["psdk-numpy"]
    (lazy,) = report["runs"]["psdk-numpy-lazy"]
    assert whole["error"] is None and lazy["error"] is None, (whole, lazy)
    assert whole["table_rows"] == 50000  # ctr.capacity: all of them, made on the ps at init
    assert 0 < lazy["table_rows"] < 50000  # 40 batches of 256 x 26 Zipf ids touch fewer
    assert "| psdk-numpy-lazy |" in text and "on 2 ps (psdk's preallocated)" in text
    ctr_cfg = recipe(preallocate=True)
    assert "+tables.emb.preallocate=true" in ctr.psdk_command(ctr_cfg, "numpy", 0, "/tmp/x")
    assert "+tables.emb.preallocate=true" not in ctr.psdk_command(ctr_cfg, "numpy", 0, "/tmp/x", lazy=True)


def test_ratios_divide_by_the_single_process_tf1_and_the_rpc_server(tiny_suite: tuple[dict, str]) -> None:
    """The real run's record, beside peers in the same shape: every ratio is the one its column names."""
    report, _ = tiny_suite
    fields = {f.name for f in dataclasses.fields(ctr.CtrRun)}
    psdk = ctr.CtrRun(**{k: v for k, v in report["runs"]["psdk-numpy"][0].items() if k in fields})
    rate0, cpu0, auc0 = psdk.examples_per_s, psdk.cpu_s_per_1k_examples, psdk.test_auc
    assert rate0 is not None and cpu0 is not None and auc0 is not None

    def peer(name: str, rate: float, cpu: float, auc: float) -> ctr.CtrRun:
        return dataclasses.replace(
            psdk, system=name, examples_per_s=rate0 * rate, cpu_s_per_1k_examples=cpu0 * cpu, test_auc=auc0 + auc
        )

    runs = {
        ctr.SINGLE: [peer("ctr_single", 0.5, 0.5, 0.001), peer("ctr_single", 0.7, 0.5, 0.001)],
        ctr.TF1: [peer("ctr_tf1_ps_worker", 0.25, 4.0, 0.0), dataclasses.replace(psdk, error="exit 2")],
        ctr.RPC: [peer("ctr_torch_rpc_ps", 0.5, 2.0, -0.009)],
        "psdk-numpy": [psdk],
    }
    rows = ctr.compare([ctr.summarise(key, rs) for key, rs in runs.items()])
    by_key = {r.key: r for r in rows}
    mine = by_key["psdk-numpy"]
    assert mine.vs_single == pytest.approx(1 / 0.6, rel=1e-6)  # the median of the single's two runs
    assert mine.cpu_vs_tf1 == pytest.approx(0.25, rel=1e-6) and mine.cpu_vs_rpc == pytest.approx(0.5, rel=1e-6)
    assert mine.auc_diff == pytest.approx(-0.001, abs=1e-9)
    assert by_key[ctr.TF1].failed == 1 and by_key[ctr.TF1].runs == 2
    text = ctr.table(rows)
    assert text.count("**over 0.005**") == 1 and "(-0.0100 **over 0.005**)" in text  # only the RPC server's
    assert "| 0.25× |" in text and "| 0.50× |" in text
    verdicts = ctr.targets(rows, by_key[ctr.TF1], by_key[ctr.RPC])
    assert "CPU per example ≤ 0.5× TF1's: 0.25× (met)" in verdicts
    assert "examples/s ≥ 1.5× TF1's: 4.00× (met)" in verdicts
    assert "examples/s ≥ 1.2× the RPC's: 2.00× (met)" in verdicts
    assert "within 0.005 of the single process's: met" in verdicts


def test_the_window_counts_the_steps_that_ended_inside_it_and_interpolates_the_cpu() -> None:
    sampler = window.CpuSampler(root=0)
    # pid 1 runs all along at half a core; pid 2 starts at t=15 (none before), pid 3 is gone at t=12
    sampler.samples = [(10.0, {1: 0.0, 3: 1.0}), (12.0, {1: 1.0, 3: 2.0}), (20.0, {1: 5.0, 2: 1.0}), (30.0, {1: 10.0})]
    ends = {"worker0": [10.5, 11.0, 11.5, 20.0, 25.0], "worker1": [11.2, 11.5, 18.0, 21.0]}
    measured = window.measure(ends, warm_steps=3, batch=100, sampler=sampler, names={1: "ps0", 2: "worker1"})
    assert (measured.start, measured.end) == (11.5, 21.0)  # the chief's 3rd step; worker1's last
    assert measured.examples == 100 * 3  # 20.0, 18.0 and 21.0: 11.5 itself is the start, not inside
    assert measured.cpu["ps0"] == pytest.approx(5.5 - 0.75, abs=1e-9)
    assert measured.cpu["worker1"] == pytest.approx(1.0, abs=1e-9)  # its last reading: nothing after
    assert measured.cpu["pid3"] == pytest.approx(2.0 - 1.75, abs=1e-9)
    figures = measured.figures()
    assert figures["examples_per_s"] == pytest.approx(300 / 9.5)
    assert figures["cpu_s_per_1k_examples"] == pytest.approx(sum(figures["cpu_split"].values()), abs=1e-4)
    with pytest.raises(ValueError, match="none after its warm-up"):
        window.measure(ends, warm_steps=5, batch=100, sampler=sampler, names={})


def test_the_sampler_reads_a_real_process_cpu() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(5)"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with window.CpuSampler(child.pid, interval_s=0.01) as sampler:
            deadline = time.monotonic() + 30
            while (window.cpu_s(child.pid) or 0.0) < 0.6 + 0.1 and time.monotonic() < deadline:
                time.sleep(0.05)  # its spin done (interpreter start-up included)
            time.sleep(0.1)
        read = sampler.at(sampler.samples[-1][0])[child.pid]
        assert read == pytest.approx(window.cpu_s(child.pid), abs=0.02) and read >= 0.6
        assert sampler.at(sampler.samples[0][0] - 1.0)[child.pid] == 0.0  # before its first sample
    finally:
        child.kill()
        child.wait(timeout=10)


def test_the_time_split_is_read_from_the_summary_as_it_is() -> None:
    """psdk's ``time_split`` (worker per step, ps per push) and the workers' ``time_per_step``, one level deep."""
    summary = {
        "time_split": {"worker": {"compute_ms": 20.0, "wire_ms": 9.5}, "ps": {"rule_ms": 1.5}},
        "workers": {"0": {"time_per_step": {"compute_cpu_ms": 18.0}}, "1": {}},
    }
    assert ctr.found_time_split(summary) == {
        "worker compute_ms": 20.0, "worker wire_ms": 9.5, "ps rule_ms": 1.5, "worker0 compute_cpu_ms": 18.0
    }  # fmt: skip
    assert ctr.found_time_split({"workers": {}}) == {}  # a summary without any: nothing made up


def test_a_warmup_the_window_cannot_start_from_is_refused() -> None:
    cfg = OmegaConf.create({"reps": 1, "ctr": {"workers": 2, "warmup": 1, "steps": 40}})
    with pytest.raises(ConfigError, match=r"ctr\.warmup"):
        ctr.check(cfg)
    cfg.ctr.warmup = 40
    with pytest.raises(ConfigError, match=r"below ctr\.steps"):
        ctr.check(cfg)


def test_an_unknown_suite_is_refused_by_name(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "psdk", "bench", "suite=criteo", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1 and "suite" in done.stderr + done.stdout and "mnist or ctr" in done.stderr + done.stdout
