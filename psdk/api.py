"""The public API: connect to the cluster as a worker, wrap your optimizer, step.

::

    cluster = psdk.ClusterSpec({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1"] * 2})
    with psdk.connect(cluster, task_index=0, steps=1000, sync="sync", keys="keys") as session:
        opt = psdk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, session)
        opt.broadcast_parameters()
        while not session.should_stop():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        session.finish()        # the chief also waits here for the other workers
        if session.is_chief:
            opt.pull()          # the final parameters of the ps, into the model
    # leaving the block, the chief shuts the ps tasks down

psdk's training loop (:mod:`psdk.jobs.worker`), which runs every workload, is written on this same API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from psdk.client import Basis, ClientOptions, ParameterClient, StepResult, checkpoint
from psdk.client.checkpoint import Checkpoint, new_run_id
from psdk.client.recovery import latest_or_none
from psdk.client.rows import table_specs, unique_ids
from psdk.client.shards import StepTimes
from psdk.errors import (
    CheckpointAbandoned,
    PeerDeadError,
    PeerRestartedError,
    PsdkError,
    TrainingResumed,
)
from psdk.plugins.backend import Backend
from psdk.plugins.loading import backend_for
from psdk.plugins.variables import Rows, tables_of
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec, check_run_id
from psdk.protocol.partitions import Partitioning
from psdk.protocol.tables import TableSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import UpdateRule
from psdk.transport import Pending, Transport, security
from psdk.transport.security import CurveKeys
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

log = logging.getLogger(__name__)


class WorkerSession:
    """One worker's membership in a job; the chief (task 0) also configures and ends it."""

    def __init__(
        self,
        client: ParameterClient,
        job: JobSpec,
        sharding: str,
        transport: Transport | None = None,
        run_id_given: bool = False,
        partitioning: Partitioning | None = None,
    ):
        self.client = client
        self.job = job
        self.sharding = sharding
        self.partitioning = partitioning
        """Which variables the chief splits across the shards (``connect(partitioning=)``); None: none."""
        self._own_transport = transport
        self._last: StepResult | None = None
        self._finished = False
        self.checkpoint_dir: Path | None = None
        """Where this run's checkpoints are (``connect(checkpoint_dir=)``): a lost ps is restored from them."""
        self.run_id_given = run_id_given
        """``connect(run_id=)`` named the run (else the chief made one, and takes the shards' if they hold one)."""

    @property
    def task_index(self) -> int:
        return self.client.task_index

    @property
    def is_chief(self) -> bool:
        return self.client.task_index == 0

    @property
    def global_step(self) -> int:
        return self.client.global_step

    @property
    def run_id(self) -> str | None:
        """The run's id: the one the shards hold once the job is initialised (a restarted chief takes theirs)."""
        job = self.client.job or self.job
        return job.run_id

    def latest_checkpoint(self) -> Checkpoint | None:
        """This run's newest valid checkpoint in ``checkpoint_dir``; damaged ones are skipped, and logged."""
        if self.checkpoint_dir is None or self.run_id is None:
            return None
        return latest_or_none(self.checkpoint_dir, self.run_id)

    def should_stop(self) -> bool:
        """True once the ps said the job reached its target step (or was stopped)."""
        return self._last is not None and self._last.done

    def record(self, result: StepResult) -> StepResult:
        self._last = result
        return result

    def finish(self, report: Mapping[str, Any] | None = None, wait_s: float = 120.0) -> dict[str, Any]:
        """Tell the ps this worker is done training.

        The chief then waits (at most ``wait_s``) until every other worker has
        finished or is known dead, collecting their reports, and returns each
        worker's state; the ps tasks keep serving pulls until the chief's
        session closes. Another worker waits (at most ``wait_s``) until the
        chief has its report: until then a lost ps could learn only from it
        that it finished. A ps lost meanwhile is restored (recovery on); if
        the restore went back before the job's end, this raises
        :class:`~psdk.errors.TrainingResumed`: train on until
        ``should_stop()``, then finish again.
        """
        try:
            self.client.finish(report or {}, stays=not self.is_chief)
            if not self.is_chief:
                self.client.wait_collected(wait_s)
                workers: dict[str, Any] = {}
            else:
                workers = self.client.wait_for_workers(wait_s)
        except TrainingResumed as resumed:
            self.record(StepResult(resumed.global_step, False, "resync"))
            raise
        self._finished = True
        return workers

    def save_checkpoint(self, folder: Path | str, config: str = "", fingerprint: str = "", **extra: Any) -> Path | None:
        """Chief: write a consistent checkpoint of every shard to ``folder/ckpt-<run id>-<step>.npz``.

        If a ps is lost meanwhile and recovery is on, no checkpoint is written:
        the job is restored from the previous one instead (returns ``None``).
        If the shards ended the pause first (this session was silent for
        ``ps.pause_lease_s``), this checkpoint is skipped with a warning and
        ``None`` is returned: the next one is written when it is due. A file
        the disk refuses (full, read-only) raises :class:`~psdk.runtime.disks.WriteError`
        naming it and the fix, and leaves no partial file and every older one.
        """
        if not self.is_chief:
            raise PsdkError("only the chief (worker 0) writes checkpoints")
        began = time.perf_counter()
        try:
            state = self.client.checkpoint_state(folder=Path(folder))  # tables stream into a file there
        except (PeerDeadError, PeerRestartedError) as exc:
            if self.client.options.recovery_timeout_s is None:
                raise
            self.record(self.client.recover(f"{exc} during a checkpoint"))
            return None
        except CheckpointAbandoned as exc:
            log.warning("worker 0: checkpoint skipped, the next is written when due: %s", exc)
            return None
        collected = time.perf_counter()
        state.config, state.extra, state.fingerprint, state.run_id = config, dict(extra), fingerprint, self.run_id
        path = checkpoint.save(state, checkpoint.path_for(Path(folder), state.global_step, self.run_id))
        log.info(
            "worker 0: checkpoint at global step %d written to %s (%.1f ms collecting, %.1f ms writing)",
            state.global_step,
            path,
            (collected - began) * 1e3,
            (time.perf_counter() - collected) * 1e3,
        )
        return path

    def close(self) -> None:
        self.client.close()
        if self._own_transport is not None:
            self._own_transport.close()
            self._own_transport = None

    def __enter__(self) -> WorkerSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None:
                if self.is_chief and self.client.initialized:
                    self.client.abort(f"{exc_type.__name__ if exc_type else 'error'}: {exc}")
                return
            if self.client.initialized and not self._finished:
                self.finish()
            if self.is_chief and self.client.initialized:
                self.client.shutdown()
        finally:
            self.close()


