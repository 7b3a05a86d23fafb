"""launcher=ray on a real Ray cluster of three hosts: a lost node's worker comes back on a surviving node.

Each Ray node is a host of its own (:mod:`tests.netns`): a network namespace
with its own address and its own process table, running ``ray start --block``
as an operator would on three machines. The driver (``python -m psdk run
launcher=ray launcher.address=HEAD:6379``) runs on the head, in its
namespaces, as after ``ssh head``. Once the chief has trained 40 steps, its
node's whole process table is SIGKILLed: the raylet, its workers and the
psdk task. The job must finish, with the chief started again as a new Ray
actor whose task runs in the surviving node's process table.

Placement is made deterministic with the only resources the launcher asks
for, CPUs and GPUs. Workers do not follow a ps restarted on another node yet,
so the ps must land on the head, which is never killed: it asks for more CPUs
than a worker node has. The workers ask for a GPU each, which only the two worker
nodes offer (``ray start --num-gpus=2``: Ray's bookkeeping only, the numpy
backend trains on the CPU); each worker node has room for both workers, so
either survives the other's loss.

Needs root, iproute2, util-linux (unshare, nsenter) and Ray; it skips without
them, except where ``PSDK_NO_SKIP`` is set (CI), where it fails instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from . import netns
from .conftest import REPO
from .jobs import FAST_FLAGS, env, progress_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RAY = Path(sys.executable).with_name("ray")
GCS_PORT = 6379
# The head: the only node a ps fits on (CPUS_PER_PS > a worker node's CPUs), and no GPU, so no worker.
HEAD = ["--num-cpus=2", "--num-gpus=0"]
# A worker node: room for both workers (2 x 0.5 CPU, 2 x 1 GPU), so that either can take the other's.
WORKER_NODE = ["--num-cpus=1", "--num-gpus=2"]
CPUS_PER_PS, CPUS_PER_WORKER, GPUS_PER_WORKER = 1.5, 0.5, 1
STEPS, KILL_AT = 1500, 40
STARTED = "Ray runtime started"


def needs_a_cluster() -> None:
    reasons = [netns.unavailable()]
    if importlib.util.find_spec("ray") is None or not RAY.exists():  # found, not imported: the job imports it
        reasons.append(f"Ray is not installed with this Python (no {RAY}; pip install 'psdk[ray]')")
    reasons += [f"`{tool}` (util-linux) is not installed" for tool in ("unshare", "nsenter") if not shutil.which(tool)]
    reason = "; ".join(r for r in reasons if r)
    if reason:
        if os.environ.get("PSDK_NO_SKIP"):
            pytest.fail(f"PSDK_NO_SKIP is set but the Ray cluster test cannot run: {reason}")
        pytest.skip(reason)


# ----------------------------------------------------------- processes by namespace
def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _in_namespace(ns: str) -> list[int]:
    return [p for p in _pids() if _pid_ns(p) == ns]


def _die_with_this_test() -> None:
    """Runs in the child before exec: a test killed outright takes its Ray nodes and driver with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _until(what: str, condition: Callable[[], bool], timeout: float, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log()}")
        time.sleep(0.2)


# ------------------------------------------------------------------------ the cluster
@dataclass
class RayNode:
    host: netns.Host
    process: subprocess.Popen[str]  # `unshare`, whose child is the node's init: `ray start --block`
    log: Path
    init: int = 0  # that child's pid, as this test sees it
    pid_ns: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def processes(self) -> list[int]:
        return _in_namespace(self.pid_ns) if self.pid_ns else []

    def kill(self) -> None:
        """SIGKILL the node's init: the kernel kills every process of its PID namespace with it."""
        with contextlib.suppress(ProcessLookupError):
            if self.init:
                os.kill(self.init, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()  # `unshare --kill-child`: its child goes too


@dataclass
class RayCluster:
    lan: netns.Lan
    nodes: dict[str, RayNode]
    env: dict[str, str]  # what every Ray process and the driver run with (the cluster's auth token)

    @property
    def head(self) -> RayNode:
        return self.nodes["head"]

    def address(self) -> str:
        return f"{self.head.host.address}:{GCS_PORT}"

    def logs(self) -> str:
        return "".join(f"\n--- ray start on {n.host.name} ---\n{n.output()[-3000:]}" for n in self.nodes.values())

    def on_head(self, argv: list[str], stdout: IO[str]) -> subprocess.Popen[str]:
        """``argv`` on the head: its network, its process table and its /proc, as after ``ssh head``."""
        enter = ["nsenter", f"--target={self.head.init}", "--net", "--pid", "--mount", f"--wd={REPO}"]
        return subprocess.Popen(
            [*enter, *argv],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env(), **self.env),
            preexec_fn=_die_with_this_test,
        )


