"""The worker's side of the ps: the shard map, pipelined push-and-pull, heartbeats.

Each step is one combined push-and-pull request per shard, all in flight at
once. Gradients and parameters of a shard each travel as one contiguous
float32 buffer; the client keeps one preallocated buffer of each per shard
and hands out named views of them, so a step allocates no large array. A
wait gives up when the ps it waits for stops answering heartbeats, or at the
request timeout, and the error names that ps.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from psdk.checkpoint import Checkpoint
from psdk.cluster import ClusterSpec
from psdk.errors import (
    CheckpointAbandoned,
    PeerDeadError,
    PeerRestartedError,
    PeerTimeoutError,
    PsdkError,
    RemoteError,
    TransportError,
)
from psdk.failpoints import CHECKPOINT_PAUSED, failpoint
from psdk.jobspec import JobSpec
from psdk.optim import UpdateRule
from psdk.sharding import VarSpec, assign_shards, flat_size, layout, views
from psdk.shm import WorkerBuffers
from psdk.transport import ClientEndpoint, Pending, Transport
from psdk.wire import HEARTBEAT_SUFFIX, Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientOptions:
    """A worker's settings: its timeouts, and those of the transport :func:`psdk.connect` makes for it.

    The last three are ``transport.*`` keys of the config tree, as the MNIST job passes them; they shape the
    ZeroMQ transport ``connect`` opens (a transport passed to ``connect`` brings its own settings).
    """

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    init_timeout_s: float = 300.0
    recovery_timeout_s: float | None = None
    """When set, a lost ps or a restored job is waited out (this long at most) instead of failing."""
    shared_memory: bool = True
    """Offer a ps on this host shared memory for the arrays (it may turn the offer down); False: ZeroMQ frames."""
    doorbells: bool = True
    """With shared memory, pushes and replies ring pipes instead of crossing ZeroMQ (see psdk.shm)."""
    io_threads: int = 1
    """ZeroMQ I/O threads of this worker's transport."""


@dataclass(frozen=True)
class StepResult:
    """What one push-and-pull did, seen from shard 0 (which keeps the global step)."""

    global_step: int
    done: bool
    outcome: str
    slowest: int | None = None
    """Async and ssp: iterations the slowest live worker had finished when this reply left."""


@dataclass(frozen=True)
class Basis:
    """The parameters a gradient was computed from: the job's epoch and each shard's version.

    A worker that computes its next gradient while the last push is still in
    flight sends it with the basis it was computed from, not the newer
    versions the reply brought in meanwhile, so the ps measures (and, with
    ssp, bounds) its staleness truly.
    """

    epoch: int
    versions: tuple[int, ...]


class Heartbeat(threading.Thread):
    """Pings every shard from its own sockets, and remembers when each last answered."""

    def __init__(
        self,
        transport: Transport,
        addresses: list[str],
        names: list[str],
        worker: int,
        interval_s: float,
        identity: bytes | None = None,
    ):
        super().__init__(name=f"psdk-heartbeat-{worker}", daemon=True)
        self.transport, self.addresses, self.names = transport, addresses, names
        self.worker, self.interval_s, self.identity = worker, interval_s, identity
        self.last_heard: list[float | None] = [None] * len(addresses)
        self.boot: list[str | None] = [None] * len(addresses)
        self._stop_event = threading.Event()
        self._ready = threading.Event()

    def run(self) -> None:
        endpoint = self.transport.connect(self.addresses, self.names, self.identity)
        self._ready.set()
        try:
            while not self._stop_event.is_set():
                for index in range(len(self.addresses)):
                    ping = Message("ping", {"worker": self.worker}, rid=endpoint.new_rid())
                    # No connection or a full queue: the ps's silence tells the rest. Never wait here,
                    # or stop() would find this thread stuck on a socket about to be closed.
                    with contextlib.suppress(TransportError):
                        endpoint.send(index, ping, wait_s=0.0)
                deadline = time.monotonic() + self.interval_s
                while not self._stop_event.is_set() and (left := deadline - time.monotonic()) > 0:
                    for index, pong in endpoint.receive(min(left, 0.1)):
                        self.last_heard[index] = time.monotonic()
                        self.boot[index] = pong.fields.get("boot")
        finally:
            endpoint.close()

    def silence(self, index: int) -> float | None:
        heard = self.last_heard[index]
        return None if heard is None else time.monotonic() - heard

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5.0)


