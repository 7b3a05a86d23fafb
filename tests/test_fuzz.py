"""20,000 mutated real messages from a stranger's connection change nothing on the ps; the fuzz command."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psdk import protocol
from psdk.fuzz import single
from psdk.fuzz.single import FuzzSession

from .conftest import REPO

BATCHES, PER_BATCH = 200, 100


def test_the_ps_survives_20000_mutated_messages_and_applies_none_of_them() -> None:
    session = FuzzSession()
    try:

        @settings(
            max_examples=BATCHES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.randoms(use_true_random=False))
        def one_batch(rng: random.Random) -> None:
            session.fuzz(rng, PER_BATCH)

        one_batch()
        report = session.finish()
    finally:
        session.close()
    print("\n".join(report.lines()))
    assert report.sent >= 20_000
    assert report.parsed >= report.sent / 2  # most reach the handlers, not just the header parser
    assert report.replies["error"] > report.sent / 3 and report.oversized > 0
    assert report.applied_after == report.applied_before
    assert report.digest_after == report.digest_before
    assert report.ps_running and report.worker_trains_after


def test_the_fuzz_command_runs_every_stage_and_reports_a_pass(capsys: object) -> None:
    from psdk.launch.cli import main

    assert main(["fuzz", "sequences=5", "steps=10", "count=2000", "seed=3"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    stages = ("stateful (plain, frames)", "stateful (plain, shared memory)", "stateful (curve, shared memory)")
    for stage in (*stages, "stateful (plain, frames, tables)"):
        assert f"{stage}: 5 sequences" in out
    assert "alongside a real job" in out and "store hash unchanged: True" in out
    assert out.count("PASS") == 6


def test_single_messages_mutate_every_op_the_protocol_declares() -> None:
    assert set(single.OPS) == set(protocol.OPS) and {"stop_at", "restore"} <= set(single.OPS)


WITHOUT_HYPOTHESIS = """
import sys
sys.modules["hypothesis"] = None  # what an install without the fuzz extra sees: import hypothesis fails
from psdk.launch.cli import main
sys.exit(main(["fuzz", "sequences=1", "steps=1", "count=10"]))
"""


@pytest.mark.timeout(60)
def test_without_hypothesis_the_fuzz_command_says_how_to_install_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYPOTHESIS], capture_output=True, text=True, timeout=50, cwd=REPO, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "psdk: error: fuzz: needs hypothesis, which psdk does not install by default: pip install 'psdk[fuzz]'"
    )
    assert "Traceback" not in done.stderr
