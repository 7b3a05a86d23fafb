"""launcher=ray: Ray stays optional, bad settings name their key, and one smoke run on a local Ray."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from psdk.errors import ConfigError
from psdk.launch.ray import RayLauncher, import_ray
from psdk.launch.ray_actors import TaskRunner
from psdk.protocol.cluster import Topology
from psdk.transport import security

from .conftest import REPO
from .jobs import FAST_FLAGS, all_tasks_gone, kill_task_when, progress_of, psdk, start, test_accuracy


def test_without_ray_the_launcher_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'psdk\[ray\]'"):
        import_ray()


def test_the_core_and_the_launchers_never_import_ray() -> None:
    code = (
        "import sys, psdk, psdk.launch.cli, psdk.launch.local, psdk.launch.ray, psdk.ps.main, "
        "psdk.jobs.worker; "
        "psdk.launch.ray.RayLauncher(); print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_run_launcher_ray_without_ray_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['ray'] = None; from psdk.launch.cli import main; "
        f"sys.exit(main(['run', 'launcher=ray', 'backend=numpy', 'hydra.run.dir={tmp_path}']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    text = result.stdout + result.stderr
    assert result.returncode != 0 and "launcher=ray needs Ray" in text and "pip install 'psdk[ray]'" in text
    assert "Traceback" not in text


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"cpus_per_ps": 0}, "launcher.cpus_per_ps"),
        ({"cpus_per_worker": -1}, "launcher.cpus_per_worker"),
        ({"gpus_per_worker": -0.5}, "launcher.gpus_per_worker"),
        ({"num_cpus": 0}, "launcher.num_cpus"),
    ],
)
def test_bad_resources_name_their_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RayLauncher(**kwargs)  # type: ignore[arg-type]


def test_a_local_ray_too_small_for_the_job_is_refused_before_it_starts() -> None:
    launcher = RayLauncher(num_cpus=2, cpus_per_ps=1, cpus_per_worker=1)
    with pytest.raises(ConfigError) as info:
        launcher._connect(object(), Topology(num_ps=1, num_workers=2))  # fails before touching Ray
    text = str(info.value)
    assert "launcher.num_cpus" in text and "offers 2 CPUs" in text and "asks for 3" in text
    assert "launcher.cpus_per_ps" in text


def test_a_ps_binds_its_node_ip_and_a_local_ray_keeps_to_loopback() -> None:
    assert RayLauncher(address="auto").bind_host("10.0.0.7") == "10.0.0.7"
    assert RayLauncher(address="ray://head:10001").bind_host("10.0.0.7") == "10.0.0.7"
    assert RayLauncher(address=None).bind_host("10.0.0.7") == "127.0.0.1"
    assert RayLauncher(gpus_per_worker=0.5).needs(Topology(num_ps=2, num_workers=4)) == (6.0, 2.0)


def test_each_node_gets_only_the_keys_its_task_needs(tmp_path: Path) -> None:
    keys = security.generate(tmp_path / "keys", 2, num_ps=2)

    def shipped(job: str, index: int) -> Path:
        folder = tmp_path / f"{job}{index}" / "keys"
        files = {str(p.relative_to(keys)): p.read_bytes() for g in security.files_for(job, index) for p in keys.glob(g)}
        TaskRunner(f"{job} {index}").write_files(str(folder), files)
        return folder

    ps = shipped("ps", 1)
    assert len(security.load_server(ps, 1).allowed) == 2
    assert sorted(p.name for p in ps.rglob("*_secret")) == ["ps-1.key_secret"]
    worker = shipped("worker", 1)
    assert security.load_worker(worker, 1, num_ps=2).servers == tuple(
        security.load_server(keys, j).public for j in range(2)
    )
    assert sorted(p.name for p in worker.rglob("*_secret")) == ["worker-1.key_secret"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in worker.rglob("*_secret"))


# A local Ray on this machine's 2 CPUs, with room for a ps and two workers.
LOCAL_RAY = ["launcher=ray", "launcher.num_cpus=2", "launcher.cpus_per_ps=0.5", "launcher.cpus_per_worker=0.5"]


def needs_ray() -> None:
    if importlib.util.find_spec("ray") is None:  # found, not imported: the job imports it, not this test
        if os.environ.get("PSDK_NO_SKIP"):
            pytest.fail("PSDK_NO_SKIP is set but Ray is not installed (pip install 'psdk[ray]')")
        pytest.skip("Ray is not installed (pip install 'psdk[ray]')")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_job_on_a_local_ray_with_2_cpus(tmp_path: Path) -> None:
    needs_ray()
    result = psdk(
        "run",
        *LOCAL_RAY,
        "backend=numpy",
        "train.steps=300",
        "train.validate_every=100",
        "transport.secure=true",
        *FAST_FLAGS,
        out=tmp_path,
        timeout=240,
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 300 and summary["gradients_applied"] == 300
    assert summary["test_accuracy"] == pytest.approx(test_accuracy(tmp_path / "params.npz"), abs=1e-4)
    assert summary["test_accuracy"] > 0.85
    assert all(summary["workers"][w]["status"] == "finished" for w in ("0", "1"))
    assert "started a local Ray (2 CPUs, no dashboard)" in text
    assert "starting ps 0 on Ray node" in text and "starting worker 1 on Ray node" in text
    assert "ps tasks listening at 127.0.0.1:" in text
    assert "CURVE on: 2 worker key(s) accepted" in text
    assert result.stdout.strip().splitlines()[-1].startswith("psdk done:")
    assert all_tasks_gone(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_comes_back_as_a_new_ray_actor_not_a_local_process(tmp_path: Path) -> None:
    """The local launcher's restart ran the `python` on PATH on the driver's machine, not a task on Ray."""
    needs_ray()
    job = start(
        "run",
        *LOCAL_RAY,
        "backend=numpy",
        "sync=sync",  # the job cannot end without worker 1: its restart is forced
        "train.steps=1500",
        "train.validate_every=0",
        *FAST_FLAGS,
        out=tmp_path,
    )
    output = kill_task_when(job, tmp_path, "worker1", lambda: progress_of(tmp_path, "worker1") >= 40, timeout=240)
    assert job.returncode == 0, output
    assert "restarting it as a new Ray actor (1/3)" in output
    assert re.search(r"worker 1 \(on [0-9.]+\) started again on Ray node", output)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 1500 and summary["workers"]["1"]["status"] == "finished"
    assert sum(summary["restarts"].values()) == 1
    assert all_tasks_gone(tmp_path)
