"""The worker's side of the ps: the shard map, pipelined push-and-pull, heartbeats.

Each step is one combined push-and-pull request per shard, all in flight at
once. A shard's gradients and parameters each travel as one float32 buffer,
preallocated, with named views handed out: a step allocates no large array.
A wait gives up when its ps stops answering heartbeats, or at the request
timeout, and the error names that ps.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from psdk.client import recovery, wrapup
from psdk.client.checkpoint import Checkpoint
from psdk.client.cut import checkpoint_cut
from psdk.client.heartbeat import Heartbeat
from psdk.client.inflight import InFlight, collect_step
from psdk.client.layout import checked_variables, init_requests, initial_state, job_of, shards_from, tables_of
from psdk.client.options import ClientOptions
from psdk.client.partitions import Joined, chosen_plan
from psdk.client.rows import PullPlan, RowPush, plan_tables, pulled_rows, row_room, with_tables
from psdk.client.shards import Basis, Shard, StepResult, round_versions
from psdk.client.tablestate import announce, check_tables, finish_restore
from psdk.client.waiting import ReplyWait, rejoining
from psdk.errors import PeerDeadError, PeerRestartedError, PeerTimeoutError, PsdkError, RemoteError
from psdk.protocol import ops as protocol
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.partitions import Partitioning
from psdk.protocol.tables import TableSpec
from psdk.rules import UpdateRule
from psdk.transport import ClientEndpoint, Pending, Transport
from psdk.transport.wire import HEARTBEAT_SUFFIX, Message

log = logging.getLogger(__name__)
T = TypeVar("T")


class ParameterClient:
    """One worker's connection to every ps shard of the job."""

    def __init__(
        self,
        transport: Transport,
        cluster: ClusterSpec,
        task_index: int,
        options: ClientOptions | None = None,
        heartbeat: bool = True,
    ):
        cluster.check_task("worker", task_index)
        self.cluster, self.task_index = cluster, task_index
        self.options = options or ClientOptions()
        self.addresses = [cluster.ps_address(i) for i in range(cluster.num_ps)]
        self.names = [f"ps {i} ({a})" for i, a in enumerate(self.addresses)]
        # A random connection identity: the ps binds this worker id to it (its heartbeats add "/hb").
        self.identity = b"w" + secrets.token_hex(8).encode()
        self.endpoint: ClientEndpoint = transport.connect(self.addresses, self.names, self.identity)
        self.shards: list[Shard] = []
        self.job: JobSpec | None = None
        self._seq = 0
        self._params: dict[str, np.ndarray] = {}
        self._grads: dict[str, np.ndarray] = {}
        self._joined = Joined({}, {}, {})
        """The partitioned variables, whole (:mod:`psdk.client.partitions`); none unless the chief split some."""
        self._creation_order: list[str] = []
        self.tables: dict[str, TableSpec] = {}
        """The job's embedding tables, from the shards' layouts (rows live on the ps only)."""
        self._row_plans: dict[str, PullPlan] = {}
        """How the rows the push-and-pull in flight pulls are put back together."""
        self._in_flight: InFlight | None = None
        self.epoch = 0
        self.boots: list[str | None] = [None] * cluster.num_ps
        """Each shard's boot id as of the last layout: a different one means it restarted."""
        self._retired: list[set[str]] = [set() for _ in range(cluster.num_ps)]
        self.rule_json: dict[str, Any] = {}
        self.fallback: Checkpoint | None = None
        """What a recovery restores when the chief has no checkpoint yet: the job's initial state."""
        self.recoveries: list[dict[str, Any]] = []
        self.recovery_source: Callable[[], Checkpoint | None] | None = None
        """The chief's state to restore a lost shard from (its latest checkpoint), if any."""
        self.reports: dict[int, dict[str, Any]] = {}
        """The chief: the reports of the workers that finished, as collected (a restore tells the shards again)."""
        self.report: dict[str, Any] = {}
        """This worker's own report, once it finished: sent again to a restored shard that never got it."""
        self.heartbeat: Heartbeat | None = None
        if heartbeat:
            self.heartbeat = Heartbeat(
                transport,
                self.addresses,
                self.names,
                task_index,
                self.options.transport.heartbeat_interval_s,
                self.identity + HEARTBEAT_SUFFIX,
            )
            self.heartbeat.start()
            self.heartbeat._ready.wait(timeout=5.0)

    # -------------------------------------------------------------- requests
    def message(self, op: str, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message:
        """A request of this worker, as :mod:`psdk.protocol` declares ``op``."""
        return protocol.request(op, self.task_index, arrays, **fields)

    def to_all(self, op: str, **fields: Any) -> dict[int, Message]:
        """The same request to every shard."""
        return {i: self.message(op, **fields) for i in range(self.cluster.num_ps)}

    def request(
        self,
        messages: Mapping[int, Message],
        what: str,
        timeout_s: float | None = None,
        watch: bool = True,
    ) -> dict[int, Message]:
        """Send ``messages`` (shard index -> request) and wait for every reply (see :meth:`collect`)."""
        return self.collect(self.endpoint.start_many(messages), what, timeout_s, watch)

    def collect(
        self, pending: Pending, what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]:
        """Wait for the replies; a refusal from a ps becomes :class:`RemoteError`.

        ``watch``: give up early on a ps whose heartbeats stopped or that
        restarted (off while waiting for what may take long, e.g. the chief's init).
        """
        silence = self.heartbeat.silence if (self.heartbeat is not None and watch) else None
        timeout_s = timeout_s if timeout_s is not None else self.options.transport.request_timeout_s
        report = ReplyWait(self, what, timeout_s)
        try:
            replies = pending.wait(
                timeout_s,
                what,
                silence_s=silence,
                dead_after_s=self.options.transport.heartbeat_timeout_s,
                restarted=self._restarted if watch else None,
                report=report,
            )
        except PeerTimeoutError as exc:
            raise report.explained(exc, [i for i in pending.expected if i not in pending.replies]) from None
        for index, reply in replies.items():
            if reply.op == "error":
                raise RemoteError(self.names[index], str(reply.fields.get("error")), str(reply.fields.get("kind")))
        return replies

    def _restarted(self, index: int) -> bool:
        known, heard = self.boots[index], self.heartbeat.boot[index] if self.heartbeat else None
        return known is not None and heard is not None and heard != known and heard not in self._retired[index]

    def heard_from(self, index: int, boot: str | None) -> None:
        """A reply from shard ``index`` is as good as a heartbeat (a restarted ps may not have pinged back yet)."""
        if self.heartbeat is not None:
            self.heartbeat.last_heard[index] = time.monotonic()
            self.heartbeat.boot[index] = boot

    def set_boot(self, index: int, boot: str | None) -> None:
        """Shard ``index`` now runs as ``boot``; late heartbeats from its earlier process are ignored."""
        old = self.boots[index]
        if old is not None and old != boot:
            self._retired[index].add(old)
        self.boots[index] = boot

    # ---------------------------------------------------------------- layout
    def initialize(
        self,
        variables: Mapping[str, np.ndarray],
        job: JobSpec,
        rule: UpdateRule,
        sharding: str = "round_robin",
        restore: Checkpoint | None = None,
        epoch: int = 0,
        tables: Sequence[TableSpec] = (),
        partitioning: Partitioning | None = None,
    ) -> bool:
        """Chief only: place the variables (and ``tables``) on their shards; ``False`` if already initialised.

        ``partitioning``: split the variables it chooses across the shards (off by default); the plan travels in
        the job spec, and every worker still sees each variable whole.

        With ``restore``, the shards start from that checkpoint's variables,
        slots, rule step and global step instead (re-sharded by name).
        ``epoch``: a restore of a running job (a new epoch, which the waiting
        workers follow); 0 for a new or resumed job.
        """
        given, rule = rule, job.sync.rule_for(rule, job.num_workers)
        if rule != given:  # asynchrony adds momentum of its own (sync.scale_momentum)
            log.info("worker 0: %d async workers: the ps runs %s, not %s", job.num_workers, rule, given)
        variables = checked_variables(variables, rule, restore)
        restored = check_tables(restore, tables, rule.slot_names())
        self._creation_order = list(variables)
        self.rule_json = rule.to_json()
        self.fallback = initial_state(variables, rule, restore)
        plan = chosen_plan(partitioning, variables, self.cluster.num_ps)
        job = dataclasses.replace(job, partitions=plan)
        messages = init_requests(
            self.message, variables, job, rule, self.cluster.num_ps, sharding, restore, epoch, tables, plan=plan
        )
        announce(messages, restored, self.options.table_chunk_rows)
        replies = rejoining(
            self, lambda: self.request(messages, "initialising the variables", self.options.transport.init_timeout_s)
        )
        fresh = {reply.op == "ok" for reply in replies.values()}
        if len(fresh) > 1 and self.options.recovery_timeout_s is None:
            raise PsdkError(
                "some ps shards were already initialised and others were not; the shards belong "
                "to different jobs: restart every ps task"
            )
        self._set_layout(replies)
        if len(fresh) > 1:  # a ps was lost while the chief was down too: one cut for all, as after any loss
            self.recover("some ps shards held the job and others were empty (a ps was lost with the chief)")
            return False
        if restore is not None and restore.tables is not None and restored:
            finish_restore(self, restore.tables, restored, fresh == {True}, self.cluster.num_ps, self.options)
        return fresh == {True}

    def wait_initialized(self) -> None:
        """Non-chief workers: wait (bounded) until the chief has initialised every shard."""
        replies = rejoining(
            self,
            lambda: self.request(
                self.to_all("wait_init"),
                "the chief (worker 0) to initialise the variables",
                self.options.transport.init_timeout_s,
                watch=False,
            ),
        )
        self._set_layout(replies)

    def _set_layout(self, replies: Mapping[int, Message]) -> None:
        self.shards, params, grads = shards_from(replies, self.endpoint, self.cluster.num_ps)
        for index in range(self.cluster.num_ps):
            self.set_boot(index, replies[index].fields.get("boot"))
        self.epoch = int(replies[0].fields.get("epoch", 0))
        self.job = job_of(replies)
        self.tables = tables_of(replies)
        self._joined = Joined(self.job.partitions, params, grads)
        self._params, self._grads = self._joined.params, self._joined.grads
        if self.job.num_workers != self.cluster.num_workers:
            log.warning(
                "worker %d: the chief started the job with %d workers but this task's cluster has %d",
                self.task_index,
                self.job.num_workers,
                self.cluster.num_workers,
            )

    def renew(self) -> None:
        """After a recovery: lend a restarted ps again what the transport had lent its old self."""
        for index in range(self.cluster.num_ps):
            self.endpoint.renew(index)

    @property
    def initialized(self) -> bool:
        return bool(self.shards)

    def variable_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._joined.shapes({s.name: s.shape for shard in self.shards for s in shard.specs})

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The latest pulled parameters, as named views of the client's buffers."""
        return self._params

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """Named views of the gradient buffers; a backend may write straight into them."""
        return self._grads

    @property
    def global_step(self) -> int:
        return self.shards[0].version if self.shards else 0

    def _live(self) -> list[int]:
        """The shards a step talks to: those holding variables, or every one when the job has tables."""
        return [i for i, shard in enumerate(self.shards) if shard.size or self.tables]

    # ----------------------------------------------------------------- steps
    def pull(self) -> int:
        """Fetch every shard's parameters; returns the global step."""
        self._pull()
        return self.global_step

    def pull_rows(self, ids: Mapping[str, Any], read: bool = False) -> dict[str, np.ndarray]:
        """The parameters, and the rows of ``ids`` by table, in the order given (duplicates repeated). A training
        pull creates, counts and stamps the rows it names; ``read=True`` changes nothing (zeros for ids without one)."""
        return self._pull(ids, read)

    def _pull(self, ids: Mapping[str, Any] | None = None, read: bool = False) -> dict[str, np.ndarray]:
        parts, plans = plan_tables(self.tables, self.cluster.num_ps, pull=ids, read=read)
        messages = {i: with_tables(self.message("pull"), parts.get(i)) for i in self._live()}
        replies = self.request(messages, "pulling the parameters")
        for index, reply in replies.items():
            if reply.op == "resync":  # a restarted, empty ps: the wrap-up's recovery restores it
                raise PeerRestartedError(self.names[index], f"a pull ({reply.fields.get('why')})")
            self._take_params(index, reply)
        self._joined.gather()
        return pulled_rows(plans, replies)

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray] | None = None,
        rows: Mapping[str, RowPush] | None = None,
        pull: Mapping[str, Any] | None = None,
    ) -> StepResult:
        """Push one gradient per shard (default: :attr:`grads`) and ``rows`` (by table, ``(ids, grads)``), and
        take back the fresh parameters and the rows of ``pull`` (ids by table: :attr:`StepResult.rows`)."""
        return self.finish_push_pull(self.start_push_pull(grads, rows=rows, pull=pull))

    def row_room(self, table: str, ids: Any) -> np.ndarray:
        """Where to write the row gradients of ``ids`` (a pull's) for the next push of them: over shared memory,
        lent to the ps (:func:`psdk.client.rows.row_room`). Fill it after the last push finished; push it next."""
        return row_room(self.tables, table, ids, self.cluster.num_ps, self.endpoint.room)

    def basis(self) -> Basis:
        """What the current parameters are: take it when a gradient is computed from them."""
        return Basis(self.epoch, tuple(shard.version for shard in self.shards))

    def start_push_pull(
        self,
        grads: Mapping[str, np.ndarray] | None = None,
        copy: bool = False,
        basis: Basis | None = None,
        rows: Mapping[str, RowPush] | None = None,
        pull: Mapping[str, Any] | None = None,
    ) -> Pending:
        """Send this step's gradients to every shard; the replies are collected later.

        Between this and :meth:`finish_push_pull` the worker may prepare its next batch, but must not touch
        :attr:`params`, nor :attr:`grads` or the arrays of ``rows`` and ``pull`` unless ``copy``: then they are copied
        as they leave and the next gradient may be computed into them at once. ``basis`` says which parameters the
        gradients were computed from (default: the current ones). ``rows`` and ``pull``: see :meth:`push_pull`.
        One at a time: the next starts once this one finished.
        """
        if self._in_flight is not None:
            raise PsdkError("a push-and-pull is in flight: finish_push_pull it before the next starts")
        parts, self._row_plans = plan_tables(
            self.tables, self.cluster.num_ps, push=rows, pull=pull, copy=copy, previous=self._row_plans
        )
        if grads is not None:
            for name, view in self._grads.items():
                if grads[name] is not view:
                    np.copyto(view, grads[name], casting="same_kind")
        self._joined.scatter()
        basis = basis or self.basis()
        versions = round_versions(basis, self._live()) if self._rounds else basis.versions
        self._seq += 1
        messages, fields, grads_sent = {}, {}, {}
        for i in self._live():
            shard = self.shards[i]
            grad = shard.grads
            if copy:  # the next gradient may be computed into grads while this one travels
                np.copyto(shard.outbox, grad)
                grad = shard.outbox
            fields[i] = {"version": versions[i], "seq": self._seq, "epoch": basis.epoch}
            messages[i] = with_tables(self.message("push_pull", [grad], **fields[i]), parts.get(i))
            messages[i].stable = True  # one of the shard's long-lived buffers (which the transport may have lent)
            grads_sent[i] = grad
        pending = self.endpoint.start_many(messages)
        self._in_flight = InFlight(pending, grads_sent, fields, parts)
        return pending

    @property
    def _rounds(self) -> bool:
        return self.job is not None and self.job.sync.waits_for_rounds

    def finish_push_pull(self, pending: Pending) -> StepResult:
        """Wait for every shard's reply and take in the fresh parameters (and the rows it pulled).

        With recovery on, a lost ps or a "resync" reply is waited out: the
        chief restores the shards from its latest checkpoint, the others wait
        for it, and every worker pulls the restored parameters (and rows).
        """
        step = self._in_flight
        if step is None or step.pending is not pending:
            raise PsdkError("finish_push_pull takes the push-and-pull this client started last, once")
        self._in_flight = None
        plans = self._row_plans  # kept: the next push, of these ids, takes their split
        result, replies = self._finish(step)
        if not plans:
            return result
        if replies is None:  # recovered: the rows are pulled again from the restored shards
            return dataclasses.replace(result, rows=self._pull({name: plan.ids for name, plan in plans.items()}))
        return dataclasses.replace(result, rows=pulled_rows(plans, replies))

    def _finish(self, step: InFlight) -> tuple[StepResult, dict[int, Message] | None]:
        outcome: StepResult | dict[int, Message]
        try:  # a refused named pull is sent again with its ids wherever the replies are collected (collect_step)
            try:
                outcome = collect_step(self, step, lambda: self.collect(step.pending, "a push-and-pull"))
            except PeerTimeoutError as exc:
                if self.options.recovery_timeout_s is None:
                    raise
                outcome = collect_step(self, step, partial(recovery.after_timeout, self, step.pending, exc))
        except (PeerDeadError, PeerRestartedError) as exc:
            if self.options.recovery_timeout_s is None:
                raise
            return self.recover(str(exc)), None
        if isinstance(outcome, StepResult):
            return outcome, None
        replies = outcome
        resync = [r for r in replies.values() if r.op == "resync"]
        if resync:
            if self.options.recovery_timeout_s is None:
                raise PsdkError(f"the job needs recovery ({resync[0].fields.get('why')}) but recovery is off")
            return self.recover(str(resync[0].fields.get("why"))), None
        done = False
        for index, reply in replies.items():
            self._take_params(index, reply)
            done = done or bool(reply.fields.get("done"))
        self._joined.gather()
        head = replies[0].fields if 0 in replies else {}
        slowest = head.get("slowest")
        result = StepResult(
            self.global_step, done, str(head.get("outcome", "")), int(slowest) if slowest is not None else None
        )
        return result, replies

    def _take_params(self, index: int, reply: Message) -> None:
        shard = self.shards[index]
        if not reply.arrays or reply.arrays[0].shape != shard.params.shape:
            raise PsdkError(f"{self.names[index]} sent parameters of the wrong size")
        if reply.arrays[0] is not shard.params:  # else the transport wrote them in place
            np.copyto(shard.params, reply.arrays[0])
        shard.version = int(reply.fields["version"])

    def recover(self, why: str) -> StepResult:
        """Get back onto the job after a ps was lost or the chief restored it; no push names a pull from before."""
        self._row_plans, self._in_flight = {}, None
        return recovery.recover(self, why)

    # -------------------------------------------------------------- the end
    def finish(self, report: Mapping[str, Any], stays: bool = False) -> None:
        """Tell every shard this worker is done, with its report (see :func:`wrapup.finish`)."""
        wrapup.finish(self, report, stays)

    def status(self) -> dict[str, Any]:
        return self.request({0: self.message("status")}, "status")[0].fields

    def statuses(self, reports: bool = False) -> dict[int, dict[str, Any]]:
        """Every shard's status; ``reports`` (the chief): the finished workers' reports too (see :mod:`wrapup`)."""
        return wrapup.statuses(self, reports)

    def wrapping_up(self, attempt: Callable[[], T], what: str) -> T:
        """``attempt``, a step of the end of training, again after a lost ps was restored (see :mod:`wrapup`)."""
        return wrapup.wrapping_up(self, attempt, what)

    def stats(self) -> list[dict[str, Any]]:
        replies = self.request(self.to_all("stats"), "ps statistics")
        return [replies[i].fields for i in range(self.cluster.num_ps)]

    def wait_for_workers(self, timeout_s: float) -> dict[str, dict[str, str]]:
        """Chief: wait until every other worker finished or is known dead (see :mod:`psdk.client.wrapup`)."""
        return wrapup.wait_for_workers(self, timeout_s)

    def wait_collected(self, timeout_s: float) -> bool:
        """Not the chief: wait until the chief has this worker's report (see :mod:`psdk.client.wrapup`)."""
        return wrapup.wait_collected(self, timeout_s)

    def checkpoint_state(self, max_rounds: int = 50, folder: Path | None = None) -> Checkpoint:
        """Chief: a consistent cut of every shard (:mod:`psdk.client.cut`); tables stream into a file in ``folder``."""
        order = self._joined.part_order(self._creation_order)
        chunk_rows = self.options.table_chunk_rows
        cut = checkpoint_cut(self, self.shards, order, max_rounds, self.tables, folder, chunk_rows)
        return self._joined.join_state(cut)

    def stop_at(self, version: int) -> int:
        """Chief: end training at ``version`` (or now, if past it); returns the new target step."""
        replies = self.request(self.to_all("stop_at", version=int(version)), "stopping the job early")
        return int(replies[0].fields["steps"])

    def shutdown(self) -> None:
        """Chief: end the job; every ps task exits."""
        self.request(self.to_all("shutdown"), "shutting the ps tasks down", timeout_s=10.0)

    def abort(self, reason: str) -> None:
        """Chief: stop the job after a failure; best effort, never raises."""
        reason = reason if len(reason) <= 2000 else reason[:2000] + "…"  # a request header has its limits
        try:
            self.request(self.to_all("abort", reason=reason), "aborting the job", timeout_s=5.0)
        except PsdkError as exc:
            log.warning("worker %d: could not abort every ps: %s", self.task_index, exc)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.endpoint.close()
