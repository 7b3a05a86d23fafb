"""One ps and two workers on three separate hosts: network namespaces with their own addresses.

Each task runs with ``ip netns exec`` on its own host (10.77.0.1 for the ps,
.2 and .3 for the workers), reached only over a bridge, exactly as the
per-task commands of the README run on three machines. Needs root and
iproute2; it skips without them, except where ``PSDK_NO_SKIP`` is set (CI),
where it fails instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from psdk.testing import assert_every_worker_contributed
from psdk.transport import security

from . import netns
from .conftest import REPO, free_port
from .jobs import FAST_FLAGS, env, progress_of, test_accuracy, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GRADIENT_BYTES = 79510 * 4  # one MLP gradient (784-100-10) in float32


@pytest.fixture
def hosts() -> Iterator[netns.Lan]:
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("PSDK_NO_SKIP"):
            pytest.fail(f"PSDK_NO_SKIP is set but the multi-host test cannot run: {reason}")
        pytest.skip(reason)
    with netns.lan(["ps", "w0", "w1"]) as lan:
        yield lan


def psdk_argv(*args: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "psdk", *args, f"hydra.run.dir={out}"]


def start_job(
    lan: netns.Lan, tmp_path: Path, port: int, *flags: str, heartbeat_timeout_s: float = 10, tf_config: bool = False
) -> dict[str, subprocess.Popen[str]]:
    """The README's three commands, one per host: by flags, or by ``TF_CONFIG`` alone."""
    ps, w0, w1 = lan["ps"], lan["w0"], lan["w1"]
    # A loaded machine may delay heartbeats: only the test that wants a death detects it quickly.
    fast = [f for f in FAST_FLAGS if not f.startswith("transport.heartbeat_timeout_s=")]
    # CURVE, as everywhere: each host gets only its own task's key files, as the README says.
    keys = security.generate(tmp_path / "keys", 2)
    common = ["backend=numpy", *fast, f"transport.heartbeat_timeout_s={heartbeat_timeout_s}", *flags]
    # The three hosts share this machine's cores, as under the local launcher: one BLAS thread each.
    base_env = dict(env(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cluster = [f"--ps_hosts={ps.address}:{port}", f"--worker_hosts={w0.address},{w1.address}"]
    tasks = {"ps": ("ps", 0, ps), "w0": ("worker", 0, w0), "w1": ("worker", 1, w1)}
    tf_tasks = {"ps": ("ps", 0), "w0": ("chief", 0), "w1": ("worker", 0)}
    tf_cluster = {"chief": [f"{w0.address}:2222"], "worker": [f"{w1.address}:2222"], "ps": [f"{ps.address}:{port}"]}
    procs = {}
    for name, (job, index, host) in tasks.items():
        own = tmp_path / name / "keys"
        for pattern in security.files_for(job, index):
            for source in keys.glob(pattern):
                target = own / source.relative_to(keys)
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                target.write_bytes(source.read_bytes())
                target.chmod(0o600)
        secrets = sorted(p.name for p in own.rglob("*_secret"))
        assert secrets == [f"{'ps-' if job == 'ps' else 'worker-'}{index}.key_secret"], secrets
        common_here = [*common, f"transport.keys_dir={own}"]
        if tf_config:
            task_type, tf_index = tf_tasks[name]
            spec = {"cluster": tf_cluster, "task": {"type": task_type, "index": tf_index}}
            argv, task_env = ["task", *common_here], dict(base_env, TF_CONFIG=json.dumps(spec))
        else:
            argv, task_env = [job, f"--task_index={index}", *cluster, *common_here], base_env
        procs[name] = lan.start(host, psdk_argv(*argv, out=tmp_path / name), env=task_env, cwd=REPO)
    return procs


def finish(procs: dict[str, subprocess.Popen[str]], timeout: float = 180) -> dict[str, str]:
    return {name: p.communicate(timeout=timeout)[0] for name, p in procs.items()}


@pytest.mark.parametrize("tf_config", [False, True], ids=["flags", "tf_config"])
def test_one_ps_and_two_workers_on_three_hosts_train_mnist(hosts: netns.Lan, tmp_path: Path, tf_config: bool) -> None:
    ps, w0, w1 = hosts["ps"], hosts["w0"], hosts["w1"]
    port = free_port()  # free in the root namespace too, so that the isolation check below means something
    procs = start_job(hosts, tmp_path, port, "train.steps=600", "train.validate_every=200", tf_config=tf_config)

    wait_for(lambda: hosts.can_connect(w1, ps.address, port), procs["ps"], timeout=60)
    # The ps binds exactly its address on its own host: not loopback there, and nothing outside the LAN.
    assert not hosts.can_connect(ps, "127.0.0.1", port)
    assert not hosts.can_connect(w0, "127.0.0.1", port)
    assert not hosts.can_connect(None, "127.0.0.1", port)

    outputs = finish(procs)
    assert {name: p.returncode for name, p in procs.items()} == {"ps": 0, "w0": 0, "w1": 0}, outputs
    summary = json.loads((tmp_path / "w0" / "summary.json").read_text())
    assert summary["global_step"] == 600 and summary["num_workers"] == 2
    assert summary["test_accuracy"] >= 0.9
    assert summary["test_accuracy"] == pytest.approx(test_accuracy(tmp_path / "w0" / "params.npz"), abs=1e-4)
    assert all(summary["workers"][worker]["status"] == "finished" for worker in ("0", "1"))
    assert_every_worker_contributed(summary, tmp_path / "w0" / "metrics.jsonl", tmp_path / "w1" / "metrics.jsonl")
    assert f"serving at tcp://{ps.address}:{port}" in outputs["ps"] and "CURVE on" in outputs["ps"]
    assert "shut down by the chief at version 600" in outputs["ps"]
    if tf_config:
        assert "worker 1: role and cluster from TF_CONFIG task worker 0" in outputs["w1"]
    # The hosts do not share memory: the workers' offers were refused and every applied gradient
    # crossed the wire into the ps's host.
    assert "worker-0 stays on ZeroMQ frames" in outputs["ps"] and "worker-1 stays on ZeroMQ frames" in outputs["ps"]
    assert hosts.rx_bytes(ps) >= summary["gradients_applied"] * GRADIENT_BYTES


def test_when_the_chief_host_vanishes_the_ps_exits_naming_the_chief(hosts: netns.Lan, tmp_path: Path) -> None:
    flags = ["train.steps=1000000", "train.validate_every=0", "recovery.enabled=false"]
    procs = start_job(hosts, tmp_path, free_port(), *flags, heartbeat_timeout_s=3)
    wait_for(lambda: progress_of(tmp_path / "w1", "worker1") >= 40, procs["w1"], timeout=120)
    hosts.unplug(hosts["w0"])

    outputs = finish(procs, timeout=90)  # nobody is left running: not the ps, not the stranded workers
    assert procs["ps"].returncode == 1, outputs["ps"]
    assert f"the chief (worker 0 at {hosts['w0'].address}) is gone: no heartbeat" in outputs["ps"]
    assert procs["w0"].returncode != 0 and procs["w1"].returncode != 0
    assert "ps 0" in outputs["w0"] and "ps 0" in outputs["w1"]


def test_the_lan_is_removed_even_when_the_test_fails() -> None:
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("PSDK_NO_SKIP"):
            pytest.fail(f"PSDK_NO_SKIP is set but network namespaces cannot be made: {reason}")
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="boom"), netns.lan(["a"]) as lan:
        names = {h.netns for h in lan.hosts} | {lan.switch}
        assert names <= set(netns._namespaces())
        raise RuntimeError("boom")
    assert not names & set(netns._namespaces())
