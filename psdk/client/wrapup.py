"""The end of training: the chief waits for the workers and collects their reports; the others wait to be collected.

A worker's ``finish`` reaches every shard with its report. The chief waits
until every other worker has finished or is known dead, asking every shard
(a shard that failed the job says so at once), and collects the finished
workers' reports on the way. A finished worker stays until it has seen its
report collected, and the chief waits for that too: until then the worker is
the only one who could tell a restarted ps that it finished, and what it
reported. After that the chief tells a restored shard itself. A ps lost
during these waits is restored as during training
(:meth:`~psdk.client.client.ParameterClient.wrapping_up`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from psdk.client import recovery
from psdk.client.view import ClientView
from psdk.errors import PeerDeadError, PeerRestartedError, PsdkError, TrainingResumed, TransportError
from psdk.runtime.waits import WaitLog, seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.05


def wait_for_workers(client: ClientView, timeout_s: float) -> dict[str, dict[str, str]]:
    """Chief: wait until every other worker finished (and, if it stays, saw its report collected) or is dead."""
    deadline = time.monotonic() + timeout_s
    clock = WaitLog()
    while True:
        statuses = client.wrapping_up(lambda: client.statuses(reports=True), "waiting for the workers")
        for index, status in sorted(statuses.items()):
            if status.get("failure"):
                raise PsdkError(f"{client.names[index]} failed the job: {status['failure']}")
        workers = statuses[0]["workers"]
        waiting = [i for i, w in workers.items() if w["status"] in ("alive", "unseen") and int(i) != client.task_index]
        waiting += sorted({str(i) for status in statuses.values() for i in status.get("leaving", ())})
        if not waiting:
            return dict(workers)
        if (waited := clock.due()) is not None:
            log.info(
                "worker %d: waiting for worker(s) %s to finish: %s of %s (train.final_wait_s); %s",
                client.task_index,
                ", ".join(waiting),
                seconds(waited),
                seconds(timeout_s),
                "; ".join(_why_waiting(worker, workers.get(worker, {}), client.addresses[0]) for worker in waiting),
            )
        if time.monotonic() > deadline:
            raise TransportError(
                f"timed out after {timeout_s:.0f} s waiting for worker(s) {', '.join(waiting)} to finish"
            )
        time.sleep(POLL_S)


def _why_waiting(worker: str, status: dict[str, str], ps_address: str) -> str:
    """What ps 0 knows of a worker the chief waits for, in words."""
    state = status.get("status")
    if state == "unseen":
        return f"worker {worker} has never reached ps 0 at {ps_address} (is it started, with the same ps_hosts?)"
    if state == "alive":
        return f"worker {worker} is still training"
    return f"worker {worker} finished and waits for this worker to collect its report"


def wait_collected(client: ClientView, timeout_s: float) -> bool:
    """Not the chief: wait (at most ``timeout_s``) until the chief has this worker's report; False if it did not.

    A restored shard that never heard this worker finish is told again.
    """
    deadline = time.monotonic() + timeout_s
    me = str(client.task_index)
    clock = WaitLog()
    while True:
        statuses = client.wrapping_up(client.statuses, "waiting for the chief to collect this worker's report")
        if all(client.task_index in status.get("collected", ()) for status in statuses.values()):
            return True
        if any(status["workers"].get(me, {}).get("status") != "finished" for status in statuses.values()):
            client.finish(client.report, stays=True)
        if (waited := clock.due()) is not None:
            log.info(
                "worker %d: waiting for the chief (worker 0) to collect this worker's report: %s of %s",
                client.task_index,
                seconds(waited),
                seconds(timeout_s),
            )
        if time.monotonic() > deadline:
            log.warning("worker %d: the chief did not collect this worker's report in %.0f s", client.task_index,
                        timeout_s)  # fmt: skip
            return False
        time.sleep(POLL_S)


def statuses(client: ClientView, reports: bool = False) -> dict[int, dict[str, Any]]:
    """Every shard's status; ``reports`` (the chief): with the finished workers' reports, now collected.

    A shard that lost this job's state (a restarted ps, a restore since)
    raises :class:`PeerRestartedError`, which :func:`wrapping_up` turns
    into a recovery.
    """
    fields: dict[str, Any] = {"reports": True} if reports else {}
    replies = client.request({i: client.message("status", **fields) for i in range(client.cluster.num_ps)}, "status")
    found = {index: reply.fields for index, reply in replies.items()}
    for index, status in sorted(found.items()):
        if client.initialized and recovery.lost_state(client, index, status):  # never initialised: nothing lost
            raise PeerRestartedError(client.names[index], "status: it no longer holds this job's state")
        for worker, report in (status.get("reports") or {}).items():
            client.reports[int(worker)] = report
    return found


def wrapping_up(client: ClientView, attempt: Callable[[], T], what: str) -> T:
    """``attempt``, a step of the end of training, again after a lost ps was restored (recovery on).

    The end of training is no safe place to lose a ps: its shard, who
    finished and what they reported would be gone. The chief restores the
    shards from the run's newest checkpoint, telling them who finished;
    if that checkpoint is from before the job's end, the workers train on
    (:class:`TrainingResumed`).
    """
    while True:
        try:
            return attempt()
        except (PeerDeadError, PeerRestartedError) as exc:
            if client.options.recovery_timeout_s is None:
                raise
            client.recover(f"{exc} while {what}")
        if client.job is not None and client.global_step < client.job.steps:
            raise TrainingResumed(client.global_step, client.job.steps)


def finish(client: ClientView, report: Mapping[str, Any], stays: bool = False) -> None:
    """Tell every shard this worker is done, with its report (a shard that survives a loss keeps it).

    ``stays``: this worker then waits until it has seen its report collected (:func:`wait_collected`).
    """
    client.report = dict(report)
    fields: dict[str, Any] = {"report": client.report, "stays": True} if stays else {"report": client.report}
    messages = {i: client.message("finish", **fields) for i in range(client.cluster.num_ps)}
    wrapping_up(client, lambda: client.request(messages, "acknowledging the end of training"), "finishing")
