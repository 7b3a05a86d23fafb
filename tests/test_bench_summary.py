"""How `python -m psdk bench` turns runs into ratios (the figures the README quotes)."""

from __future__ import annotations

import pytest

from psdk.bench import flood, transport
from psdk.bench.suite import Run, summarise, transport_table


def runs(system: str, framework: str, *rates: float) -> list[Run]:
    return [Run(system, framework, "async", updates_per_s=r, test_accuracy=0.95) for r in rates]


def test_each_system_is_divided_by_the_single_run_of_its_own_framework() -> None:
    baselines = {"torch": 1000.0, "tensorflow": 500.0}
    assert summarise(runs("psdk-torch", "torch", 400, 600, 500), baselines).ratio == 0.5
    assert summarise(runs("psdk-tf", "tf", 250), baselines).ratio == 0.5
    assert summarise(runs("tf1_ps_worker", "tensorflow", 100), baselines).ratio == 0.2


def test_without_a_single_run_of_its_framework_a_peer_is_divided_by_single_torch() -> None:
    row = summarise(runs("tf1_ps_worker", "tensorflow", 200, 180, 220), {"torch": 1000.0})
    assert row.updates_per_s == 200 and row.ratio == 0.2


def test_failed_runs_are_counted_and_left_out_of_the_median() -> None:
    failed = Run("torch_rpc_ps", "torch", "sync", error="exit 2")
    row = summarise([*runs("torch_rpc_ps", "torch", 100, 300), failed], {"torch": 1000.0})
    assert row.failed == 1 and row.runs == 3 and row.updates_per_s == 200


def test_each_single_process_baseline_row_names_its_framework() -> None:
    assert summarise(runs("single", "tf", 700), {"tensorflow": 700.0}).system == "single-tf"
    assert summarise(runs("single", "torch", 1000), {"torch": 1000.0}).system == "single-torch"


@pytest.mark.timeout(120)
def test_the_transport_micro_benchmark_measures_raw_pyzmq_and_psdk_with_and_without_shared_memory() -> None:
    result = transport.compare(size=1000, count=30, reps=1)
    for kind in transport.KINDS:
        assert result[kind]["round_trips_per_s"] > 0 and result[kind]["client_cpu_us"] >= 0
    table = transport_table([result])
    assert table.count("\n") == 2 and f"{result['ratio']:.2f}×" in table and f"{result['ratio_frames']:.2f}×" in table
    with pytest.raises(ValueError, match="unknown kind"):
        transport.measure("grpc", 1000, 1)


@pytest.mark.timeout(120)
def test_the_flood_benchmark_measures_a_real_ps_and_stays_within_its_bound() -> None:
    report = flood.run(connections=8, seconds=2.0)
    print("\n".join(report.lines()))
    assert report.answered_after and report.reconnects > 0  # the guard shut floods out and the ps went on
    assert report.peak_kb > report.before_kb >= report.base_kb > 0
    assert report.within, report.lines()


def test_the_bound_adds_up_its_terms() -> None:
    terms = flood.bound(10, 1000, 1, 2, 24, 1e9, 65536).terms
    assert flood.bound(10, 1000, 1, 2, 24, 1e9, 65536).total == sum(terms.values())
    # libzmq's queues scale with the intake rate (one check's worth) and with the job's sizes.
    assert flood.bound(10, 1000, 1, 2, 24, 2e9, 65536).total > flood.bound(10, 1000, 1, 2, 24, 1e9, 65536).total
    assert flood.bound(10, 2000, 1, 2, 24, 1e9, 65536).total > flood.bound(10, 1000, 1, 2, 24, 1e9, 65536).total