def connect(
    cluster: ClusterSpec,
    task_index: int,
    *,
    steps: int,
    sync: str | SyncSpec = "async",
    replicas_to_aggregate: int | None = None,
    sharding: str = "round_robin",
    options: ClientOptions | None = None,
    transport: Transport | None = None,
    keys: Path | str | CurveKeys | None = None,
    secure: bool = True,
    checkpoint_dir: Path | str | None = None,
    run_id: str | None = None,
    partitioning: Partitioning | None = None,
) -> WorkerSession:
    """Join ``cluster`` as worker ``task_index``.

    ``steps`` (the target global step), ``sync`` and ``replicas_to_aggregate``
    configure the job; only the chief's values reach the ps, as only the
    chief's graph mattered in TensorFlow. ``keys``: the job's key folder
    (``python -m psdk keys``; this worker reads its own secret and the ps
    tasks' public keys from it), or keys already loaded
    (:func:`psdk.transport.security.load_worker`): they authenticate this worker and
    encrypt its traffic, as every ps expects unless it was started with
    ``transport.secure=false``; then pass ``secure=False`` here too. A
    ``transport`` of your own (e.g. in-process, for tests) brings its own.
    ``options.transport`` (``psdk.TransportOptions``, the ``transport.*``
    keys of the config tree, which the MNIST job passes as they are) holds
    this worker's timeouts and the settings of the transport made for it:
    heartbeats, shared memory, doorbells, I/O threads.
    With ``options.recovery_timeout_s`` set, the chief restores a lost ps
    from this run's latest checkpoint in ``checkpoint_dir`` (or the initial
    state) and the other workers wait for it. ``run_id`` names the run: its
    checkpoints carry it, and only they are restored or pruned. Give every
    task the same one when you start them by hand, so a chief restarted after
    its ps tasks were lost too finds them; without one the chief makes one
    (a chief restarted while the ps tasks live takes theirs). ``partitioning``
    (the chief's counts): split large variables across the ps tasks, as
    TensorFlow 1.x's partitioners did (:mod:`psdk.protocol.partitions`).
    """
    spec = sync if isinstance(sync, SyncSpec) else SyncSpec(sync, replicas_to_aggregate)
    given = run_id is not None
    if run_id is not None:
        check_run_id(run_id)
    elif task_index == 0:
        run_id = new_run_id()
    job = JobSpec(spec.resolved(cluster.num_workers), int(steps), cluster.num_workers, run_id)
    options = options or ClientOptions()
    own = None
    if transport is None:
        own = transport = ZmqTransport(
            ZmqOptions(options.transport, curve=security.connect_keys(keys, secure, cluster.num_ps, task_index))
        )
    try:
        client = ParameterClient(transport, cluster, task_index, options)
    except BaseException:
        if own is not None:
            own.close()
        raise
    session = WorkerSession(client, job, sharding, own, run_id_given=given, partitioning=partitioning)
    if checkpoint_dir is not None:
        session.checkpoint_dir = Path(checkpoint_dir)
        client.recovery_source = session.latest_checkpoint
    return session


