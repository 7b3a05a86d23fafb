"""What depends on the sync mode is said by its policy, and read from there by everyone else."""

from __future__ import annotations

import pytest

from psdk.ps.consistency import MODES, POLICIES, SyncPolicy, SyncSpec
from psdk.report.metrics import summary_line

pytestmark = pytest.mark.timeout(30)


def test_only_the_sync_policy_waits_for_rounds() -> None:
    assert set(POLICIES) == set(MODES)
    assert {mode for mode, policy in POLICIES.items() if policy.waits_for_rounds} == {"sync"}
    assert SyncSpec("sync").waits_for_rounds and not SyncSpec("sync").allows_overlap
    for mode in ("async", "ssp"):
        assert not SyncSpec(mode).waits_for_rounds and SyncSpec(mode).allows_overlap


def test_a_summary_names_the_replicas_of_a_mode_with_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    line = summary_line({"sync": {"mode": "sync", "replicas_to_aggregate": 2}})
    assert "sync=sync(replicas_to_aggregate=2)" in line
    assert "sync=ssp " in summary_line({"sync": {"mode": "ssp", "replicas_to_aggregate": 2}})
    assert "sync=? " in summary_line({})  # an unknown mode is no error in a report
    monkeypatch.setattr(SyncPolicy, "waits_for_rounds", False)  # the policy decides, not a string test
    assert "sync=sync " in summary_line({"sync": {"mode": "sync", "replicas_to_aggregate": 2}})
