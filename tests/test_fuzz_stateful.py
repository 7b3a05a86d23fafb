"""The stateful fuzzer: sequences of every op from registered workers, over frames, shared memory and CURVE.

Budgets here are short (a few hundred steps per mode); ``python -m psdk fuzz`` runs long ones.
"""

from __future__ import annotations

import pytest

from psdk import protocol
from psdk.fuzz import harness, runner, stateful
from psdk.fuzz.alongside import run_alongside
from psdk.fuzz.harness import Mode
from psdk.ps.consistency import POLICIES
from psdk.ps.server import ParameterServer
from psdk.transport import shm

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "mode",
    [
        Mode(curve=False, shared_memory=False),
        Mode(curve=False, shared_memory=True),
        Mode(curve=True, shared_memory=True),
    ],
    ids=["frames", "shared-memory", "curve"],
)
def test_sequences_of_every_op_keep_the_books_the_store_and_the_ps(mode: Mode) -> None:
    if mode.shared_memory and not shm.available():
        pytest.skip("needs Linux memfd and /proc")
    stateful.COVERAGE.clear()
    report = runner.run(mode, examples=80, steps=40)
    print(report.line())
    assert report.failure is None, report.failure
    reached = {key.split(" -> ")[0] for key in stateful.COVERAGE}
    # Every op of the protocol was sent and answered, past the session check (knocks need shared memory).
    ops = set(protocol.OPS)
    assert ops <= reached, ops - reached
    assert any(key.startswith("push_pull -> params applied") for key in stateful.COVERAGE)
    assert any(key.startswith(f"push_pull -> error {protocol.NON_FINITE}") for key in stateful.COVERAGE)  # live
    # The model followed a restore of a checkpoint the fuzzer took, and a ps restarted from one.
    assert stateful.COVERAGE["lifecycle: a checkpoint the fuzzer took, restored"] > 0
    assert stateful.COVERAGE["lifecycle: a ps restarted from a checkpoint the fuzzer took"] > 0
    if mode.shared_memory:  # the transport's own offers, and requests and replies through the memory lent
        assert {"offer -> transport:attached", "offer -> transport:refused"} <= set(stateful.COVERAGE)
        assert any(key.startswith("knock -> params") for key in stateful.COVERAGE)


def test_sequences_with_tables_keep_the_rows_the_models_and_refuse_bad_row_requests() -> None:
    """Every sequence declares tables: rows pushed and pulled follow the reference model, bad ones are refused."""
    stateful.COVERAGE.clear()
    report = runner.run(Mode(shared_memory=False), examples=30, steps=30, tables=True)
    print(report.line())
    assert report.failure is None, report.failure
    reached = set(stateful.COVERAGE)
    assert {"rows: push_pull -> params applied", "rows: pull -> params pulled"} <= reached
    refused = {key for key in reached if key.startswith("rows: ") and " -> error rejected" in key}
    assert any(key.startswith("rows: push_pull") for key in refused) and any(
        key.startswith("rows: pull") for key in refused
    )
    named = {key for key in reached if key.startswith("named: ")}  # pushes naming their pull, valid and not
    assert "named: a pull the shard holds" in named and len(named) >= 3, named


def test_a_real_job_trains_to_the_end_while_a_workers_key_is_fuzzed() -> None:
    report = run_alongside(steps=1500, seed=0, curve=True)
    print(report.line())
    assert report.ok, report.line()
    assert report.intruder_requests > 300 and report.intruder_replies["error"] > 100


def test_the_fuzzer_finds_a_ps_that_answers_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """It can fail: a ps whose ping handler answers twice is caught (and so is one that never answers)."""
    original = ParameterServer._on_ping

    def twice(self: ParameterServer, peer: bytes, message: object, worker: int | None) -> None:
        original(self, peer, message, worker)  # type: ignore[arg-type]
        original(self, peer, message, worker)  # type: ignore[arg-type]

    monkeypatch.setattr(ParameterServer, "_on_ping", twice)
    # 40 steps: a sequence must place the job before a worker's ping passes the session check (with 20, the
    # derandomized draws of a protocol with the table ops sent no worker's ping in 20 or even 80 sequences).
    report = runner.run(Mode(shared_memory=False), examples=20, steps=40, shrink=False)
    assert report.failure is not None and "not waiting for one" in report.failure


def test_the_fuzzer_finds_a_ps_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ParameterServer, "_on_stats", lambda self, peer, message, worker: None)
    monkeypatch.setattr(harness, "SETTLE_S", 1.0)
    report = runner.run(Mode(shared_memory=False), examples=20, steps=20, shrink=False)
    assert report.failure is not None
    assert any(words in report.failure for words in ("wait for a reply but the ps holds", "!= replies"))


def test_the_fuzzers_ops_and_modes_are_those_the_protocol_and_the_policies_declare() -> None:
    """A new op or sync mode is fuzzed without editing the fuzzer: it has no list of its own."""
    assert set(stateful.MUTATED_OPS) | set(harness.ENDINGS) == set(protocol.OPS)
    assert set(stateful.ASKED) | set(stateful.CHIEF_STEPS) | set(stateful.TARGETS) <= set(protocol.OPS)
    assert list(POLICIES) == stateful.SYNC_MODES
