"""Getting a job back on its feet after a ps was lost: the chief restores, the others follow.

A ps that dies loses its shard. When it comes back (restarted by the
launcher, or by hand in per-task mode) it is empty, and answers pushes with
a typed "resync" reply. The chief then restores the whole job from its
latest checkpoint, by variable name, over the transport: the new ps gets its
variables and optimizer slots, every surviving shard rolls back to the same
global step, and all shards enter a new epoch. Any push computed in the old
epoch is answered "resync"; every worker then pulls the restored parameters
and goes on. At most the steps since the last checkpoint are lost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from psdk.client import checkpoint
from psdk.client.checkpoint import Checkpoint
from psdk.client.partitions import split_state
from psdk.client.shards import StepResult
from psdk.client.tablestate import announce, restore_tables
from psdk.client.view import ClientView
from psdk.errors import PeerDeadError, PeerRestartedError, PeerTimeoutError, PsdkError, TransportError
from psdk.runtime.liveness import beat
from psdk.runtime.waits import WaitLog, seconds
from psdk.transport.wire import Message

if TYPE_CHECKING:
    from psdk.transport import Pending

log = logging.getLogger(__name__)

POLL_S = 0.2


def recover(client: ClientView, why: str) -> StepResult:
    """Wait out the loss, restore (the chief) or follow (the others), then pull."""
    timeout = client.options.recovery_timeout_s or 0.0
    deadline = time.monotonic() + timeout
    log.warning("worker %d: %s; recovering (at most %.0f s)", client.task_index, why, timeout)
    if client.task_index == 0:
        lost = lead(client, deadline)
    else:
        follow(client, deadline)
        lost = None
    client.renew()  # a restarted ps maps this worker's buffers anew
    step = client.pull()
    log.warning(
        "worker %d: recovered at global step %d (restore epoch %d)%s",
        client.task_index,
        step,
        client.epoch,
        f", {lost} global steps lost" if lost is not None else "",
    )
    client.recoveries.append({"global_step": step, "epoch": client.epoch, "lost_steps": lost, "why": why})
    return StepResult(step, False, "resync")


def after_timeout(client: ClientView, pending: Pending, timeout: PeerTimeoutError) -> StepResult | dict[int, Message]:
    """A push-and-pull no shard answered in time: recover if one lost its state, else wait once more.

    Heartbeats catch a ps that died or came back as a new process; a timeout
    with heartbeats still answered means either a shard that lost its state
    without the heartbeats telling (its answer to this request will never
    come), or one that is merely slow: overloaded, or holding the push (a
    sync round, a checkpoint pause). The shards' status tells them apart.
    Only a lost state is worth a rollback to the last checkpoint; a slow
    shard is waited for once more, up to ``recovery.timeout_s``, and then
    named in a clear error, with nothing rolled back.
    """
    wait_s = client.options.recovery_timeout_s or 0.0
    shards = statuses(client, time.monotonic() + wait_s, "the shards' status after a timeout")
    lost = [i for i, status in shards.items() if lost_state(client, i, status)]
    if lost:
        names = ", ".join(client.names[i] for i in lost)
        return client.recover(f"{timeout}; {names} no longer holds this job's state")
    slow = [i for i in pending.expected if i not in pending.replies]
    described = ", ".join(f"{client.names[i]} (version {shards[i]['version']})" for i in slow)
    log.warning(
        "worker %d: %s; %s still holds its state and answers: slow, not lost, so nothing is rolled back; "
        "waiting up to %.0f s more (recovery.timeout_s)",
        client.task_index,
        timeout,
        described,
        wait_s,
    )
    try:
        return client.collect(pending, "a push-and-pull (after a timeout)", timeout_s=wait_s)
    except (PeerDeadError, PeerRestartedError) as exc:
        return client.recover(str(exc))
    except PeerTimeoutError as again:
        raise PsdkError(
            f"{described} did not answer worker {client.task_index}'s push-and-pull in "
            f"{timeout.waited_s + again.waited_s:.0f} s (transport.request_timeout_s + recovery.timeout_s), "
            "though it answers heartbeats and status and still holds its state: it is overloaded or stuck "
            "(see its log); nothing was rolled back"
        ) from again


def lost_state(client: ClientView, index: int, status: dict[str, Any]) -> bool:
    """Shard ``index`` is empty, a new process, or was restored by the chief since this worker's request."""
    known = client.boots[index]
    return (
        not status["initialized"]
        or (known is not None and status.get("boot") != known)
        or int(status.get("epoch", 0)) != client.epoch
    )