@dataclass
class Shard:
    """The client's copy of one shard: layout, version, and its two flat buffers."""

    specs: list[VarSpec]
    version: int
    params: np.ndarray
    grads: np.ndarray
    buffers: WorkerBuffers | None = None
    """The gradient (and a reply region) in memory a ps on this host can map; ``grads`` lives there."""
    shared: bool = False
    """The ps has mapped :attr:`buffers`: arrays go through them, messages carry only headers."""
    knocks: bool = False
    """The ps listens for knocks on :attr:`buffers`: a push is a knock, not a message."""

    @property
    def size(self) -> int:
        return int(self.params.size)


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
        self._creation_order: list[str] = []
        self.epoch = 0
        self.boots: list[str | None] = [None] * cluster.num_ps
        """Each shard's boot id as of the last layout: a different one means it restarted."""
        self._retired: list[set[str]] = [set() for _ in range(cluster.num_ps)]
        self.rule_json: dict[str, Any] = {}
        self._fallback: Checkpoint | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.recovery_source: Callable[[], Checkpoint | None] | None = None
        """The chief's state to restore a lost shard from (its latest checkpoint), if any."""
        self.heartbeat: Heartbeat | None = None
        if heartbeat:
            self.heartbeat = Heartbeat(
                transport,
                self.addresses,
                self.names,
                task_index,
                self.options.heartbeat_interval_s,
                self.identity + HEARTBEAT_SUFFIX,
            )
            self.heartbeat.start()
            self.heartbeat._ready.wait(timeout=5.0)

    # -------------------------------------------------------------- requests
    def _fields(self, **extra: Any) -> dict[str, Any]:
        return {"worker": self.task_index, **extra}

    def _request(
        self,
        messages: Mapping[int, Message],
        what: str,
        timeout_s: float | None = None,
        watch: bool = True,
    ) -> dict[int, Message]:
        return self._collect(self.endpoint.start_many(messages), what, timeout_s, watch)

    def _collect(
        self, pending: Pending, what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]:
        """Wait for the replies; a refusal from a ps becomes :class:`RemoteError`."""
        silence = self.heartbeat.silence if (self.heartbeat is not None and watch) else None
        replies = pending.wait(
            timeout_s if timeout_s is not None else self.options.request_timeout_s,
            what,
            silence_s=silence,
            dead_after_s=self.options.heartbeat_timeout_s,
            restarted=self._restarted if watch else None,
        )
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

    def _all(self, op: str, **fields: Any) -> dict[int, Message]:
        return {i: Message(op, self._fields(**fields)) for i in range(self.cluster.num_ps)}

    # ---------------------------------------------------------------- layout
    def initialize(
        self,
        variables: Mapping[str, np.ndarray],
        job: JobSpec,
        rule: UpdateRule,
        sharding: str = "round_robin",
        restore: Checkpoint | None = None,
    ) -> bool:
        """Chief only: place the variables on their shards; ``False`` if already initialised.

        With ``restore``, the shards start from that checkpoint's variables,
        slots, rule step and global step instead (re-sharded by name).
        """
        if restore is not None:
            restore.check_matches({n: tuple(np.shape(v)) for n, v in variables.items()})
            expected = set(rule.slot_names())
            if set(restore.slots) != expected:
                raise PsdkError(
                    f"the checkpoint keeps optimizer slots {sorted(restore.slots)} "
                    f"({restore.rule.get('name')}) but optimizer={rule.name} keeps {sorted(expected)}: "
                    f"resume with optimizer={restore.rule.get('name')}"
                )
            variables = restore.variables
        order = [(name, tuple(np.shape(value))) for name, value in variables.items()]
        self._creation_order = [name for name, _ in order]
        self.rule_json = rule.to_json()
        self._fallback = restore or Checkpoint(
            global_step=0,
            variables={n: np.array(v, np.float32) for n, v in variables.items()},
            slots={s: {n: np.zeros(np.shape(v), np.float32) for n, v in variables.items()} for s in rule.slot_names()},
            rule=self.rule_json,
        )
        placement = assign_shards(order, self.cluster.num_ps, sharding)
        messages = {}
        for index in range(self.cluster.num_ps):
            names = [name for name, _ in order if placement[name] == index]
            arrays = [np.ascontiguousarray(variables[n], dtype=np.float32) for n in names]
            fields = self._fields(job=job.to_json(), rule=rule.to_json(), names=names)
            if restore is not None:
                slot_names = list(restore.slots)
                fields["restore"] = {
                    "version": restore.global_step,
                    "rule_step": restore.rule_step,
                    "slots": slot_names,
                }
                arrays += [
                    np.ascontiguousarray(restore.slots[s][n], dtype=np.float32) for s in slot_names for n in names
                ]
            messages[index] = Message("init", fields, arrays)
        replies = self._rejoining(
            lambda: self._request(messages, "initialising the variables", self.options.init_timeout_s)
        )
        fresh = {reply.op == "ok" for reply in replies.values()}
        if len(fresh) > 1:
            raise PsdkError(
                "some ps shards were already initialised and others were not; the shards belong "
                "to different jobs: restart every ps task"
            )
        self._set_layout(replies)
        return fresh == {True}

    def wait_initialized(self) -> None:
        """Non-chief workers: wait (bounded) until the chief has initialised every shard."""
        replies = self._rejoining(
            lambda: self._request(
                self._all("wait_init"),
                "the chief (worker 0) to initialise the variables",
                self.options.init_timeout_s,
                watch=False,
            )
        )
        self._set_layout(replies)

    def _rejoining(self, request: Callable[[], dict[int, Message]]) -> dict[int, Message]:
        """``request``, retried while a ps still holds this worker's previous (dead) connection.

        A restarted worker gets in once the ps has declared its old process
        dead, which takes at most a heartbeat timeout.
        """
        deadline = time.monotonic() + self.options.heartbeat_timeout_s + 10.0
        while True:
            try:
                return request()
            except RemoteError as exc:
                if "another session" not in exc.remote_message or time.monotonic() > deadline:
                    raise
                log.info("worker %d: the ps still holds this worker's old connection; retrying", self.task_index)
                time.sleep(0.5)

    def _set_layout(self, replies: Mapping[int, Message]) -> None:
        self._release_buffers()
        self.shards, self._params, self._grads = [], {}, {}
        jobs = set()
        for index in range(self.cluster.num_ps):
            fields = replies[index].fields
            specs = layout([(n, tuple(s)) for n, s in zip(fields["names"], fields["shapes"], strict=True)])
            size = flat_size(specs)
            buffers = self._new_buffers(size)
            grads = buffers.grads if buffers is not None else np.zeros(size, np.float32)
            shard = Shard(specs, int(fields["version"]), np.zeros(size, np.float32), grads, buffers)
            self.shards.append(shard)
            self._params.update(views(shard.params, specs))
            self._grads.update(views(shard.grads, specs))
            jobs.add(repr(fields["job"]))
            self.set_boot(index, fields.get("boot"))
        self.epoch = int(replies[0].fields.get("epoch", 0))
        self.job = JobSpec.from_json(replies[0].fields["job"])
        if len(jobs) > 1:
            raise PsdkError("the ps shards were initialised for different jobs: restart every ps task")
        if self.job.num_workers != self.cluster.num_workers:
            log.warning(
                "worker %d: the chief started the job with %d workers but this task's cluster has %d",
                self.task_index,
                self.job.num_workers,
                self.cluster.num_workers,
            )
        self.share_memory()

    def _new_buffers(self, size: int) -> WorkerBuffers | None:
        if not (self.endpoint.shares_memory and size):
            return None
        try:
            return WorkerBuffers(size)
        except OSError as exc:  # e.g. a memfd limit: plain frames work as well, only slower
            log.info("worker %d: no shared memory for a shard (%s); its arrays go over ZeroMQ", self.task_index, exc)
            return None

    def share_memory(self) -> None:
        """Offer every ps the shard buffers it can map (it must be on this host); the rest use frames.

        Called again after a recovery: a restarted ps has to map them anew.
        """
        bell = self.endpoint.doorbells
        offers = {
            i: Message("attach", self._fields(**shard.buffers.offer(bell)))
            for i, shard in enumerate(self.shards)
            if shard.buffers is not None and shard.size
        }
        if not offers:
            return
        try:
            replies = self._collect(self.endpoint.start_many(offers), "sharing memory with the ps")
        except RemoteError as exc:  # e.g. a ps of an older psdk that does not know the request
            log.info("worker %d: no shared memory (%s); arrays go over ZeroMQ", self.task_index, exc)
            replies = {}
        for index in offers:
            self.shards[index].shared = self.shards[index].knocks = False
            self.endpoint.ring_off(index)
        for index, reply in replies.items():
            shard = self.shards[index]
            shard.shared = reply.op == "attached"
            if shard.shared and bell and reply.fields.get("bell") and shard.buffers is not None:
                self.endpoint.ring_on(index, shard.buffers.bell, shard.buffers.take_reply)
                shard.knocks = bool(reply.fields.get("knock"))
                if shard.knocks:
                    shard.buffers.knocks_heard()
            if not shard.shared:
                log.info(
                    "worker %d: %s does not share memory (%s); arrays go over ZeroMQ",
                    self.task_index,
                    self.names[index],
                    reply.fields.get("error"),
                )

    def _release_buffers(self) -> None:
        for index, shard in enumerate(self.shards):
            if shard.buffers is not None:
                self.endpoint.ring_off(index)
                shard.buffers.close()
                shard.shared = shard.knocks = False

    @property
    def initialized(self) -> bool:
        return bool(self.shards)

    def variable_shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for shard in self.shards for s in shard.specs}

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
        return [i for i, shard in enumerate(self.shards) if shard.size]

    # ----------------------------------------------------------------- steps
    def pull(self) -> int:
        """Fetch every shard's parameters; returns the global step."""
        messages = {i: Message("pull", self._fields()) for i in self._live()}
        for index, reply in self._request(messages, "pulling the parameters").items():
            self._take_params(index, reply)
        return self.global_step

    def push_pull(self, grads: Mapping[str, np.ndarray] | None = None) -> StepResult:
        """Push one gradient per shard and take back the fresh parameters.

        ``grads`` defaults to what was written into :attr:`grads`.
        """
        return self.finish_push_pull(self.start_push_pull(grads))

    def basis(self) -> Basis:
        """What the current parameters are: take it when a gradient is computed from them."""
        return Basis(self.epoch, tuple(shard.version for shard in self.shards))

    def start_push_pull(
        self, grads: Mapping[str, np.ndarray] | None = None, copy: bool = False, basis: Basis | None = None
    ) -> Pending:
        """Send this step's gradients to every shard; the replies are collected later.

        Between this and :meth:`finish_push_pull` the worker may prepare its
        next batch, but must not touch :attr:`params`, nor :attr:`grads`
        unless ``copy``: then the gradients are copied as they leave and the
        next one may be computed into :attr:`grads` at once. ``basis`` says
        which parameters the gradients were computed from (default: the
        current ones).
        """
        if grads is not None:
            for name, view in self._grads.items():
                if grads[name] is not view:
                    np.copyto(view, grads[name], casting="same_kind")
        basis = basis or self.basis()
        self._seq += 1
        messages, knocked = {}, {}
        for i in self._live():
            shard = self.shards[i]
            fields = self._fields(version=basis.versions[i], seq=self._seq, epoch=basis.epoch)
            if shard.shared and shard.buffers is not None:
                slot = "outbox" if copy else "grads"
                if copy:
                    np.copyto(shard.buffers.outbox, shard.grads)
                if shard.knocks:
                    rid = self.endpoint.new_rid()
                    if shard.buffers.knock(rid, basis.versions[i], self._seq, basis.epoch, slot):
                        knocked[i] = rid
                        continue
                fields["shm"] = slot
                messages[i] = Message("push_pull", fields)
            else:
                messages[i] = Message("push_pull", fields, [shard.grads], stable=not copy, volatile=copy)
        pending = self.endpoint.start_many(messages)
        pending.expected.update(knocked)
        return pending

    def finish_push_pull(self, pending: Pending) -> StepResult:
        """Wait for every shard's reply and take in the fresh parameters.

        With recovery on, a lost ps or a "resync" reply is waited out: the
        chief restores the shards from its latest checkpoint, the others wait
        for it, and every worker pulls the restored parameters.
        """
        try:
            replies = self._collect(pending, "a push-and-pull")
        except (PeerDeadError, PeerRestartedError) as exc:
            if self.options.recovery_timeout_s is None:
                raise
            return self.recover(str(exc))
        except PeerTimeoutError as exc:
            if self.options.recovery_timeout_s is None:
                raise
            from psdk.recovery import after_timeout

            outcome = after_timeout(self, pending, exc)
            if isinstance(outcome, StepResult):
                return outcome
            replies = outcome
        resync = [r for r in replies.values() if r.op == "resync"]
        if resync:
            if self.options.recovery_timeout_s is None:
                raise PsdkError(f"the job needs recovery ({resync[0].fields.get('why')}) but recovery is off")
            return self.recover(str(resync[0].fields.get("why")))
        done = False
        for index, reply in replies.items():
            self._take_params(index, reply)
            done = done or bool(reply.fields.get("done"))
        head = replies[0].fields if 0 in replies else {}
        slowest = head.get("slowest")
        return StepResult(
            self.global_step, done, str(head.get("outcome", "")), int(slowest) if slowest is not None else None
        )

    def _take_params(self, index: int, reply: Message) -> None:
        shard = self.shards[index]
        if reply.fields.get("shm"):
            if shard.buffers is None:
                raise PsdkError(f"{self.names[index]} answered through shared memory this worker did not offer it")
            shard.buffers.read_params(shard.params, reply.rid)
        elif len(reply.arrays) != 1 or reply.arrays[0].shape != shard.params.shape:
            raise PsdkError(f"{self.names[index]} sent parameters of the wrong size")
        else:
            np.copyto(shard.params, reply.arrays[0])
        shard.version = int(reply.fields["version"])

    def recover(self, why: str) -> StepResult:
        """Get back onto the job after a ps was lost or the chief restored it."""
        from psdk.recovery import recover

        return recover(self, why)

    # -------------------------------------------------------------- the end
    def finish(self, report: Mapping[str, Any]) -> None:
        """Tell every shard this worker is done (and, to shard 0, how it went)."""
        messages = {
            i: Message("finish", self._fields(report=dict(report) if i == 0 else None))
            for i in range(self.cluster.num_ps)
        }
        self._request(messages, "acknowledging the end of training")

    def status(self) -> dict[str, Any]:
        return self._request({0: Message("status", self._fields())}, "status")[0].fields

    def stats(self) -> list[dict[str, Any]]:
        replies = self._request(self._all("stats"), "ps statistics")
        return [replies[i].fields for i in range(self.cluster.num_ps)]

    def wait_for_workers(self, timeout_s: float) -> dict[str, dict[str, str]]:
        """Chief: wait until every other worker finished or is known dead."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.status()["workers"]
            waiting = [
                i for i, w in workers.items() if w["status"] in ("alive", "unseen") and int(i) != self.task_index
            ]
            if not waiting:
                return dict(workers)
            if time.monotonic() > deadline:
                raise TransportError(
                    f"timed out after {timeout_s:.0f} s waiting for worker(s) {', '.join(waiting)} to finish"
                )
            time.sleep(0.05)

    def checkpoint_state(self, max_rounds: int = 50) -> Checkpoint:
        """Chief: a consistent cut of every shard at one global step, collected over the transport.

        Every shard is asked to stop applying pushes once it reaches the
        highest version any shard has (pushes beyond it wait on the ps); a
        shard already past it raises the target. Once all stand at the same
        version their variables and slots are read and the shards resume.
        """
        versions = self._request(self._all("status"), "shard versions for a checkpoint")
        target = max(int(r.fields["version"]) for r in versions.values())
        failed = True
        try:
            for _ in range(max_rounds):
                replies = self._request(
                    self._all("pause_at", version=target),
                    f"every shard to reach version {target} for a checkpoint",
                )
                passed = [int(r.fields["version"]) for r in replies.values() if r.op == "passed"]
                if not passed:
                    break
                target = max(passed)
            else:
                raise PsdkError(f"the shards did not settle on one version in {max_rounds} rounds")
            failpoint(CHECKPOINT_PAUSED)
            states = self._request(self._all("state"), "the shards' state for a checkpoint")
            failed = False
        except RemoteError as exc:
            if exc.kind != "not_paused":
                raise
            raise CheckpointAbandoned(f"the checkpoint pause ended before every state was read: {exc}") from exc
        finally:
            try:
                self._request(self._all("resume"), "resuming after a checkpoint")
            except TransportError:
                if not failed:
                    raise  # else the first error says more
        return self._assemble(states, target)

    def _assemble(self, states: Mapping[int, Message], version: int) -> Checkpoint:
        variables: dict[str, np.ndarray] = {}
        slots: dict[str, dict[str, np.ndarray]] = {}
        rule: dict[str, Any] = {}
        rule_step = 0
        for index in range(self.cluster.num_ps):
            reply = states[index]
            if int(reply.fields["version"]) != version:  # a pause lapsed between the reads
                raise CheckpointAbandoned(
                    f"{self.names[index]} was at version {reply.fields['version']}, not {version}, "
                    "when its state was read: the checkpoint would not be a consistent cut"
                )
            specs = self.shards[index].specs
            variables.update({n: v.copy() for n, v in views(reply.arrays[0], specs).items()})
            for slot, flat in zip(reply.fields["slots"], reply.arrays[1:], strict=True):
                slots.setdefault(slot, {}).update({n: v.copy() for n, v in views(flat, specs).items()})
            if index == 0:
                rule, rule_step = dict(reply.fields["rule"]), int(reply.fields["rule_step"])
        order = self._creation_order or [s.name for shard in self.shards for s in shard.specs]
        return Checkpoint(
            global_step=version,
            variables={n: variables[n] for n in order},
            slots={s: {n: by_name[n] for n in order} for s, by_name in slots.items()},
            rule=rule,
            rule_step=rule_step,
        )

    def stop_at(self, version: int) -> int:
        """Chief: end training at ``version`` (or now, if past it); returns the new target step."""
        replies = self._request(self._all("stop_at", version=int(version)), "stopping the job early")
        return int(replies[0].fields["steps"])

    def shutdown(self) -> None:
        """Chief: end the job; every ps task exits."""
        self._request(self._all("shutdown"), "shutting the ps tasks down", timeout_s=10.0)

    def abort(self, reason: str) -> None:
        """Chief: stop the job after a failure; best effort, never raises."""
        reason = reason if len(reason) <= 2000 else reason[:2000] + "…"  # a request header has its limits
        try:
            self._request(self._all("abort", reason=reason), "aborting the job", timeout_s=5.0)
        except PsdkError as exc:
            log.warning("worker %d: could not abort every ps: %s", self.task_index, exc)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.endpoint.close()
        self._release_buffers()
