"""Sixteen clients against one ps in sync mode: every gradient is accounted for."""

from __future__ import annotations

from psdk.bench.load import run


def test_sixteen_clients_in_sync_mode_lose_no_gradient() -> None:
    report = run(clients=16, replicas=12, seconds=3.0)
    print("\n".join(report.lines()))
    assert report.balanced, report.lines()
    assert report.global_steps > 10 and report.outcomes["dropped"] > 0  # the backup clients really were late
    assert report.sent == report.outcomes["applied"] + report.outcomes["dropped"] + report.outcomes["done"]