class DistributedOptimizer:
    """Wraps a framework optimizer so that each step goes through the ps.

    What happens to the optimizer you pass: it is never stepped. Its type and
    hyper-parameters (e.g. ``torch.optim.Adam(lr=1e-3)``) select the update
    rule that runs on the ps, in numpy, with its slots held there; the
    chief's choice is the one the ps uses. ``zero_grad()`` is passed through.
    ``step()`` reads the gradients your backward pass left in the model,
    pushes them, and writes the fresh parameters back into the model.

    Or state the ps's rule itself and pass no optimizer:
    ``DistributedOptimizer(None, model, session, rule=psdk.rules.Adam(lr=1e-3))``.
    That is the first-class path for functional frameworks, whose optimizers
    are closures that cannot be inspected (optax), and for a rule a plugin
    adds; the backend is then the one that owns ``model`` (or ``backend=``).
    It also skips building an optimizer (a ``torch.optim`` one costs a worker
    about a second of start-up: its first one imports ``torch._dynamo``).
    """

    def __init__(
        self,
        optimizer: Any = None,
        model: Any = None,
        session: WorkerSession | None = None,
        backend: Backend | None = None,
        *,
        rule: UpdateRule | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
    ):
        if model is None or session is None:
            raise PsdkError("DistributedOptimizer needs the model and the session (psdk.connect(...))")
        if optimizer is None and rule is None:
            raise PsdkError(
                "DistributedOptimizer needs a framework optimizer, or the ps's rule: rule=psdk.rules.Adam(lr=1e-3)"
            )
        if optimizer is not None and rule is not None:
            raise PsdkError("give DistributedOptimizer a framework optimizer or a rule=, not both")
        self.optimizer = optimizer
        self.model = model
        self.session = session
        self.backend = backend or backend_for(optimizer if optimizer is not None else model)
        self.rule = rule if rule is not None else self.backend.optimizer_rule(optimizer)
        self.restored_step: int | None = None
        """The checkpoint step ``broadcast_parameters`` put on the ps, None when it restored nothing."""
        self.table_options = dict(tables or {})
        """Per table, :class:`~psdk.protocol.tables.TableSpec` fields beyond what the model declares (the chief's
        count): ``sharding`` ("hash" or "range"), ``admit_after``, ``preallocate``, ``max_ids``, ``capacity``."""
        self.seed = seed
        self.tables: dict[str, TableSpec] = {}
        """The model's embedding tables as the ps keeps them (after :meth:`broadcast_parameters`)."""
        self.times = StepTimes()
        """Where the steps' time went besides the forward and backward passes (two clock reads a side)."""

    def broadcast_parameters(self, resume: Checkpoint | None = None) -> int:
        """Chief: put the model's weights on the ps. Others: wait for them and take them.

        With ``resume`` the chief puts that checkpoint's variables, optimizer
        slots and global step on the ps instead. A chief that finds the store
        already initialised (it restarted) takes the ps's weights instead of
        overwriting them. Returns the global step, which in async mode may
        already be past the checkpoint's (see ``restored_step``).
        """
        client = self.session.client
        declared = tables_of(self.backend.variable_records(self.model))
        self.tables = table_specs(declared, self.table_options, self.seed)
        if self.session.is_chief:
            own = self.session.latest_checkpoint()
            # A new epoch, later than any an earlier chief of this run made (they count up from 0): the workers
            # still waiting for a restore follow it.
            epoch = int(time.time()) if own is not None else 0
            if own is not None:  # this run went past any resume= already: a chief restarted after a ps was lost
                log.warning("worker 0: this run's newest checkpoint is at global step %d", own.global_step)
                resume = own
            weights = {n: w for n, w in self.backend.read_weights(self.model).items() if n not in self.tables}
            fresh = client.initialize(
                weights,
                self.session.job,
                self.rule,
                self.session.sharding,
                resume,
                epoch,
                list(self.tables.values()),
                partitioning=self.session.partitioning,
            )
            self._check_run(client.job)
            if not fresh:
                log.warning("worker 0: the ps was already initialised; continuing from its weights")
            elif resume is not None:
                self.restored_step = resume.global_step  # the other workers may push before the pull below
        else:
            client.wait_initialized()
        self._check_variables(client.variable_shapes())
        self._check_tables(declared, client.tables)
        step = self.pull()
        self.backend.share_buffers(self.model, client.params, client.grads)
        return step

    def _check_run(self, held: JobSpec | None) -> None:
        """A chief restarted into ps tasks that hold another run's job refuses it, naming both runs."""
        mine = self.session.job.run_id
        theirs = held.run_id if held is not None else None
        if self.session.run_id_given and theirs is not None and theirs != mine:
            raise PsdkError(
                f"the ps tasks hold the job of run {theirs}, not this run ({mine}): restart the ps tasks, or give "
                f"this chief run_id={theirs} to continue that run"
            )

    def _check_tables(self, declared: Mapping[str, Rows], held: Mapping[str, TableSpec]) -> None:
        """Every worker's model must declare the tables the chief placed, of the same width."""
        local = {name: rows.dim for name, rows in declared.items()}
        remote = {name: spec.dim for name, spec in held.items()}
        if local != remote:
            raise PsdkError(
                f"worker {self.session.task_index}: this model's embedding tables {local} (name: dim) are not the "
                f"ones on the ps {remote}; every worker must build the same model"
            )
        self.tables = dict(held)

    def _check_variables(self, remote: dict[str, tuple[int, ...]]) -> None:
        local = {n: tuple(s) for n, s in self.backend.variables(self.model).items() if n not in self.tables}
        if local != remote:
            only_here = sorted(set(local) - set(remote))
            only_there = sorted(set(remote) - set(local))
            shapes = sorted(n for n in set(local) & set(remote) if local[n] != remote[n])
            raise PsdkError(
                f"worker {self.session.task_index}: this model does not match the variables on "
                f"the ps (only here: {only_here}, only on the ps: {only_there}, shapes differ: "
                f"{shapes}); every worker must build the same model"
            )

    def pull(self) -> int:
        """Fetch the current parameters of the ps into the model; returns the global step."""
        step = self.session.client.pull()
        self.backend.write_weights(self.model, self.session.client.params)
        return step

    def pull_rows(self, ids: Mapping[str, Any]) -> None:
        """Fetch the rows of ``ids`` (by table) into the model, for a forward pass over them.

        A training pull: the ps creates the rows it has not seen (from the
        seed and the id) and counts them for admission. Pass the next batch's
        ids to :meth:`step` instead to save a round trip.
        """
        wanted = self._unique_ids(ids)
        for name, rows in self.session.client.pull_rows(wanted).items():
            self.backend.write_rows(self.model, name, wanted[name], rows)

    def _unique_ids(self, ids: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        unknown = set(ids or {}) - set(self.tables)
        if unknown:
            raise PsdkError(f"no embedding table {sorted(unknown)} in this model (its tables: {sorted(self.tables)})")
        return {name: unique_ids(np.asarray(values, np.int64).reshape(-1))[0] for name, values in (ids or {}).items()}

    def zero_grad(self) -> None:
        zero = getattr(self.optimizer, "zero_grad", None)
        if callable(zero):
            zero()

    def step(self, next_ids: Mapping[str, Any] | None = None) -> StepResult:
        """Push this worker's gradients, pull the new parameters into the model.

        With embedding tables, the rows the backward pass touched are pushed
        as (ids, rows); ``next_ids`` (by table) are the next batch's ids, whose
        rows come back in the same round trip, read after this push applied.
        """
        return self.start_step(next_ids=next_ids).wait()

    def start_step(
        self, overlap: bool = False, basis: Basis | None = None, next_ids: Mapping[str, Any] | None = None
    ) -> PendingStep:
        """Push the gradients now; :meth:`PendingStep.wait` pulls the new parameters in.

        Prepare the next batch in between (never touch the model there): the
        ps works on the push while this worker does something useful. With
        ``overlap`` (async and ssp only) the gradients are copied as they
        leave, so the next gradient may be computed before this step's
        :meth:`~PendingStep.wait`; pass the ``basis`` taken
        (:meth:`ParameterClient.basis`) when that gradient was computed.
        """
        client = self.session.client
        if overlap and not self.session.job.sync.allows_overlap:
            raise PsdkError(
                "overlap works in async and ssp mode only: in sync mode a gradient computed while the last "
                "push is in flight is a round stale, and the ps would drop it"
            )
        began = time.perf_counter()
        self.backend.read_gradients(self.model, client.grads)
        rows = {name: self.backend.read_row_gradients(self.model, name) for name in self.tables}
        read = time.perf_counter()
        wanted = self._unique_ids(next_ids)
        pending = client.start_push_pull(copy=overlap, basis=basis, rows=rows or None, pull=wanted or None)
        self.times.lookup_s += read - began
        self.times.wire_s += time.perf_counter() - read
        return PendingStep(self, pending, wanted)


class PendingStep:
    """A step whose gradients are on their way to the ps."""

    def __init__(
        self, optimizer: DistributedOptimizer, pending: Pending, wanted: Mapping[str, np.ndarray] | None = None
    ):
        self.optimizer = optimizer
        self.pending = pending
        self.wanted = wanted or {}

    def wait(self) -> StepResult:
        opt = self.optimizer
        began = time.perf_counter()
        result = opt.session.client.finish_push_pull(self.pending)
        got = time.perf_counter()
        opt.backend.write_weights(opt.model, opt.session.client.params)
        for name, rows in result.rows.items():
            opt.backend.write_rows(opt.model, name, self.wanted[name], rows)
        opt.times.wire_s += got - began
        opt.times.lookup_s += time.perf_counter() - got
        return opt.session.record(result)
