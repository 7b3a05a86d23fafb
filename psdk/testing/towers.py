"""The towers equivalence check a backend plugin runs: replicas on slices of a batch against one device on all of it.

``python -m psdk.testing.towers BACKEND SIZE TOWERS`` prints, as JSON, the
loss of one device on a random MNIST-shaped batch of ``SIZE`` examples, the
towers' loss on it, and the largest difference of any gradient. It runs in a
process of its own, since JAX and TensorFlow make CPU replicas only before
they start (:meth:`~psdk.plugins.backend.Backend.setup_towers`), and a test
process has usually started them already. What it proves is the arithmetic
(the split, the shares, the reduction), not any speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from psdk.jobs.workload import make_trainer
from psdk.plugins.batches import Batch
from psdk.plugins.loading import load_backend
from psdk.plugins.models import ModelSpec
from psdk.plugins.registry import installed_workloads
from psdk.plugins.towers import in_towers
from psdk.testing.jobs import FAST_HEARTBEATS, psdk_command, run_job
from psdk.workloads.mnist.trainers import IMAGE

SPEC = ModelSpec(name="small", hidden=(32, 16), input_dim=50, num_classes=10)


def compare(backend: str, size: int, towers: int, seed: int = 0) -> dict[str, Any]:
    """One device against ``towers`` CPU replicas on the same batch and weights: losses, largest gradient gap."""
    rng = np.random.default_rng(seed)
    batch = Batch({IMAGE: rng.random((size, SPEC.input_dim), dtype=np.float32)}, rng.integers(0, 10, size))
    weights = SPEC.init_weights(seed)
    mnist = installed_workloads()["mnist"]

    replicated = load_backend(backend)
    replicated.setup_towers([f"cpu:{k}" for k in range(towers)])  # first: JAX and TF make replicas before they start
    bridge, trainer = in_towers(replicated, make_trainer(mnist, replicated, {}))
    model = trainer.build_model(SPEC, weights)
    tower_loss = trainer.forward_backward(model, batch)
    got = {n: np.zeros(s, np.float32) for n, s in bridge.variables(model).items()}
    bridge.read_gradients(model, got)

    single = load_backend(backend)
    single.setup("cpu")
    one = make_trainer(mnist, single, {})
    whole = one.build_model(SPEC, weights)
    loss = one.forward_backward(whole, batch)
    expected = {n: np.zeros(s, np.float32) for n, s in single.variables(whole).items()}
    single.read_gradients(whole, expected)
    gaps = {n: float(np.abs(got[n] - expected[n]).max()) for n in expected}
    scale = max(float(np.abs(v).max()) for v in expected.values())
    return {
        "devices": list(bridge.tower_devices),
        "loss": loss,
        "tower_loss": tower_loss,
        "max_gradient_gap": max(gaps.values()),
        "largest_gradient": scale,
        "shares": model.shares,
    }


def compare_in_subprocess(backend: str, size: int, towers: int, timeout_s: float = 100.0) -> dict[str, Any]:
    """:func:`compare` in a fresh interpreter (whose framework has not started yet)."""
    done = subprocess.run(
        [sys.executable, "-m", "psdk.testing.towers", backend, str(size), str(towers)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_jobs_at_once(
    runs: dict[str, tuple[str, ...]], tmp_path: Path, data_dir: Path, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Start ``python -m psdk run`` once per entry (into ``tmp_path/<key>``) at once; each summary by key.

    A job is mostly start-up, so two at once take about as long as one.
    An unfinished job is interrupted (its launcher then ends its tasks).
    """
    env = {**os.environ, "PSDK_DATA_DIR": str(data_dir)}
    started = {
        key: subprocess.Popen(
            psdk_command("run", *overrides, *FAST_HEARTBEATS, out=tmp_path / key),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for key, overrides in runs.items()
    }
    try:
        outputs = {key: process.communicate(timeout=timeout_s)[0] for key, process in started.items()}
    finally:
        for process in started.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=20)
    for key, process in started.items():
        assert process.returncode == 0, f"{key}: {outputs[key][-3000:]}"
    return {key: json.loads((tmp_path / key / "summary.json").read_text()) for key in runs}


def parameters_apart(first: Path, second: Path) -> float:
    """The largest difference of any parameter between two runs' ``params.npz``."""
    a, b = np.load(first / "params.npz"), np.load(second / "params.npz")
    assert sorted(a.files) == sorted(b.files)
    return max(float(np.abs(a[name] - b[name]).max()) for name in a.files)


def two_towers_against_one(backend: str, tmp_path: Path, data_dir: Path, timeout_s: float) -> dict[str, dict[str, Any]]:
    """One worker, sync, the same seed, with ``placement.towers`` 1 (``t1``) and 2 (``t2``): both summaries.

    Its batches are the default job's, so the parameters must be too: a reduction that summed instead of
    averaging, or kept one tower's gradient, ends hundreds of times further away than float rounding.
    """
    job = (f"backend={backend}", "topology.num_workers=1", "sync=sync", "train.steps=200", "report.plot=false")
    runs: dict[str, tuple[str, ...]] = {f"t{towers}": (*job, f"placement.towers={towers}") for towers in (1, 2)}
    summaries = run_jobs_at_once(runs, tmp_path, data_dir, timeout_s)
    apart = parameters_apart(tmp_path / "t1", tmp_path / "t2")
    assert apart < 1e-4, f"towers=2 ended {apart:g} from the default job's parameters"
    return summaries


def towers_beside_one_without(backend: str, sync: str, tmp_path: Path, data_dir: Path, timeout_s: float) -> None:
    """A worker with two towers beside one without (``placement.towers=[2,1]``) trains MNIST as any job."""
    summary, _ = run_job(
        tmp_path / "run",
        f"backend={backend}",
        f"sync={sync}",
        "placement.towers=[2,1]",
        "train.steps=300",
        "report.plot=false",
        data_dir=data_dir,
        cwd=tmp_path,
        timeout_s=timeout_s,
    )
    workers = summary["workers"]
    assert workers["0"]["devices"] == ["cpu:0", "cpu:1"] and workers["1"]["devices"] == ["cpu"]
    assert all(w["gradients_pushed"] > 0 for w in workers.values())
    assert summary["global_step"] == 300 and summary["test_accuracy"] >= 0.9


if __name__ == "__main__":
    name, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(compare(name, size, count)))
