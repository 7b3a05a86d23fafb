"""The local launcher: every task of the job as its own process on this machine.

It only starts the per-task entry points (``python -m psdk ps|worker ...``)
that a user would run by hand in separate terminals, passing on the run's own
overrides. Each ps binds a free port and announces it in a file; the workers
start once every ps is listening. Children die with the launcher
(``PR_SET_PDEATHSIG``) and on Ctrl-C; a dead chief or ps stops the job with
an error naming it; a dead non-chief worker is reported and the job goes on.
A task whose loop stopped turning (:mod:`psdk.runtime.liveness`) is killed, and then
is a dead task like any other: restarted with recovery on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.client import checkpoint
from psdk.config import build, capacity
from psdk.config.options import TaskOptions, options_from
from psdk.errors import USAGE_EXIT, JobFailedError, PsdkError
from psdk.launch import announce, handoff, mixed
from psdk.launch.curves import CurvesInBackground
from psdk.launch.placement import RankPlacement, visible_gpus
from psdk.launch.progress import ProgressMonitor, make_monitor, ps_progress_path
from psdk.launch.tasks import (
    DOING,
    OWN_KEYS,
    TASK_ENV,
    Task,
    _die_with_parent,
    alive_file,
    only_launcher_of,
    passed_on,
    task_args,
)
from psdk.plugins.loading import (
    check_framework,
    check_trainer,
    installed_backends,
    merged_options,
    resolve_backend_name,
    run_entry,
    workload_of,
)
from psdk.plugins.models import check_supported
from psdk.protocol.cluster import ClusterSpec
from psdk.report.metrics import summary_line, write_json_atomic
from psdk.report.runs import forget_failure
from psdk.runtime import liveness
from psdk.runtime.waits import WaitLog, seconds
from psdk.transport import security

log = logging.getLogger(__name__)

POLL_S = 0.05
CHIEF_GRACE_S = 3.0


class LocalLauncher:
    # Whether the tasks' files (metrics.jsonl, ps progress) appear in the run's folder as they train.
    shows_progress = True
    # Whether every task runs on this host: its memory and topology.host are checked before they start.
    starts_tasks_here = True

    def __init__(self, ready_timeout_s: float = 60.0, shutdown_timeout_s: float = 30.0):
        self.ready_timeout_s = ready_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.tasks: list[Task] = []
        self.ps_addresses: list[str] = []
        self.max_restarts = 0  # recovery.max_restarts when recovery is on
        self.restarts: Counter[str] = Counter()
        self.monitor: ProgressMonitor | None = None
        self.curves: CurvesInBackground | None = None  # report.plot: curves.png when the job ends
        self.out = Path()  # the run's folder
        self.handoffs: handoff.HandoffMaker | None = None  # each task's config, when it need not compose it
        self.options = TaskOptions()  # the job's typed options, once validate() has built them
        self.run_id = ""  # the run's id (run_id=, or a new one), on every task's command line

    # --------------------------------------------------------------- checks
    def validate(self, cfg: DictConfig) -> None:
        """Fail before starting anything, naming the key and the valid choices."""
        self.options = options_from(cfg)
        topology = build.topology(cfg)
        installed = installed_backends()
        named = {topology.backend_of(i, str(cfg.backend)) for i in range(topology.num_workers)}
        backends = sorted({resolve_backend_name(name, installed) for name in named})
        workload = workload_of(cfg)  # an unknown workload= is named before anything starts
        for name in backends:
            check_framework(name)
            check_trainer(workload, name)
            merged_options(installed[name].record, build.backend_options(cfg, name))
        sync = build.sync_spec(cfg)
        sync.resolved(topology.num_workers)
        check_supported(str(build.model_spec(cfg).name), backends)
        build.update_rule(cfg)
        build.check_training(cfg, self.options, sync)
        build.run_id(cfg)
        build.check_liveness(self.options)
        if self.starts_tasks_here:
            capacity.check_host(cfg, topology.num_ps, topology.num_workers)
        capacity.check_job(cfg, self.options, topology.num_ps, topology.num_workers)
        if cfg.resume:
            checkpoint.load(cfg.resume)  # a path that is no checkpoint fails here, not in a restarted chief

    # --------------------------------------------------------------- launch
    def launch(self, cfg: DictConfig, overrides: Sequence[str]) -> dict[str, Any]:
        start = time.time()
        self.validate(cfg)
        out = self.out = Path(cfg.output_dir).resolve()
        (out / "tasks").mkdir(parents=True, exist_ok=True)
        if self.shows_progress:  # the chief's files are on this machine: its checkpoint folder can be tried here
            checkpoint.check_folder(self.options.checkpoint)
        with only_launcher_of(out):
            return self._launch(cfg, overrides, out, start)

    def _launch(self, cfg: DictConfig, overrides: Sequence[str], out: Path, start: float) -> dict[str, Any]:
        self.max_restarts = self.options.recovery.restarts
        topology = build.topology(cfg)
        self.curves = CurvesInBackground(out) if cfg.get("report", {}).get("plot", True) else None
        # One id for the whole run, on every task's command line: a restarted task keeps it.
        self.run_id = build.run_id(cfg) or checkpoint.new_run_id()
        log.info("launcher: run %s", self.run_id)
        common = [*passed_on(overrides), f"output_dir={out}", f"run_id={self.run_id}"]
        common += run_entry(cfg, "prepare") or []  # the workload's data, fetched once here, not by every worker
        self.handoffs = handoff.HandoffMaker.for_job(cfg, overrides, passed_on(overrides), OWN_KEYS)
        transport = self.options.transport
        if transport.secure:
            keys = Path(transport.keys_dir) if transport.keys_dir else None
            # A fresh set for every run, also when a run folder is used again.
            keys = keys or security.generate(out / "keys", topology.num_workers, topology.num_ps, overwrite=True)
            log.info("launcher: CURVE on, keys in %s", keys)
            common += ["transport.secure=true", f"transport.keys_dir={keys}"]
        else:
            log.warning("launcher: CURVE is off (transport.secure=false): see the ps's warning for what that exposes")
            common += ["transport.secure=false"]  # decided here, for every task alike
        self.monitor = self._monitor(cfg, topology.num_workers, topology.num_ps, out)
        if self.monitor is not None and self.monitor.live:
            # The terminal belongs to the live display: the tasks' full logs stay in their folders.
            log.info("launcher: live progress below; the tasks' logs are in %s", out / "tasks")
            common += ["+hydra.job_logging.handlers.console.level=WARNING"]
        try:
            if self.monitor is not None:
                self.monitor.start()
            if self.curves is not None:
                self.curves.start()
            self._start_tasks(cfg, out, common)
            self._supervise()
        except BaseException:
            if self.curves is not None:
                self.curves.cancel()
            self._stop_all()
            raise
        finally:
            if self.monitor is not None:
                self.monitor.stop()
        self._collect(out)
        chief_backend = topology.backend_of(0, str(cfg.backend))
        others = sorted(
            {topology.backend_of(i, str(cfg.backend)) for i in range(topology.num_workers)} - {chief_backend}
        )
        scores = {name: mixed.evaluate(name, out, common) for name in others}
        return self._final_summary(out, start, scores)

    def _monitor(self, cfg: DictConfig, num_workers: int, num_ps: int, out: Path) -> ProgressMonitor | None:
        """The progress display ``progress.mode`` asks for (None: off, or tasks that run elsewhere)."""
        if not self.shows_progress:
            return None
        progress = cfg.get("progress") or {}
        mode, every_s = str(progress.get("mode", "auto")), float(progress.get("every_s", 10.0))
        metrics = workload_of(cfg).metrics  # the display shows the workload's own
        return make_monitor(mode, every_s, out, num_workers, num_ps, self.options.train.steps, metrics=metrics)

    def _popen(self, command: list[str], env: dict[str, str] | None) -> subprocess.Popen[Any]:
        """Start a task's process; under a live display its output goes through the display."""
        if self.monitor is None or not self.monitor.live:
            return subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)
        process = subprocess.Popen(
            command,
            env=env,
            preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert process.stdout is not None
        self.monitor.pump(process.stdout)
        return process

    def _start_tasks(self, cfg: DictConfig, out: Path, common: list[str]) -> None:
        """Start every ps and every worker at once; the workers learn the ps addresses from files.

        Each ps binds a free port and announces it (:mod:`psdk.launch.announce`);
        meanwhile the workers import their framework and read their data,
        then wait for the announcements.
        """
        topology = build.topology(cfg)
        workers = ",".join([topology.host] * topology.num_workers)
        placeholders = ",".join([f"{topology.host}:0"] * topology.num_ps)
        folder = out / "tasks"
        for index in range(topology.num_ps):
            # A run folder used before holds the last run's addresses: read, they would send the workers
            # to a port nobody listens on any more.
            announce.file_for(folder, index).unlink(missing_ok=True)
        for index in range(topology.num_ps):
            self._start(
                "ps",
                index,
                out,
                [
                    *common,
                    f"ps_hosts='{placeholders}'",
                    f"worker_hosts='{workers}'",
                    f"ps.announce_file={announce.file_for(folder, index)}",
                    f"ps.progress_file={ps_progress_path(out, index)}",
                ],
            )
        placement = RankPlacement(self.options.placement.device, self.options.placement.towers)
        gpus = visible_gpus()
        cluster = ClusterSpec({"ps": placeholders, "worker": workers})
        for index in range(topology.num_workers):
            env = placement.isolation_env(cluster, index, gpus) if self.options.placement.isolate_gpus else {}
            self._start(
                "worker",
                index,
                out,
                [*common, f"ps_hosts='{placeholders}'", f"ps_hosts_from={folder}", f"worker_hosts='{workers}'"],
                env,
            )
        self.ps_addresses = self._wait_for_ps(out, topology.num_ps)
        log.info("launcher: ps tasks listening at %s", ", ".join(self.ps_addresses))

    def _collect(self, out: Path) -> None:
        """Bring the chief's results into ``out`` (here they are there already)."""

    def _start(self, job: str, index: int, out: Path, args: list[str], env_extra: dict[str, str] | None = None) -> None:
        name = f"{job}{index}"
        argv = task_args(job, index, out, args)
        command = [sys.executable, "-m", "psdk", *argv]
        env = {**os.environ, **TASK_ENV, **(env_extra or {})}
        env.pop(handoff.ENV, None)  # never one inherited: a task gets this run's, or composes its config
        given = self.handoffs.write(out, argv) if self.handoffs is not None else None
        if given is not None:
            env[handoff.ENV] = given  # the task reads its config there instead of composing it again
        log.info("launcher: starting %s %d: python -m psdk %s", job, index, " ".join(command[3:-2]))
        folder = out / "tasks" / name
        forget_failure(folder)
        alive = alive_file(out, name)
        alive.unlink(missing_ok=True)  # a run folder used before: its beats are not this task's
        process = self._popen(command, env)
        (out / "tasks" / f"{name}.pid").write_text(f"{process.pid}\n")
        self.tasks.append(Task(job, index, process, command, env=env, folder=folder, alive=alive))

    def _wait_for_ps(self, out: Path, num_ps: int) -> list[str]:
        def every_task_alive() -> None:
            for task in self.tasks:
                if task.process.poll() is not None:
                    raise JobFailedError(
                        f"{task.name} {task.describe_exit()} before the ps tasks were listening; see its "
                        f"log above or in {out / 'tasks' / f'{task.job}{task.index}'}"
                    )

        try:
            return announce.wait_for(out / "tasks", num_ps, self.ready_timeout_s, every_task_alive)
        except JobFailedError:
            raise
        except PsdkError as exc:
            raise JobFailedError(f"{exc} (raise launcher.ready_timeout_s if this machine is slow)") from exc

    def _supervise(self) -> None:
        """Wait for the chief; restart lost tasks (recovery on) or stop the job; report other deaths."""
        chief = next(t for t in self.tasks if t.job == "worker" and t.index == 0)
        reported: set[str] = set()
        results = self.out / "summary.json"
        next_look = time.monotonic()
        while chief.process.poll() != 0:
            if self.curves is not None and results.exists():
                self.curves.draw()  # every worker's points are in: drawn while the tasks exit
            for task in self.tasks:
                code = task.process.poll()
                if code is None or code == 0 or task.name in reported:
                    continue
                if self._may_restart(task):
                    self._restart(task)
                    continue
                reported.add(task.name)
                if task is chief:
                    raise JobFailedError(f"the chief (worker 0) {chief.describe_exit()}; stopping the job")
                if task.job == "ps":
                    self._fail(task, chief)
                log.warning("launcher: %s %s; the job goes on without it while it can", task.name, task.describe_exit())
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + self.options.liveness.interval_s
                self._kill_hung()
            time.sleep(POLL_S)
        deadline = time.monotonic() + self.shutdown_timeout_s
        for task in self.tasks:
            try:
                self._wait_for_exit(task, deadline)
            except subprocess.TimeoutExpired:
                log.warning(
                    "launcher: %s still running %.0f s after the chief finished; killing it",
                    task.name,
                    self.shutdown_timeout_s,
                )
                task.process.kill()
                task.process.wait(timeout=10)
            if task.job == "ps" and task.process.returncode != 0:
                raise JobFailedError(f"{task.name} {task.describe_exit()} at the end of the job")

    def _wait_for_exit(self, task: Task, deadline: float) -> None:
        """``task``'s exit after the chief's, by ``deadline`` (else ``TimeoutExpired``), said while it lasts."""
        clock = WaitLog()
        while True:
            left = deadline - time.monotonic()
            try:
                task.process.wait(timeout=max(0.1, min(left, clock.every_s)))
                return
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
            if (waited := clock.due()) is not None:
                log.info(
                    "launcher: waiting for %s to exit after the chief finished: %s of %s (launcher.shutdown_timeout_s)",
                    task.name,
                    seconds(waited),
                    seconds(self.shutdown_timeout_s),
                )

    def _kill_hung(self) -> None:
        """Kill each running task whose loop stopped turning; supervision then treats it as any dead task.

        A hung ps never exits by itself, and the workers waiting on it only
        see a silent peer: they give up, are restarted, and wait again.
        Killed, it is a ps that died, which the launcher restarts and the
        chief restores; with recovery off, a killed ps or chief stops the job
        naming it, and a non-chief worker is reported as a dead one is.
        """
        live = self.options.liveness
        if live.stall_timeout_s is None:
            return
        for task in self.tasks:
            if task.alive is None or task.process.poll() is not None:
                continue
            seen = self._observe(task)
            if seen is None:
                continue
            hang = liveness.judge(seen, live.stall_timeout_s, live.interval_s, live.start_timeout_s)
            if hang is None:
                continue
            what = hang.describe(DOING.get(task.job, "worked"))
            again = "and restarting " if self.restarts[task.name] < self.max_restarts else ""
            log.warning("launcher: %s %s: killing %sit", task.name, what, again)
            task.hung = f"{what} and was killed by the launcher"
            task.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                task.process.wait(timeout=10)

    def _observe(self, task: Task) -> liveness.Seen | None:
        """What the task's liveness file says now (its process runs on this machine)."""
        assert task.alive is not None
        return liveness.observe(task.alive, getattr(task.process, "pid", None), task.started)

    def _may_restart(self, task: Task) -> bool:
        """A lost task comes back (recovery on): a worker after any failure, a ps only when killed.

        A ps that exits by itself decided to (the chief aborted the job or vanished); a task
        that refused its configuration (exit code 2) would refuse it again.
        """
        code = task.process.returncode
        killed = code is not None and code < 0
        refused = code == USAGE_EXIT  # its configuration or data: it would be refused again
        return self.restarts[task.name] < self.max_restarts and ((task.job == "worker" and not refused) or killed)

    def _restart(self, task: Task) -> None:
        """Start ``task`` again with its own command; a ps on the address it had before."""
        self.restarts[task.name] += 1
        log.warning(
            "launcher: %s %s; restarting it (%d/%d)",
            task.name,
            task.describe_exit(),
            self.restarts[task.name],
            self.max_restarts,
        )
        command = list(task.command)
        if task.env is not None and handoff.ENV in task.env:
            # Composed by the task again: a ps comes back with another command (the address it had).
            task.env = {k: v for k, v in task.env.items() if k != handoff.ENV}
        if task.job == "ps" and self.ps_addresses:
            command = [f"ps_hosts='{','.join(self.ps_addresses)}'" if a.startswith("ps_hosts=") else a for a in command]
        run_dir = Path(next(a for a in command if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        forget_failure(run_dir)
        if task.alive is not None:
            task.alive.unlink(missing_ok=True)
        task.starting_again()
        task.process = self._popen(command, task.env)
        task.command = command
        run_dir.with_name(f"{run_dir.name}.pid").write_text(f"{task.process.pid}\n")

    def _fail(self, ps: Task, chief: Task) -> None:
        """A ps failed: give the chief a moment to report why (it may have aborted the job)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            chief.process.wait(timeout=CHIEF_GRACE_S)
        failures = [f"{ps.name} {ps.describe_exit()}"]
        if chief.process.returncode not in (None, 0):
            failures.append(f"the chief (worker 0) {chief.describe_exit()}")
        raise JobFailedError(
            f"{'; '.join(failures)} while the job was running; stopping the job (see the task logs above)"
        )

    def _stop_all(self) -> None:
        for task in self.tasks:
            if task.process.poll() is None:
                task.process.terminate()
        deadline = time.monotonic() + 5.0
        for task in self.tasks:
            try:
                task.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                task.process.kill()
                task.process.wait(timeout=10)

    def _final_summary(self, out: Path, start: float, scores: dict[str, float | None]) -> dict[str, Any]:
        """The chief's summary with what the launcher adds: each backend's score, restarts, the whole wall time.

        ``scores``: the primary metric of the final parameters on each backend
        the chief did not use, into ``test_<primary>_by_backend``.
        """
        path = out / "summary.json"
        if not path.exists():
            raise JobFailedError(f"the chief finished but wrote no {path}")
        summary: dict[str, Any] = json.loads(path.read_text())
        head = summary.get("primary_metric")
        if head and scores:
            by_backend = summary.setdefault(f"test_{head}_by_backend", {})
            by_backend.update({b: v for b, v in scores.items() if v is not None})
            log.info(
                "launcher: test %s of the final parameters by backend: %s",
                head,
                ", ".join(f"{b} {v:.4f}" for b, v in sorted(by_backend.items())),
            )
        summary["restarts"] = dict(self.restarts)
        summary["chief_wall_s"] = summary.get("wall_s")
        summary["wall_s"] = time.time() - start
        write_json_atomic(path, summary)
        if self.curves is not None:
            self.curves.finish()
        print(summary_line(summary), flush=True)
        return summary