def _start_node(lan: netns.Lan, host: netns.Host, flags: list[str], root: Path, ray_env: dict[str, str]) -> RayNode:
    argv = [
        str(RAY),
        "start",
        "--block",
        f"--node-ip-address={host.address}",
        f"--temp-dir={root / host.name}",  # each node its own sockets and logs
        "--object-store-memory=100000000",  # the job passes nothing through it: 100 MB, not 30% of the RAM
        "--disable-usage-stats",
        *flags,
    ]
    log = root / f"{host.name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            host.command(*argv),  # `unshare --kill-child`: the node's init goes with it, and its processes with that
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=ray_env,
            preexec_fn=_die_with_this_test,
        )
    lan.processes.append(process)  # killed by lan() whatever happens
    return RayNode(host, process, log)


def _wait_until_started(node: RayNode, cluster: RayCluster) -> None:
    def started() -> bool:
        return STARTED in node.output() or node.process.poll() is not None

    _until(f"the Ray node on {node.host.name} starting", started, timeout=180, log=cluster.logs)
    assert node.process.poll() is None, f"ray start failed on {node.host.name}{cluster.logs()}"
    node.init = next(p for p in _pids() if _ppid(p) == node.process.pid)
    node.pid_ns = _pid_ns(node.init) or ""
    assert node.pid_ns and node.pid_ns != _pid_ns(os.getpid()), f"{node.host.name} has no PID namespace of its own"


