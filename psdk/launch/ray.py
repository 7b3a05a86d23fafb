"""The Ray launcher: the job's ps and worker tasks placed on a Ray cluster.

Ray only *places* the tasks: each one is a small actor that runs the same
per-task command a user would type (``python -m psdk ps|worker ...``) as a
subprocess on the node Ray picked, so a task behaves exactly as under the
local launcher or by hand. The ps tasks ask Ray for CPUs only; the workers
ask for ``gpus_per_worker`` GPUs each, and Ray shows each of them only its
own (``CUDA_VISIBLE_DEVICES``). A ps binds the IP of the node it landed on
(port 0, a free one) and announces the address back through its actor; the
workers reach it there. Supervision is the local launcher's: the chief's
exit ends the job, a dead ps or chief stops it naming the task and its node.

Ray is an optional extra (``pip install 'psdk[ray]'``): it is imported only
here, and only when a job is launched. ``address: null`` starts a local Ray
for trying it out; it keeps every socket on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig

from psdk.config import build
from psdk.errors import ConfigError, JobFailedError, PsdkError
from psdk.launch.local import LocalLauncher, Task, alive_file, task_args
from psdk.launch.ray_actors import POLL_S, RPC_TIMEOUT_S, RemoteProcess, TaskRunner
from psdk.protocol.cluster import Topology
from psdk.runtime import liveness
from psdk.runtime.waits import WaitLog, seconds
from psdk.transport import security

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'psdk[ray]'"


def import_ray() -> ModuleType:
    """Ray, or an error that says how to install it."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # read at import: each task's log lines are its own
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "launcher", f"launcher=ray needs Ray, which is not installed ({exc}); {INSTALL_HINT}"
        ) from None
    return ray