def statuses(client: ClientView, deadline: float, what: str, reports: bool = False) -> dict[int, dict[str, Any]]:
    """Every shard's status, waiting for shards that do not answer (yet); ``reports``: the chief collects the
    finished workers' reports on the way (a surviving shard knows them)."""
    found: dict[int, dict[str, Any]] = {}
    fields: dict[str, Any] = {"reports": True} if reports else {}
    clock = WaitLog()
    while True:
        for index in range(client.cluster.num_ps):
            if index in found:
                continue
            beat()  # each try may wait up to a heartbeat timeout for a connection (psdk.runtime.liveness)
            try:
                reply = client.request({index: client.message("status", **fields)}, what, timeout_s=1.0, watch=False)
                found[index] = reply[index].fields
                client.heard_from(index, found[index].get("boot"))
                for worker, report in (found[index].get("reports") or {}).items():
                    client.reports[int(worker)] = report
            except TransportError:
                pass
        if len(found) == client.cluster.num_ps:
            return found
        if (waited := clock.due()) is not None:
            for index in (i for i in range(client.cluster.num_ps) if i not in found):
                log.warning(
                    "worker %d: waiting for ps %d at %s (%s): no answer for %s, giving up in %s; %s",
                    client.task_index,
                    index,
                    client.addresses[index],
                    what,
                    seconds(waited),
                    seconds(max(0.0, deadline - time.monotonic())),
                    client.endpoint.diagnose(index) or "it is reachable",
                )
        if time.monotonic() > deadline:
            missing = ", ".join(client.names[i] for i in range(client.cluster.num_ps) if i not in found)
            raise PsdkError(f"gave up recovering: {missing} did not come back in time")
        time.sleep(POLL_S)


def lead(client: ClientView, deadline: float) -> int:
    """The chief: restore every shard from the latest checkpoint into a new epoch; returns steps lost."""
    shards = statuses(client, deadline, "a lost ps to come back", reports=True)
    state = client.recovery_source() if client.recovery_source is not None else None
    state = state or client.fallback
    if state is None:
        raise PsdkError("a ps was lost but the chief has no state to restore it from")
    fallback = state is client.fallback
    state = split_state(state, client.job.partitions if client.job is not None else {})  # whole variables: split
    epoch = max(int(s["epoch"]) for s in shards.values()) + 1
    reached = max(int(s["version"]) for s in shards.values())
    for index, status in shards.items():  # the shards as they are now (a restarted one has a new boot id)
        client.set_boot(index, status.get("boot"))
    tables = list(client.tables.values())
    restored = [spec for spec in tables if state.tables is not None and spec.name in state.tables.names]
    if len(restored) < len(tables):
        log.warning("worker 0: tables %s are in no checkpoint: they keep their rows (a restarted ps starts them empty)",
                    sorted(spec.name for spec in tables if spec not in restored))  # fmt: skip
    messages = {}
    for index, shard in enumerate(client.shards):
        names = [spec.name for spec in shard.specs]
        arrays = [np.ascontiguousarray(state.variables[n], np.float32) for n in names]
        slot_names = list(state.slots)
        arrays += [np.ascontiguousarray(state.slots[s][n], np.float32) for s in slot_names for n in names]
        fields: dict[str, Any] = {
            "names": names,
            "epoch": epoch,
            "restore": {"version": state.global_step, "rule_step": state.rule_step, "slots": slot_names},
            "finished": {str(worker): report for worker, report in client.reports.items()},
        }
        if shards[index]["initialized"]:
            messages[index] = client.message("restore", arrays, **fields)
        else:
            assert client.job is not None
            fields.update(job=client.job.to_json(), rule=client.rule_json)
            if tables:
                specs = [spec.to_json() for spec in tables]
                fields["tables"] = {"shard": index, "num_ps": client.cluster.num_ps, "specs": specs}
            messages[index] = client.message("init", arrays, **fields)
    announce(messages, restored, client.options.table_chunk_rows)
    client.request(messages, "restoring the shards from the latest checkpoint")
    if restored and state.tables is not None:  # the shards answer no worker until every table committed
        restore_tables(client, state.tables, restored, client.cluster.num_ps, client.options.table_chunk_rows)
    client.epoch = epoch
    log.warning(
        "worker 0: restored every shard to global step %d (restore epoch %d) from %s",
        state.global_step,
        epoch,
        "the latest checkpoint" if not fallback else "the initial state",
    )
    return max(0, reached - state.global_step)


def follow(client: ClientView, deadline: float) -> None:
    """Any other worker: wait until the chief has restored every shard into a newer epoch."""
    clock = WaitLog()
    while True:
        shards = statuses(client, deadline, "the chief to restore the job")
        epochs = {int(s["epoch"]) for s in shards.values()}
        restored = all(s["initialized"] and not s.get("restoring") for s in shards.values())
        if restored and len(epochs) == 1 and min(epochs) > client.epoch:
            client.epoch = min(epochs)
            for index, status in shards.items():
                client.set_boot(index, status.get("boot"))
            return
        if (waited := clock.due()) is not None:
            log.info(
                "worker %d: waiting for the chief (worker 0) to restore the job: %s so far, giving up in %s",
                client.task_index,
                seconds(waited),
                seconds(max(0.0, deadline - time.monotonic())),
            )
        if time.monotonic() > deadline:
            raise PsdkError("gave up recovering: the chief did not restore the job in time")
        time.sleep(POLL_S)


def latest_or_none(folder: Any, run_id: str | None = checkpoint.ANY_RUN) -> Checkpoint | None:
    """The newest valid checkpoint of run ``run_id`` in ``folder`` to restore from; damaged ones are skipped,
    and logged."""
    return checkpoint.latest_valid(Path(folder), run_id)[0] if folder else None