def _stop(nodes: dict[str, RayNode], timeout: float = 60) -> dict[str, list[str]]:
    """Kill every node; what is still running in their PID namespaces after ``timeout`` (nothing, normally)."""
    for node in nodes.values():
        node.kill()
    deadline = time.monotonic() + timeout
    while any(n.processes() for n in nodes.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {name: [_cmdline(p)[:100] for p in n.processes()] for name, n in nodes.items()}
    return {name: cmds for name, cmds in left.items() if cmds}


@contextmanager
def ray_cluster() -> Iterator[RayCluster]:
    """A head and two worker nodes, each on its own host; every process of theirs gone afterwards."""
    root = Path(tempfile.mkdtemp(prefix="psdkt-ray-", dir="/tmp"))  # short: Ray's socket paths must fit
    token = root / "auth_token"  # Ray's token auth, as `ray start --head` enables it: one token for the cluster
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    ray_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    node_env = dict(os.environ, **ray_env)
    try:
        with netns.lan(["head", "n1", "n2"]) as lan:
            nodes: dict[str, RayNode] = {}
            cluster = RayCluster(lan, nodes, ray_env)
            try:
                head = lan["head"]
                nodes["head"] = _start_node(
                    lan, head, ["--head", f"--port={GCS_PORT}", "--include-dashboard=false", *HEAD], root, node_env
                )
                for name in ("n1", "n2"):
                    flags = [f"--address={head.address}:{GCS_PORT}", *WORKER_NODE]
                    nodes[name] = _start_node(lan, lan[name], flags, root, node_env)
                for node in nodes.values():
                    _wait_until_started(node, cluster)
                yield cluster
            except BaseException:
                _stop(nodes)
                raise
            left = _stop(nodes)
            assert not left, f"processes outlived their Ray node: {left}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- the test
def _placed(output: str) -> dict[str, str]:
    """Each task's first node, from the launcher's log: {"ps 0": "10.77.0.1", "worker 0": ...}."""
    found = re.findall(r"launcher: starting (ps|worker) (\d+) on Ray node ([0-9.]+):", output)
    return {f"{job} {index}": ip for job, index, ip in found}


def _task_processes(out: Path, *names: str) -> list[int]:
    """The ``python -m psdk`` processes of tasks ``names`` (``worker0``...) of the run in ``out``, on any host."""
    markers = [f"hydra.run.dir={out / 'tasks' / name} " for name in names]
    return [p for p in _pids() if " -m psdk " in (cmd := f"{_cmdline(p)} ") and any(m in cmd for m in markers)]


def test_the_chief_of_a_lost_node_comes_back_as_a_ray_actor_on_a_surviving_node(tmp_path: Path) -> None:
    needs_a_cluster()
    out = tmp_path / "run"
    driver_log = tmp_path / "driver.log"
    with ray_cluster() as cluster, driver_log.open("w") as log:
        # A loaded machine may delay heartbeats: a 10 s timeout, as in the multi-host tests.
        fast = [f for f in FAST_FLAGS if not f.startswith("transport.heartbeat_timeout_s=")]
        argv = [
            sys.executable,
            "-m",
            "psdk",
            "run",
            "launcher=ray",
            f"launcher.address={cluster.address()}",
            f"launcher.cpus_per_ps={CPUS_PER_PS}",
            f"launcher.cpus_per_worker={CPUS_PER_WORKER}",
            f"launcher.gpus_per_worker={GPUS_PER_WORKER}",
            "launcher.ready_timeout_s=180",
            "backend=numpy",
            "placement.device=cpu",  # the GPUs are Ray's bookkeeping only
            "sync=sync",  # the job cannot end without the chief: its restart is forced
            f"train.steps={STEPS}",
            "train.validate_every=0",
            *fast,
            "transport.heartbeat_timeout_s=10",
            f"hydra.run.dir={out}",
        ]
        job = cluster.on_head(argv, log)
        try:

            def output() -> str:
                return driver_log.read_text(errors="replace")

            def job_log() -> str:
                return f"--- driver ---\n{output()[-6000:]}{cluster.logs()}"

            def running_or_failed(condition: Callable[[], bool]) -> Callable[[], bool]:
                def check() -> bool:
                    if job.poll() is not None:
                        raise AssertionError(f"the job ended (code {job.returncode}) too early\n{job_log()}")
                    return condition()

                return check

            _until(
                f"the chief at step {KILL_AT}",
                running_or_failed(lambda: progress_of(out, "worker0") >= KILL_AT),
                timeout=240,
                log=job_log,
            )
            placed = _placed(output())
            nodes = {node.host.address: node for node in cluster.nodes.values()}
            assert placed["ps 0"] == cluster.head.host.address, placed  # the only node it fits on
            assert {placed["worker 0"], placed["worker 1"]} <= {cluster.nodes[n].host.address for n in ("n1", "n2")}
            victim = nodes[placed["worker 0"]]
            survivor = next(n for n in cluster.nodes.values() if n not in (victim, cluster.head))
            lost = [w for w in ("worker 0", "worker 1") if placed[w] == victim.host.address]
            chief_before = _task_processes(out, "worker0")
            assert [_pid_ns(p) for p in chief_before] == [victim.pid_ns], "the chief is not on its Ray node"

            victim.kill()  # its raylet, its Ray workers and the chief, all at once, as when a machine dies
            _until(f"every process of {victim.host.name} gone", lambda: not victim.processes(), 30, job_log)

            back = f"worker 0 (on {victim.host.address}) started again on Ray node {survivor.host.address}"
            _until("the chief started again", running_or_failed(lambda: back in output()), 240, job_log)
            # It runs as a Ray actor's child in the survivor's process table, not as a process of the driver.
            chief = _task_processes(out, "worker0")
            assert len(chief) == 1 and _pid_ns(chief[0]) == survivor.pid_ns, (chief, job_log())
            parent = _ppid(chief[0])
            assert parent is not None and _cmdline(parent).startswith("ray::"), _cmdline(parent or 0)

            code = job.wait(timeout=300)
            # Every task is gone with its actor, on every node still up.
            _until("every task gone", lambda: not _task_processes(out, "worker0", "worker1", "ps0"), 30, job_log)
        finally:
            if job.poll() is None:
                job.kill()  # nsenter; the driver itself goes with the head's PID namespace
                job.wait(timeout=10)
    text = driver_log.read_text(errors="replace")
    assert code == 0, text[-8000:]
    for worker in lost:
        assert f"{worker} (on {victim.host.address}) was lost with its Ray actor" in text, text[-8000:]
        assert f"{worker} (on {victim.host.address}) started again on Ray node {survivor.host.address}" in text
    assert text.count("restarting it as a new Ray actor (1/3)") == len(lost)
    assert f"started again on Ray node {victim.host.address}" not in text
    # What the restarted chief printed came from its actor on the survivor, through Ray's log forwarding.
    assert re.search(rf"\(worker0 pid=\d+, ip={re.escape(survivor.host.address)}\)", text)
    assert re.search(rf"fetched .*summary\.json.* from the chief's node {re.escape(survivor.host.address)}\n", text)
    summary = json.loads((out / "summary.json").read_text())
    # The launcher names a task by the node it runs on: once restarted, by its new one.
    assert summary["restarts"] == {f"{w} (on {survivor.host.address})": 1 for w in lost}  # and the ps never
    assert summary["global_step"] == STEPS
    assert all(summary["workers"][w]["status"] == "finished" for w in ("0", "1"))
    assert text.strip().splitlines()[-1].startswith("psdk done:")