class RayLauncher(LocalLauncher):
    """Places the ps tasks (CPU only) and the workers (``gpus_per_worker`` each) on a Ray cluster."""

    shows_progress = False  # the tasks' files may be on other nodes until the job ends
    starts_tasks_here = False  # Ray places them: this host's memory and addresses are not theirs

    def __init__(
        self,
        address: str | None = None,
        num_cpus: float | None = None,
        cpus_per_ps: float = 1.0,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        ready_timeout_s: float = 120.0,
        shutdown_timeout_s: float = 30.0,
    ):
        super().__init__(ready_timeout_s, shutdown_timeout_s)
        for key, value in (("cpus_per_ps", cpus_per_ps), ("cpus_per_worker", cpus_per_worker)):
            if value <= 0:
                raise ConfigError(f"launcher.{key}", f"must be above 0 (Ray accepts fractions), got {value}")
        if gpus_per_worker < 0:
            raise ConfigError("launcher.gpus_per_worker", f"must be 0 (CPU workers) or more, got {gpus_per_worker}")
        if num_cpus is not None and num_cpus <= 0:
            raise ConfigError("launcher.num_cpus", f"must be above 0 or null, got {num_cpus}")
        self.address = None if address in (None, "", "local") else str(address)
        self.num_cpus = num_cpus
        self.cpus_per_ps, self.cpus_per_worker, self.gpus_per_worker = cpus_per_ps, cpus_per_worker, gpus_per_worker
        self.actors: list[Any] = []
        self._ray: Any = None
        self._driver_node: str | None = None
        self._chief_node: str | None = None
        self._nodes: list[str] = []
        self._common: list[str] = []  # every task's arguments, for a restart

    @property
    def local_cluster(self) -> bool:
        return self.address is None

    def bind_host(self, node_ip: str) -> str:
        """What a ps binds: its node's IP, or loopback on a local Ray (nothing else can reach it)."""
        return "127.0.0.1" if self.local_cluster else node_ip

    # ------------------------------------------------------------- connect
    def launch(self, cfg: DictConfig, overrides: Sequence[str]) -> dict[str, Any]:
        ray = import_ray()
        self.validate(cfg)
        try:
            self._connect(ray, build.topology(cfg))
            return super().launch(cfg, overrides)
        finally:
            self._disconnect()

    def needs(self, topology: Topology) -> tuple[float, float]:
        """CPUs and GPUs the job asks of Ray."""
        cpus = topology.num_ps * self.cpus_per_ps + topology.num_workers * self.cpus_per_worker
        return cpus, topology.num_workers * self.gpus_per_worker

    def _connect(self, ray: Any, topology: Topology) -> None:
        cpus, gpus = self.needs(topology)
        asked = (
            f"{topology.num_ps} ps x {self.cpus_per_ps:g} CPU + {topology.num_workers} workers x "
            f"{self.cpus_per_worker:g} CPU, {gpus:g} GPU"
        )
        if self.local_cluster:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a try-out Ray phones nobody
            offered = self.num_cpus if self.num_cpus is not None else max(os.cpu_count() or 1, math.ceil(cpus))
            if cpus > offered:
                raise ConfigError(
                    "launcher.num_cpus",
                    f"the local Ray offers {offered:g} CPUs but the job asks for {cpus:g} ({asked}); raise "
                    "launcher.num_cpus or lower launcher.cpus_per_ps / launcher.cpus_per_worker",
                )
            ray.init(address="local", num_cpus=offered, include_dashboard=False, logging_level=logging.WARNING)
            self._ray = ray
            have_gpus = float(ray.cluster_resources().get("GPU", 0))
            if gpus > have_gpus:
                raise ConfigError(
                    "launcher.gpus_per_worker",
                    f"the job asks for {gpus:g} GPUs ({asked}) but this machine's Ray sees {have_gpus:g}",
                )
            log.info("launcher: started a local Ray (%g CPUs, no dashboard) for this job", offered)
        else:
            try:
                ray.init(address=self.address, logging_level=logging.WARNING)
            except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ... depending on the address
                raise PsdkError(
                    f"launcher.address: cannot connect to the Ray cluster at {self.address!r}: {exc} "
                    "(`ray status` on the head node shows its address; null starts a local Ray)"
                ) from None
            self._ray = ray
            log.info("launcher: connected to the Ray cluster at %s (job asks %s)", self.address, asked)
        with contextlib.suppress(Exception):  # a Ray Client driver is on no node
            self._driver_node = str(ray.get_runtime_context().get_node_id())

    def _disconnect(self) -> None:
        ray, self._ray = self._ray, None
        if ray is None:
            return
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)  # its task, if still running, dies with it (PR_SET_PDEATHSIG)
        self.actors.clear()
        ray.shutdown()

    # -------------------------------------------------------------- tasks
    def _start_tasks(self, cfg: DictConfig, out: Path, common: list[str]) -> None:
        topology = build.topology(cfg)
        runner = self._ray.remote(TaskRunner)
        names = [("ps", i) for i in range(topology.num_ps)] + [("worker", i) for i in range(topology.num_workers)]
        for job, index in names:
            self.actors.append(runner.options(**self._resources(job)).remote(f"{job} {index}"))
        places = self._placed(names)
        self._nodes = [node for _, node in places]
        ps_ips, worker_ips = places[: topology.num_ps], places[topology.num_ps :]
        self._chief_node = worker_ips[0][1]
        self._common = common
        self._send_keys(common, names, list(range(len(names))))
        binds = ",".join(f"{self.bind_host(ip)}:0" for ip, _ in ps_ips)
        workers = ",".join(ip for ip, _ in worker_ips)
        for index, (ip, _) in enumerate(ps_ips):
            announce = out / "tasks" / f"ps{index}.json"
            args = [*common, f"ps_hosts='{binds}'", f"worker_hosts='{workers}'", f"ps.announce_file={announce}"]
            self._start_on(index, "ps", index, ip, out, args, {"CUDA_VISIBLE_DEVICES": ""})
        addresses = self._wait_for_ps(out, topology.num_ps)
        self.ps_addresses = addresses
        log.info("launcher: ps tasks listening at %s", ", ".join(addresses))
        no_gpu = {"CUDA_VISIBLE_DEVICES": ""} if self.gpus_per_worker == 0 else {}  # else Ray set it
        for index, (ip, _) in enumerate(worker_ips):
            args = [*common, f"ps_hosts='{','.join(addresses)}'", f"worker_hosts='{workers}'"]
            self._start_on(topology.num_ps + index, "worker", index, ip, out, args, no_gpu)

    def _resources(self, job: str) -> dict[str, float]:
        if job == "ps":
            return {"num_cpus": self.cpus_per_ps, "num_gpus": 0}
        return {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker}

    def _send_keys(self, common: list[str], names: list[tuple[str, int]], slots: list[int]) -> None:
        """Give each task on another node than this one the CURVE key files it needs, and no others.

        The keys are in the launcher's ``transport.keys_dir`` (a fresh set in
        ``<run>/keys`` unless given); a task reads them at the same path on its
        node, so no shared file system is needed.
        """
        given = [a.split("=", 1)[1] for a in common if a.startswith("transport.keys_dir=")]
        folder = Path(given[-1]) if given else None
        if folder is None or not folder.is_dir():
            return  # not secure, or keys the user put on every node himself
        elsewhere = [
            (slot, name) for slot, name in zip(slots, names, strict=True) if self._nodes[slot] != self._driver_node
        ]
        for slot, (job, index) in elsewhere:
            files = {
                str(p.relative_to(folder)): p.read_bytes()
                for g in security.files_for(job, index)
                for p in folder.glob(g)
            }
            self._ray.get(self.actors[slot].write_files.remote(str(folder), files), timeout=RPC_TIMEOUT_S)
        if elsewhere:
            log.info("launcher: sent each of %d task(s) on other nodes the keys it needs", len(elsewhere))

    def _placed(self, names: list[tuple[str, int]], slots: list[int] | None = None) -> list[tuple[str, str]]:
        """Each task's node (IP, node id), once Ray has placed them all (the actors of ``slots``: all of them)."""
        slots = list(range(len(names))) if slots is None else slots
        pending = {self.actors[slot].where.remote(): i for i, slot in enumerate(slots)}
        places: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + self.ready_timeout_s
        clock = WaitLog()
        while pending:
            left = deadline - time.monotonic()
            ready, _ = self._ray.wait(list(pending), num_returns=len(pending), timeout=max(0.0, min(left, 1.0)))
            for ref in ready:
                index = pending.pop(ref)
                try:
                    places[index] = self._ray.get(ref, timeout=RPC_TIMEOUT_S)
                except self._ray.exceptions.RayError as exc:
                    job, i = names[index]
                    raise JobFailedError(f"Ray could not start {job} {i}: {exc}") from exc
            if pending and (waited := clock.due()) is not None:
                log.info(
                    "launcher: waiting for Ray to place %s: %s of %s (launcher.ready_timeout_s); %s free",
                    ", ".join(f"{names[i][0]} {names[i][1]}" for i in sorted(pending.values())),
                    seconds(waited),
                    seconds(self.ready_timeout_s),
                    self._ray.available_resources(),
                )
            if pending and time.monotonic() > deadline:
                waiting = ", ".join(f"{names[i][0]} {names[i][1]}" for i in sorted(pending.values()))
                asked = {names[i][0]: self._resources(names[i][0]) for i in pending.values()}
                raise JobFailedError(
                    f"Ray placed no node for {waiting} within {self.ready_timeout_s:.0f} s: asked for "
                    f"{asked}, the cluster has {self._ray.available_resources()} free. Lower launcher.cpus_per_ps, "
                    "cpus_per_worker or gpus_per_worker, add nodes, or raise launcher.ready_timeout_s"
                )
        return [places[i] for i in range(len(names))]

    def _start_on(
        self, slot: int, job: str, index: int, ip: str, out: Path, args: list[str], env: dict[str, str]
    ) -> None:
        actor = self.actors[slot]
        argv = task_args(job, index, out, args)
        log.info("launcher: starting %s %d on Ray node %s: python -m psdk %s", job, index, ip, " ".join(argv[:-2]))
        try:
            pid = self._ray.get(actor.start.remote(argv, env), timeout=RPC_TIMEOUT_S)
        except self._ray.exceptions.RayError as exc:
            raise JobFailedError(f"{job} {index} (on {ip}) could not be started through Ray: {exc}") from None
        if self._nodes[slot] == self._driver_node:  # a pid means something only on this machine
            (out / "tasks" / f"{job}{index}.pid").write_text(f"{pid}\n")
        process = RemoteProcess(self._ray, actor)
        alive = alive_file(out, f"{job}{index}")  # on the task's node, where its actor reads it
        self.tasks.append(Task(job, index, process, ["python", "-m", "psdk", *argv], ip, env=dict(env), alive=alive))

    # ------------------------------------------------------------- restarts
    def _restart(self, task: Task) -> None:
        """Start ``task`` again as a new Ray actor, on a live node with room (its own may be gone).

        The local launcher's restart runs ``python -m psdk`` on the launcher's
        machine with the launcher's ``python``: neither where Ray runs the
        job's tasks nor necessarily an interpreter that has psdk. A new
        :class:`TaskRunner` runs the task's own command, with the interpreter
        and environment of the first start, wherever Ray finds room.
        """
        slot = self.tasks.index(task)
        old_name = task.name
        self.restarts[old_name] += 1
        log.warning(
            "launcher: %s %s; restarting it as a new Ray actor (%d/%d)",
            old_name,
            task.describe_exit(),
            self.restarts[old_name],
            self.max_restarts,
        )
        with contextlib.suppress(Exception):
            self._ray.kill(self.actors[slot])  # whatever is left of it (nothing, if its node died)
        job, index = task.job, task.index
        ip, node = self._new_actor(slot, job, index, old_name)
        if job == "ps" and ip != task.host and not self.local_cluster:
            raise JobFailedError(
                f"{old_name} could only be restarted on node {ip}, but the workers reach it at {task.host}: "
                "a ps restarted on Ray must land on its own node (give the ps node room for one more ps, "
                "or run the ps tasks outside Ray)"
            )
        self._nodes[slot] = node
        self._send_keys(self._common, [(job, index)], [slot])
        if job == "worker" and index == 0:
            self._chief_node = node
        argv = task.command[3:]  # python -m psdk ...
        if job == "ps" and self.ps_addresses:  # the address the workers know
            argv = [f"ps_hosts='{','.join(self.ps_addresses)}'" if a.startswith("ps_hosts=") else a for a in argv]
        env = task.env or {}
        try:
            pid = self._ray.get(self.actors[slot].start.remote(argv, env), timeout=RPC_TIMEOUT_S)
        except self._ray.exceptions.RayError as exc:
            raise JobFailedError(f"{job} {index} could not be restarted through Ray on {ip}: {exc}") from None
        if node == self._driver_node:  # as at the first start: a pid means something only on this machine
            run_dir = Path(next(a for a in argv if a.startswith("hydra.run.dir=")).split("=", 1)[1])
            run_dir.with_name(f"{run_dir.name}.pid").write_text(f"{pid}\n")
        task.process = RemoteProcess(self._ray, self.actors[slot])
        task.command = ["python", "-m", "psdk", *argv]
        task.starting_again()
        if ip != task.host:
            task.host = ip
            self.restarts[task.name] = self.restarts.pop(old_name)
        log.info("launcher: %s started again on Ray node %s", old_name, ip)

    def _new_actor(self, slot: int, job: str, index: int, name: str) -> tuple[str, str]:
        """A new actor for ``slot`` on a live node: its (IP, node id).

        Ray learns that a node died from missed health checks, seconds after
        the launcher saw its actor go. Until then it may place the new actor
        on the dead node, where it dies before it runs: that one is placed
        again, until ``launcher.ready_timeout_s``.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            self.actors[slot] = self._ray.remote(TaskRunner).options(**self._resources(job)).remote(f"{job} {index}")
            try:
                ((ip, node),) = self._placed([(job, index)], [slot])
                return ip, node
            except JobFailedError as exc:
                if not isinstance(exc.__cause__, self._ray.exceptions.RayActorError) or time.monotonic() > deadline:
                    raise
                log.warning("launcher: %s's new actor died before it ran (its node is gone); placing it again", name)

    def _wait_for_ps(self, out: Path, num_ps: int) -> list[str]:
        deadline = time.monotonic() + self.ready_timeout_s
        ps_tasks = [t for t in self.tasks if t.job == "ps"]
        addresses: dict[int, str] = {}
        clock = WaitLog()
        while len(addresses) < num_ps:
            for task in ps_tasks:
                if task.index in addresses:
                    continue
                if task.process.poll() is not None:
                    raise JobFailedError(
                        f"{task.name} {task.describe_exit()} before it was listening{self._tail(task)}"
                    )
                assert isinstance(task.process, RemoteProcess)
                path = str(out / "tasks" / f"ps{task.index}.json")
                address = self._ray.get(task.process.actor.announced.remote(path), timeout=RPC_TIMEOUT_S)
                if address:
                    addresses[task.index] = address
            waiting = ", ".join(t.name for t in ps_tasks if t.index not in addresses)
            if len(addresses) < num_ps and (waited := clock.due()) is not None:
                log.info(
                    "launcher: waiting for %s to listen: %s of %s (launcher.ready_timeout_s)",
                    waiting,
                    seconds(waited),
                    seconds(self.ready_timeout_s),
                )
            if len(addresses) < num_ps and time.monotonic() > deadline:
                raise JobFailedError(f"{waiting} did not start listening within {self.ready_timeout_s:.0f} s")
            time.sleep(POLL_S)
        return [addresses[i] for i in range(num_ps)]

    def _observe(self, task: Task) -> liveness.Seen | None:
        """The task's liveness file, read by its actor on its node (None: the actor did not answer)."""
        assert isinstance(task.process, RemoteProcess) and task.alive is not None
        return task.process.liveness(str(task.alive))

    def _supervise(self) -> None:
        try:
            super()._supervise()
        except JobFailedError as exc:
            tails = "".join(self._tail(t) for t in self.tasks if t.process.returncode not in (None, 0))
            raise JobFailedError(f"{exc}{tails}") from None

    def _tail(self, task: Task) -> str:
        lines = task.process.last_lines() if isinstance(task.process, RemoteProcess) else []
        return f"\n--- last lines of {task.name} ---\n" + "\n".join(lines) if lines else ""

    def _final_summary(self, out: Path, start: float, scores: dict[str, float | None]) -> dict[str, Any]:
        self._disconnect()  # first, so that no task's forwarded log line comes after the summary line
        return super()._final_summary(out, start, scores)

    def _collect(self, out: Path) -> None:
        """Fetch the chief's results when it ran on another machine than this launcher."""
        if self._chief_node is None or self._chief_node == self._driver_node:
            return
        chief = next(t for t in self.tasks if t.job == "worker" and t.index == 0)
        assert isinstance(chief.process, RemoteProcess)
        files = self._ray.get(chief.process.actor.read_results.remote(str(out)), timeout=RPC_TIMEOUT_S * 4)
        for name, data in files.items():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        log.info("launcher: fetched %s from the chief's node %s", ", ".join(sorted(files)), chief.host)
