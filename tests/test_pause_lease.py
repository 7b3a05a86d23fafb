"""A checkpoint pause is the chief's lease: it cannot outlive the chief's session."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import pytest

from psdk.client import ParameterClient, StepResult
from psdk.client import cut as client_module
from psdk.errors import CheckpointAbandoned

from .conftest import PsCluster, running_ps
from .test_server import grads, in_thread, start, wait_until

LEASE_S = 0.5


def pause(chief: ParameterClient) -> int:
    """The first half of a checkpoint: every shard stops at its current version (as ``checkpoint_state`` does)."""
    version = int(chief.status()["version"])
    replies = chief.request(chief.to_all("pause_at", version=version), "a pause for a checkpoint")
    assert all(r.op == "paused" for r in replies.values())
    return version


def held(ps: PsCluster) -> int:
    return len(ps.servers[0].pause.pushes)


def test_a_pause_whose_chief_went_silent_ends_by_itself_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=LEASE_S) as ps:
        chief, worker = start(ps, 2, mode="async")
        try:
            version = pause(chief)
            push = in_thread(lambda: worker.push_pull(grads(1.0)))
            wait_until(lambda: held(ps) == 1)  # the pause holds worker 1's push
            chief.close()  # the chief dies between pause_at and resume: no heartbeat, no resume
            result = push.result(timeout=20)
            assert result.global_step == version + 1
            # The lease ended it, long before the chief's heartbeat timeout (30 s) could declare it dead.
            assert ps.servers[0].membership.status(0) != "dead"
            assert not ps.servers[0].pause.held
            assert f"nothing heard from the chief's session for {LEASE_S:g} s (ps.pause_lease_s)" in caplog.text
            assert f"the checkpoint pause at version {version} ends, training goes on" in caplog.text
        finally:
            worker.close()


def test_a_chief_that_still_heartbeats_keeps_its_pause_past_the_lease() -> None:
    """Writing a big checkpoint takes the chief longer than a lease: its heartbeats renew the pause."""
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=LEASE_S) as ps:
        chief, worker = start(ps, 2, mode="async")
        try:
            version = pause(chief)
            push = in_thread(lambda: worker.push_pull(grads(1.0)))
            wait_until(lambda: held(ps) == 1)
            began = time.monotonic()
            while time.monotonic() - began < 4 * LEASE_S:  # no request from the chief, only its heartbeats
                assert ps.servers[0].pause.held and held(ps) == 1 and not push.done()
                time.sleep(0.02)
            state = chief.request(chief.to_all("state"), "the shards' state")[0]
            assert int(state.fields["version"]) == version  # still the consistent cut it paused at
            chief.request(chief.to_all("resume"), "resuming")
            assert push.result(timeout=20).global_step == version + 1
        finally:
            chief.close()
            worker.close()


def test_a_pause_ends_when_the_chief_is_declared_dead(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    # A lease that cannot run out here; recovery on, so the chief's death waits for it to come back.
    with running_ps(1, heartbeat_timeout_s=1.0, pause_lease_s=60.0, recovery=True) as ps:
        chief, worker = start(ps, 2, mode="async")
        try:
            version = pause(chief)
            push = in_thread(lambda: worker.push_pull(grads(1.0)))
            wait_until(lambda: held(ps) == 1)
            chief.heartbeat.stop()  # silent: declared dead after the heartbeat timeout
            assert push.result(timeout=20).global_step == version + 1
            assert ps.servers[0].membership.status(0) == "dead"
            assert f"the chief (worker 0) is gone; the checkpoint pause at version {version} ends" in caplog.text
        finally:
            chief.close()
            worker.close()


def test_a_pause_that_lapses_mid_checkpoint_skips_that_checkpoint_and_the_next_one_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chief stalled between ``pause_at`` and ``state`` (its session silent) gets no torn cut, and no crash."""
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=LEASE_S) as ps:
        chief, worker = start(ps, 2, mode="async")
        try:
            pushes: list[Future[StepResult]] = []

            def stall_until_the_pause_lapses(name: str) -> None:
                pushes.append(in_thread(lambda: worker.push_pull(grads(1.0))))
                wait_until(lambda: held(ps) == 1)  # a push waits on the pause
                assert chief.heartbeat is not None
                chief.heartbeat.stop()  # the chief's session goes silent mid-checkpoint
                wait_until(lambda: not ps.servers[0].pause.held)  # the lease ran out; the push was applied

            monkeypatch.setattr(client_module, "failpoint", stall_until_the_pause_lapses)
            version = int(chief.status()["version"])
            with pytest.raises(CheckpointAbandoned, match="the checkpoint pause ended"):
                chief.checkpoint_state()
            assert pushes[0].result(timeout=20).global_step == version + 1

            monkeypatch.setattr(client_module, "failpoint", lambda name: None)
            state = chief.checkpoint_state()  # the next checkpoint, when due: a consistent cut
            assert state.global_step == version + 1
            assert not ps.servers[0].pause.held and held(ps) == 0
        finally:
            chief.close()
            worker.close()


def test_a_shard_already_past_the_version_asked_pauses_where_it_is() -> None:
    """Busy workers move a shard on between the chief's status and its pause_at: the cut must still settle."""
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=60.0) as ps:
        chief, worker = start(ps, 2, mode="async")
        try:
            before = int(chief.status()["version"])
            worker.push_pull(grads(1.0))
            worker.push_pull(grads(1.0))
            (reply,) = chief.request(chief.to_all("pause_at", version=before), "a pause").values()
            assert reply.op == "passed" and int(reply.fields["version"]) == before + 2
            push = in_thread(lambda: worker.push_pull(grads(1.0)))
            wait_until(lambda: held(ps) == 1)  # held at the version it answered with
            (again,) = chief.request(chief.to_all("pause_at", version=before + 2), "the pause again").values()
            assert again.op == "paused" and int(again.fields["version"]) == before + 2
            chief.request(chief.to_all("resume"), "resuming")
            assert push.result(timeout=20).global_step == before + 3
        finally:
            chief.close()
            worker.close()
