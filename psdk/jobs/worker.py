"""psdk's training loop: one worker task of any workload, written on the public API.

The workload gives the data and the scoring, the framework plugin the
bridge, and the workload's trainer for that framework the loss and the
predictions (:mod:`psdk.plugins.trainer`); this loop joins them to the ps.
Each worker reads its own shard (the workload's ``shard`` entry), trains with
:class:`~psdk.api.DistributedOptimizer` until the ps says the target global
step is reached, and logs lines a TensorFlow user knows (worker, epoch,
global step, local step, loss, the workload's validation metrics); an epoch
is the job's pass over the training set, counted from the global step
(:mod:`psdk.jobs.epochs`). The chief also resumes from a checkpoint when
asked, writes checkpoints, and at the end waits for the others, scores the
final parameters of the ps on the test set and writes ``summary.json``,
``params.npz`` and a final checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from psdk.api import DistributedOptimizer, PendingStep, WorkerSession, connect
from psdk.client import StepResult, checkpoint
from psdk.config import build
from psdk.config.options import PlacementOptions
from psdk.errors import ConfigError, TrainingResumed
from psdk.jobs.divergence import DivergenceWatch
from psdk.jobs.epochs import EpochCount, batches_per_step
from psdk.jobs.report import WorkerReport
from psdk.jobs.setup import WorkerSetup, worker_setup
from psdk.jobs.summary import build_summary, save_params, test_fields
from psdk.jobs.timesplit import split_line
from psdk.jobs.workload import Workload, workload_options
from psdk.launch import LAUNCHED_ENV
from psdk.launch.placement import (
    RankPlacement,
    lower_thread_priority,
    pin_to_cpu,
    visible_gpus,
)
from psdk.plugins.batches import Batch, Shard, ShardRequest
from psdk.plugins.loading import load_backend, workload_of
from psdk.plugins.towers import describe, in_towers
from psdk.report.metrics import MetricsLog, RecordSink, summary_line, write_json_atomic
from psdk.report.tensorboard import TensorBoardSink
from psdk.runtime.disks import WriteError, is_write_failure
from psdk.runtime.failpoints import TRAINED, WORKER_STEP, failpoint
from psdk.runtime.liveness import beat

log = logging.getLogger(__name__)


def run_worker(cfg: DictConfig) -> None:
    """One worker task of the MNIST job; raises :class:`~psdk.errors.PsdkError` on failure."""
    start = time.time()
    setup = worker_setup(cfg)  # every setting this worker uses, built once
    options, task, cluster = setup.options, setup.task, setup.cluster
    if task == 0 and LAUNCHED_ENV not in os.environ:  # a launcher tried the chief's checkpoint folder already
        checkpoint.check_folder(options.checkpoint)
    backend = load_backend(setup.backend, setup.backend_options)
    placement = options.placement
    devices = RankPlacement(placement.device, placement.towers).devices(cluster, task, visible_gpus())
    if len(devices) == 1:
        backend.setup(devices[0], options.train.threads, placement.gpu_memory_fraction)
    else:  # in-graph replication: one replica per device (psdk.plugins.towers)
        backend.setup_towers(devices, options.train.threads, placement.gpu_memory_fraction)
    beat()  # the framework is in: from here each phase must beat within liveness.stall_timeout_s
    log.info(
        "worker %d: backend %s on %s, %d ps task(s)",
        task,
        backend.name,
        describe(backend.tower_devices),
        cluster.num_ps,
    )

    resume = checkpoint.load(setup.resume) if setup.resume else None
    spec = setup.model
    workload = Workload(workload_of(cfg), backend, workload_options(cfg))
    if len(devices) > 1:
        backend, workload.trainer = in_towers(backend, workload.trainer)
    data = workload.shard(ShardRequest(task, cluster.num_workers, setup.data, spec, workload_options(cfg), setup.seed))
    model = workload.trainer.build_model(spec, spec.init_weights(setup.seed))
    beat()  # the data and the model too
    metrics = MetricsLog(setup.output_dir / "metrics.jsonl", record_sinks(setup))
    unwritten: Exception | None = None  # a result the disk refused at the end
    cluster = setup.announced()
    try:
        with connect(
            cluster,
            task,
            steps=options.train.steps,
            sync=setup.sync,
            sharding=setup.sharding,
            partitioning=setup.partitioning,
            options=setup.client,  # the transport.* group as it is, and the recovery wait
            keys=build.worker_keys(options.transport, cluster, task),
            secure=options.transport.secure,
            checkpoint_dir=options.checkpoint.dir if task == 0 else None,
            run_id=setup.run_id,
        ) as session:
            # The rule is named directly: no framework optimizer to build and inspect.
            given = cfg.get("tables")  # +tables.<name>.<key>: the chief's count (an empty node when none is given)
            tables: dict[str, Any] = (
                dict(OmegaConf.to_container(given, resolve=True)) if isinstance(given, DictConfig) else {}
            )
            optimizer = DistributedOptimizer(
                None, model, session, backend=backend, rule=setup.rule, seed=setup.seed, tables=tables
            )
            tune_compute_thread(placement, cluster.local_rank(task))
            optimizer.broadcast_parameters(resume)
            if optimizer.restored_step is not None:
                log.info("worker 0: resumed from %s at global step %d", setup.resume, optimizer.restored_step)
            job = WorkerJob(setup, session, optimizer, workload, data, metrics)
            workers = job.train_to_the_end(options.train.final_wait_s)
            if session.is_chief:
                failpoint(TRAINED)
                try:
                    job.finalize(workers, start)
                except OSError as exc:
                    if not is_write_failure(exc):
                        raise
                    unwritten = exc  # the job itself is done: the ps tasks are shut down as usual first
    finally:
        metrics.close()
    unwritten = unwritten or job.unwritten
    if unwritten is not None:  # every result that could be written is, and the ps tasks are shut down
        raise unwritten


def ids_of(batch: Batch) -> dict[str, np.ndarray]:
    """A batch's unique ids by table: the rows its forward pass reads."""
    return {name: ids.unique() for name, ids in batch.ids.items()}


