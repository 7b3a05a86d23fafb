"""Smoke tests of the peer scripts: the JSON contract, clean-up, timeouts, and learning at all.

Every run is a subprocess (``python benchmarks/peers/<script> ...``); the
runs are short (50 steps), so accuracy only has to beat chance clearly.
Leftover processes are found through a random token put in the launcher's
environment, which every task inherits.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import PEERS

KEYS = ["system", "framework", "mode", "steps", "updates_per_s", "test_accuracy", "wall_s", "ps_max_rss_mb", "notes"]
STEPS = 50


def leftovers(token: str) -> list[str]:
    """Command lines of live processes whose environment carries ``token``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"PSDK_PEER_TEST={token}".encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


@functools.cache
def can_unshare_net() -> bool:
    """Whether `unshare -n` and `ip` work here (root, or user namespaces allowed)."""
    try:
        probe = ["unshare", "-n", "sh", "-c", "ip link set lo up"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def start(
    script: str, args: list[str], token: str, netns: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Run a peer script; with ``netns``, as the harness does: in a network namespace with only loopback."""
    env = dict(os.environ, **(env or {}), PSDK_PEER_TEST=token)
    argv = [sys.executable, str(PEERS / script), *args]
    if netns:
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen[str], token: str, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launcher did not finish in {timeout} s:\n{err[-3000:]}")
    deadline = time.time() + 5  # killed tasks may take a moment to vanish
    while (left := leftovers(token)) and time.time() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
    return proc.returncode, out, err


def check_contract(out: str, err: str, system: str, framework: str, mode: str, has_ps: bool) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got {lines!r}\nstderr:\n{err[-3000:]}"
    result = json.loads(lines[0])
    assert list(result) == KEYS
    assert (result["system"], result["framework"], result["mode"], result["steps"]) == (system, framework, mode, STEPS)
    assert isinstance(result["updates_per_s"], float) and result["updates_per_s"] > 0
    assert isinstance(result["wall_s"], float) and result["wall_s"] > 0
    assert isinstance(result["test_accuracy"], float) and 0.5 < result["test_accuracy"] <= 1.0  # chance is 0.1
    if has_ps:
        assert isinstance(result["ps_max_rss_mb"], float) and result["ps_max_rss_mb"] > 10
    else:
        assert result["ps_max_rss_mb"] is None
    assert isinstance(result["notes"], str)
    return result


RUNS = [
    ("single.py", ["--framework", "torch"], "single", "torch", "single", False),
    ("single.py", ["--framework", "tf"], "single", "tensorflow", "single", False),
    ("single.py", ["--framework", "jax"], "single", "jax", "single", False),
    ("torch_ddp.py", ["--mode", "sync"], "torch_ddp", "torch", "sync", False),
    ("torch_rpc_ps.py", ["--mode", "async"], "torch_rpc_ps", "torch", "async", True),
    ("torch_rpc_ps.py", ["--mode", "sync"], "torch_rpc_ps", "torch", "sync", True),
    ("tf1_ps_worker.py", ["--mode", "async"], "tf1_ps_worker", "tensorflow", "async", True),
    ("tf1_ps_worker.py", ["--mode", "sync"], "tf1_ps_worker", "tensorflow", "sync", True),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("script", "extra", "system", "framework", "mode", "has_ps"),
    RUNS,
    ids=[f"{r[0].removesuffix('.py')}-{r[1][1]}" for r in RUNS],
)
def test_smoke(
    script: str,
    extra: list[str],
    system: str,
    framework: str,
    mode: str,
    has_ps: bool,
    psdk_mnist_dir: Path,
    token: str,
) -> None:
    """A short run of every peer; in a loopback-only network namespace where one can be made (as the harness runs)."""
    args = [*extra, "--steps", str(STEPS), "--workers", "2", "--data", str(psdk_mnist_dir), "--timeout", "120"]
    code, out, err = finish(start(script, args, token, netns=can_unshare_net()), token, timeout=140)
    assert code == 0, err[-3000:]
    check_contract(out, err, system, framework, mode, has_ps)


@pytest.mark.timeout(60)
def test_timeout_kills_every_task_and_names_the_one_waited_for(psdk_mnist_dir: Path, token: str) -> None:
    # 1 s is not enough for the ranks to even import torch.
    proc = start("torch_ddp.py", ["--mode", "sync", "--data", str(psdk_mnist_dir), "--timeout", "1"], token)
    code, out, err = finish(proc, token, timeout=30)
    assert code == 124
    assert out == ""
    assert "timed out after 1 s waiting for task rank0" in err


@pytest.mark.timeout(30)
def test_missing_data_fails_fast_in_the_launcher(tmp_path: Path, token: str) -> None:
    proc = start("tf1_ps_worker.py", ["--mode", "sync", "--data", str(tmp_path)], token)
    code, out, err = finish(proc, token, timeout=25)
    assert code == 2
    assert out == ""
    assert "MNIST files missing" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_kills_every_task(psdk_mnist_dir: Path, token: str, sig: signal.Signals, tmp_path: Path) -> None:
    """Ctrl-C and SIGTERM: the launcher kills its tasks and cleans up; SIGKILL: the kernel kills them."""
    args = ["--mode", "sync", "--data", str(psdk_mnist_dir), "--timeout", "60"]
    proc = start("torch_rpc_ps.py", args, token, env={"TMPDIR": str(tmp_path)})
    deadline = time.time() + 20
    while len(leftovers(token)) < 4 and time.time() < deadline:  # launcher + ps + 2 workers
        time.sleep(0.05)
    assert len(leftovers(token)) == 4
    proc.send_signal(sig)
    code, out, _ = finish(proc, token, timeout=30)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
    assert out == ""
    if sig != signal.SIGKILL:
        assert not list(tmp_path.iterdir()), "the launcher's temporary folder is left"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", ["single.py", "torch_ddp.py", "torch_rpc_ps.py", "tf1_ps_worker.py"])
def test_launcher_imports_no_framework(script: str) -> None:
    """The launcher side of every script (module import + argument parsing) stays framework-free."""
    code = (
        "import runpy, sys; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "bad = sorted(m for m in ('torch', 'tensorflow') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(PEERS / script)], capture_output=True, text=True, timeout=25)
    assert done.returncode == 0, done.stderr


def test_batches_cover_each_epoch_once() -> None:
    import _common as c

    x = np.arange(1000, dtype=np.float32).reshape(250, 4)
    y = np.arange(250)
    batches = c.Batches(x, y, 100, seed=0, worker=1)
    seen = [next(batches) for _ in range(4)]  # 2 per epoch: 50 images dropped each epoch
    assert batches.epoch == 2
    for bx, by in seen:
        assert bx.shape == (100, 4) and by.shape == (100,)
        assert np.array_equal(bx[:, 0] / 4, by)  # rows stay with their labels
    first_epoch = np.concatenate([seen[0][1], seen[1][1]])
    assert len(np.unique(first_epoch)) == 200
    assert not np.array_equal(seen[0][1], seen[2][1])  # reshuffled


def test_rate_counts_like_psdk() -> None:
    import _common as c

    assert c.rate(2000, 10.0, 12.0) == 1000.0
    assert c.rate(1, 10.0, 10.0) is None
    assert c.rate(10, None, 12.0) is None


def test_this_process_imports_no_framework() -> None:
    """The smoke tests talk to the peers through subprocesses and JSON only."""
    assert "torch" not in sys.modules
    assert "tensorflow" not in sys.modules