def record_sinks(setup: WorkerSetup) -> list[RecordSink]:
    """Where a worker's logged points go besides ``metrics.jsonl``: TensorBoard, when asked."""
    if not setup.tensorboard:
        return []
    folder = setup.output_dir / "tensorboard" / f"worker{setup.task}"
    log.info("worker %d: TensorBoard event files in %s", setup.task, folder)
    return [TensorBoardSink(folder, workload_of(setup.config).metrics)]


def tune_compute_thread(placement: PlacementOptions, local_rank: int) -> None:
    """Pin the training thread and lower its priority (after the I/O threads exist)."""
    if placement.pin_cpus:
        cpu = pin_to_cpu(local_rank)
        log.info("worker: training thread pinned to CPU %s", cpu)
    lower_thread_priority(placement.compute_nice)


class WorkerJob:
    """The training loop of one worker, and the chief's extra duties."""

    def __init__(
        self,
        setup: WorkerSetup,
        session: WorkerSession,
        optimizer: DistributedOptimizer,
        workload: Workload,
        data: Shard,
        metrics: MetricsLog,
    ):
        self.setup, self.session, self.optimizer, self.data, self.metrics = (
            setup,
            session,
            optimizer,
            data,
            metrics,
        )
        self.workload, self.trainer = workload, workload.trainer
        options = setup.options
        self.train_options, self.checkpoints = options.train, options.checkpoint
        self.backend, self.model = optimizer.backend, optimizer.model
        self.report = WorkerReport(self.backend.name, self.backend.device, list(self.backend.tower_devices))
        self.task = session.task_index
        num_workers = session.job.num_workers
        train_size = data.train_size
        per_step = batches_per_step(setup.sync, num_workers)
        self.epochs = EpochCount.of_job(train_size, num_workers, options.train.batch_size, per_step)
        self.divergence = DivergenceWatch(
            target_steps=options.train.steps,
            num_workers=session.job.num_workers,
            lr=float(getattr(setup.rule, "lr", 0.0) or 0.0),
            momentum=float(getattr(setup.rule, "momentum", 0.0) or 0.0),
            mode=str(setup.sync.mode),
        )
        self.every_steps = self.checkpoints.every_steps if session.is_chief else 0
        self.every_seconds = self.checkpoints.every_seconds if session.is_chief else 0.0
        self.next_checkpoint = self._next_multiple(session.global_step)
        self.last_checkpoint_time = time.monotonic()
        self.unwritten: WriteError | None = None  # the final checkpoint, when the disk refused it

    def _next_multiple(self, step: int) -> int | None:
        return (step // self.every_steps + 1) * self.every_steps if self.every_steps > 0 else None

    def train_to_the_end(self, final_wait_s: float) -> dict[str, Any]:
        """Train until the job is done, write the final checkpoint (the chief), and finish.

        The final checkpoint comes first, before the wait for the other
        workers: a ps lost during the wrap-up is then restored at the job's
        end, and nothing is trained twice. If a ps was lost before it was
        written, the job is restored to its last checkpoint and every worker
        trains on (:class:`~psdk.errors.TrainingResumed`).
        """
        while True:
            self.train()
            if self.session.is_chief and self.checkpoints.final:
                self.save_checkpoint(final=True)
                if not self.session.should_stop():  # a ps lost during it: restored, maybe before the end
                    continue
            if not self.session.is_chief:  # the chief evaluates the final parameters in finalize()
                self.evaluate_last_pulled()
            try:
                return self.session.finish(self.report.to_json(), final_wait_s)
            except TrainingResumed as resumed:
                log.warning("worker %d: %s", self.task, resumed)

    def evaluate_last_pulled(self) -> None:
        """A worker's test metrics of the parameters it pulled last, as each TensorFlow 1.x worker printed them.

        The parameters of its last step are within a few steps of the final
        ones; evaluating them here costs no round trip (tens of milliseconds
        on MNIST's 10,000 test images), and the figures go into its report.
        """
        self.report.test_metrics = self.score(self.data.test)
        log.info(
            "worker %d: %s of the parameters it pulled last (global step %d)",
            self.task,
            self.workload.shown("test", self.report.test_metrics),
            self.session.global_step,
        )

    def score(self, batch: Batch) -> dict[str, float]:
        """The workload's metrics of the model on ``batch``; with tables, the ps's rows of its ids are read
        first (a read: no row is created, an unseen id reads zeros)."""
        for name, ids in ids_of(batch).items():
            most = self.optimizer.tables[name].max_ids  # what one request may name
            for start in range(0, len(ids), most):
                part = ids[start : start + most]
                rows = self.session.client.pull_rows({name: part}, read=True)[name]
                self.backend.write_rows(self.model, name, part, rows)
        return self.workload.score(self.model, batch)

    def train(self) -> None:
        train = self.train_options
        batches = self.data.batches(train.batch_size, self.setup.seed * 1000 + self.task)
        log_every, validate_every = train.log_every, train.validate_every
        began = window_start = time.time()
        window_steps = 0
        upcoming = iter(batches)
        batch = next(upcoming)
        overlap = train.overlap
        tables = bool(self.optimizer.tables)  # each batch's rows come in with the step before it
        if tables and overlap:
            raise ConfigError("train.overlap", "is not supported with embedding tables yet: use train.overlap=false")
        if tables:
            self.optimizer.pull_rows(ids_of(batch))
            following = self._cut(upcoming, True)  # its rows come with the first push; the one after is cut
            # while that push is on the wire (generation off the critical path: a step's 4-7 ms of 45-60)
        client = self.session.client
        in_flight: PendingStep | None = None
        clock, cpu_clock = time.perf_counter, time.thread_time
        loop_began, times = clock(), self.optimizer.times
        ends: list[float] | None = [] if self.setup.step_ends else None  # report.step_ends: kept, written at the end
        first_step = self.report.local_steps + 1
        before = (self.report.compute_s, times.lookup_s, times.wire_s)  # this call's parts are added at its end
        while True:
            beat()  # a step: the launcher takes a worker whose steps and waits stop for hung (psdk.runtime.liveness)
            failpoint(WORKER_STEP)
            started, cpu_started = clock(), cpu_clock()
            loss = self.trainer.forward_backward(self.model, batch)
            if not math.isfinite(loss):  # its gradient is no use to anyone: said, and the job ends
                self._diverged(self.divergence.observe(loss, client.global_step))
                if in_flight is not None:
                    in_flight.wait()
                break
            self.report.computed += 1
            self.report.compute_s += clock() - started
            self.report.compute_cpu_s += cpu_clock() - cpu_started
            if overlap:
                # This gradient was computed while the last push was in flight; it leaves once that
                # push's reply is in (and its step accounted for), so one push is on the wire at a time.
                basis = client.basis()
                if in_flight is None:
                    in_flight = self.optimizer.start_step(overlap=True, basis=basis)
                    batch, _ = self._cut(upcoming, False)
                    continue
                waited = clock()
                result = in_flight.wait()
                in_flight = None
            else:
                if tables:  # the next batch's rows come back with this push's reply
                    batch, next_ids = following
                    pending = self.optimizer.start_step(next_ids=next_ids)
                    following = self._cut(upcoming, True)
                else:
                    pending = self.optimizer.start_step()
                    batch, _ = self._cut(upcoming, False)  # the next batch is cut while the ps works on this push
                waited = clock()
                result = pending.wait()
            self.report.wait_s += clock() - waited
            self.report.local_steps += 1
            if ends is not None:
                ends.append(time.time())
            self.report.last_loss = loss
            self.report.pushed += result.outcome != "done"
            window_steps += 1
            step = self.report.local_steps
            validate = validate_every > 0 and step % validate_every == 0
            if validate or (log_every > 0 and step % log_every == 0) or result.done:
                now = time.time()
                rate = window_steps / max(now - window_start, 1e-9)
                window_start, window_steps = now, 0
                self._log_point(result, loss, validate, rate, now - began)
            if self.divergence.observe(loss, result.global_step) is not None:
                log.error("worker %d: %s", self.task, self.divergence.message())
                self.report.divergence = self.divergence.verdict
            if not result.done and self._checkpoint_due(result.global_step):
                self.save_checkpoint()
            if result.done:
                break
            if overlap:
                if client.epoch == basis.epoch:  # else the job was restored meanwhile: compute it again
                    in_flight = self.optimizer.start_step(overlap=True, basis=basis)
                batch, _ = self._cut(upcoming, False)
        parts = self.report.parts_s
        spent = {"loop": clock() - loop_began, "compute": self.report.compute_s - before[0],
                 "lookup": times.lookup_s - before[1], "wire": times.wire_s - before[2]}  # fmt: skip
        for part, seconds in spent.items():
            parts[part] = parts.get(part, 0.0) + seconds
        self.report.train_time_s = time.time() - began
        if ends is not None:
            self._write_step_ends(first_step, ends)
        self.report.shard_passes = self.data.passes
        self.report.recoveries = list(self.session.client.recoveries)
        log.info(
            "worker %d: training time %.2f s, %d local steps (%.0f steps/s)",
            self.task,
            self.report.train_time_s,
            self.report.local_steps,
            self.report.local_steps / max(self.report.train_time_s, 1e-9),
        )

    def _write_step_ends(self, first_step: int, ends: list[float]) -> None:
        """One line of ``step_ends.jsonl``: when each of this call's steps ended (a restarted worker adds one)."""
        record = MetricsLog(self.setup.output_dir / "step_ends.jsonl")
        try:
            record.write({"task": f"worker{self.task}", "first_local_step": first_step,
                          "ends": [round(t, 4) for t in ends]})  # fmt: skip
        finally:
            record.close()

    def _cut(self, upcoming: Iterator[Batch], with_ids: bool) -> tuple[Batch, dict[str, np.ndarray]]:
        """The next batch (and its unique ids by table, if asked), its time counted as the step's generation."""
        started = time.perf_counter()
        batch = next(upcoming)
        ids = ids_of(batch) if with_ids else {}
        parts = self.report.parts_s
        parts["generation"] = parts.get("generation", 0.0) + time.perf_counter() - started
        return batch, ids

    def _diverged(self, verdict: dict[str, Any] | None) -> None:
        """A non-finite loss: say so, and end the job (the chief) or leave it (the others)."""
        log.error("worker %d: %s", self.task, self.divergence.message())
        self.report.divergence = verdict
        if self.session.is_chief:
            step = self.session.client.stop_at(self.session.global_step)
            self.session.record(StepResult(step, True, "stopped"))

    def _log_point(self, result: StepResult, loss: float, validate: bool, rate: float, elapsed: float) -> None:
        epoch = self.epochs.at_step(result.global_step)  # the job's epochs, from the global step (psdk.jobs.epochs)
        target = self.train_options.epochs
        validation = self.data.validation
        scored = self.score(validation) if validate and validation is not None else {}
        if scored:
            self.report.last_validation = scored
        self.metrics.write(
            {
                "task": f"worker{self.task}",
                "backend": self.backend.name,
                "epoch": round(epoch, 4),
                "local_step": self.report.local_steps,
                "global_step": result.global_step,
                "loss": round(loss, 6),
                **{m.name: scored.get(m.name) for m in self.workload.held_out},
                "time": round(time.time(), 3),
                "wall_s": round(elapsed, 3),
                "steps_per_s": round(rate, 1),
            }
        )
        log.info(
            "worker %d: epoch %.2f%s, global step %d, local step %d, loss %.4f%s, %.0f steps/s",
            self.task,
            epoch,
            f"/{target:g}" if target is not None else "",
            result.global_step,
            self.report.local_steps,
            loss,
            f", {self.workload.shown('validation', scored)}" if scored else "",
            rate,
        )

    def _checkpoint_due(self, global_step: int) -> bool:
        by_steps = self.next_checkpoint is not None and global_step >= self.next_checkpoint
        by_time = self.every_seconds > 0 and time.monotonic() - self.last_checkpoint_time >= self.every_seconds
        return by_steps or by_time

    def save_checkpoint(self, final: bool = False) -> Path | None:
        """Write a checkpoint, then prune this run's old ones; one the disk refuses is skipped with a warning.

        A periodic checkpoint that cannot be written (a full or read-only
        disk) costs only the protection it would have given: training goes
        on and the next one is tried when due. Nothing is pruned after a
        failed write, so every older good checkpoint stays. The final
        checkpoint's failure is kept in :attr:`unwritten`: the chief writes
        the other results first, then fails.
        """
        config = OmegaConf.to_yaml(self.setup.config, resolve=True)
        folder = Path(self.checkpoints.dir)
        if final:
            self.unwritten = None  # a final checkpoint written after a restore makes up for one refused before
        try:
            path = self.session.save_checkpoint(
                folder, config=config, fingerprint=self.setup.fingerprint, backend=self.backend.name
            )
        except WriteError as exc:
            path = None
            if final:
                self.unwritten = exc  # raised once the other results are written: one line says it
                log.warning("worker 0: final checkpoint not written; writing the other results first")
            else:
                log.warning("worker 0: checkpoint not written (training goes on; the next is tried when due): %s", exc)
        self.next_checkpoint = self._next_multiple(self.session.global_step)
        self.last_checkpoint_time = time.monotonic()
        if path is None:
            return None
        try:
            checkpoint.prune(folder, self.checkpoints.keep, self.session.run_id)  # this run's files only
        except OSError as exc:
            log.warning(
                "worker 0: old checkpoints not pruned: %s",
                WriteError(exc.filename or folder, exc, "checkpoint.dir", what="remove"),
            )
        return path

    def finalize(self, workers: dict[str, Any], start: float) -> dict[str, Any]:
        """Chief: evaluate the ps's final parameters and write the results (the ps still serves)."""
        for index, state in sorted(workers.items()):
            if state["status"] == "dead":
                log.warning("worker 0: worker %s died during the job: %s", index, state["reason"])
        client = self.session.client
        client.wrapping_up(self.optimizer.pull, "pulling the final parameters")
        tested = self.score(self.data.test)
        out = self.setup.output_dir
        save_params(out / "params.npz", client.params)
        stats = client.wrapping_up(client.stats, "reading the ps statistics")
        summary = build_summary(self.setup.config, stats, workers, tested, time.time() - start, self.backend.name)
        summary["workers"].get("0", {}).update(  # its own figures: the final parameters'
            test_fields(tested)
        )
        summary["run_id"] = self.session.run_id
        summary["epochs"] = round(self.epochs.at_step(summary["global_step"]), 4)  # the job's (psdk.jobs.epochs)
        summary["batches_per_epoch"] = self.epochs.batches_per_epoch
        summary["rule_applied"] = dict(client.rule_json)  # e.g. the momentum scaled for async workers
        diverged = [w["divergence"] for _, w in sorted(summary["workers"].items()) if w.get("divergence")]
        summary["divergence"] = diverged[0] if diverged else None
        summary["recoveries"] = list(client.recoveries)  # the wrap-up's too, which no report holds
        summary["global_steps_lost"] = sum(int(r.get("lost_steps") or 0) for r in client.recoveries)
        write_json_atomic(out / "summary.json", summary)
        log.info("worker 0: %s", split_line(summary["time_split"]))
        log.info(
            "worker 0: %s of the final parameters (global step %d)",
            self.workload.shown("test", tested),
            summary["global_step"],
        )
        if not os.environ.get(LAUNCHED_ENV):  # the launcher prints the job's last line itself
            print(summary_line(summary), flush=True)
        return summary
