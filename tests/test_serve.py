"""A ps from your own script (``psdk.serve``) and summaries from your own loop (``psdk.SummaryWriter``).

The ps is the real one of ``python -m psdk ps`` over real sockets with CURVE keys, serving in a
thread of this process; the workers are threads on the public API and the numpy backend.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psdk
from psdk.client import ClientOptions
from psdk.config.options import TransportOptions
from psdk.errors import ConfigError, PortInUseError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.report.runs import load_run
from psdk.report.tensorboard import EventWriter
from psdk.transport import security

from .helpers import accuracy, forward_backward
from .test_report import check_png, events

pytestmark = pytest.mark.timeout(60)

SPEC = ModelSpec(hidden=(), input_dim=16, num_classes=4)
FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, request_timeout_s=30.0, init_timeout_s=30.0
    )
)
FAST_PS = {"transport.heartbeat_interval_s": 0.2, "transport.heartbeat_timeout_s": 5, "ps.idle_timeout_s": 30}


def cluster(num_workers: int, ps: str = "127.0.0.1:0") -> psdk.ClusterSpec:
    return psdk.ClusterSpec({"ps": [ps], "worker": ["localhost"] * num_workers})


def batch(task: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """A separable problem: the class is the block of 4 features that is largest."""
    rng = np.random.default_rng(1000 * task + step)
    y = rng.integers(0, 4, 32)
    x = rng.normal(0, 0.3, (32, 16)).astype(np.float32)
    x[np.arange(32)[:, None], 4 * y[:, None] + np.arange(4)] += 1.0
    return x, y


def worker(spec: psdk.ClusterSpec, task: int, keys: Path, logdir: Path, steps: int, out: dict[str, Any]) -> None:
    """A user's worker loop: connect, step, write scalars; the chief writes the summary."""
    try:
        backend = NumpyBackend()
        model = backend.build_model(SPEC, init_weights(SPEC, 0))
        with (
            psdk.connect(spec, task, steps=steps, options=FAST, keys=keys) as session,
            psdk.SummaryWriter(str(logdir), task_index=task) as writer,  # a str path, as a user types it
        ):
            opt = psdk.DistributedOptimizer(None, model, session, backend=backend, rule=psdk.rules.SGD(lr=0.5))
            opt.broadcast_parameters()
            local = 0
            while not session.should_stop():
                loss = forward_backward(model, *batch(task, local))
                opt.step()
                local += 1
                if local % 10 == 0:
                    writer.scalar("loss", loss, session.global_step)
                    writer.scalars({"accuracy": accuracy(model, *batch(99, local))}, session.global_step)
            session.finish(wait_s=30)
            if session.is_chief:
                opt.pull()
                final = accuracy(model, *batch(7, 7))
                out["summary"] = writer.write_summary(session, test_accuracy=final, model="softmax16")
    except BaseException as exc:
        out.setdefault("errors", []).append(repr(exc))


def test_a_ps_from_a_script_serves_a_job_with_keys_and_the_chief_writes_its_summaries(tmp_path: Path) -> None:
    keys = security.generate(tmp_path / "keys", num_workers=2)
    server = psdk.serve(cluster(2), 0, keys=keys, overrides=FAST_PS)
    assert server.running and server.address.startswith("tcp://127.0.0.1:")
    spec = cluster(2, server.address.removeprefix("tcp://"))
    out: dict[str, Any] = {}
    logdir = tmp_path / "logs"
    threads = [threading.Thread(target=worker, args=(spec, i, keys, logdir, 200, out)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert server.join(timeout=10) is True, "the chief's shutdown ends join()"
    assert server.exit_code == 0 and "errors" not in out, out

    summary = out["summary"]
    assert json.loads((logdir / "summary.json").read_text()) == summary
    assert summary["global_step"] == 200 and summary["gradients_applied"] == 200
    assert summary["num_workers"] == 2 and summary["sync"]["mode"] == "async" and summary["model"] == "softmax16"
    assert summary["test_accuracy"] > 0.8  # the separable problem: chance is 0.25
    assert {w["status"] for w in summary["workers"].values()} == {"finished"}
    check_png(logdir / "curves.png")
    lines = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert {p["task"] for p in lines} == {"worker0", "worker1"}
    for task in ("worker0", "worker1"):
        (path,) = (logdir / "tensorboard" / task).glob("events.out.tfevents.*")
        logged = [e for e in events(path) if "scalars" in e]
        mine = [p for p in lines if p["task"] == task]
        assert [e["step"] for e in logged] == [p["global_step"] for p in mine]
        assert [e["scalars"] for e in logged] == [
            pytest.approx({k: v for k, v in p.items() if k in ("loss", "accuracy")}, rel=1e-6) for p in mine
        ]
    run = load_run(logdir)  # as `python -m psdk report` reads a run
    assert run.finished and run.setting("num_workers") == 2 and run.best_val_accuracy() is not None


def test_join_waits_until_stop_and_a_failed_ps_raises_why(tmp_path: Path) -> None:
    with psdk.serve(cluster(1), 0, secure=False, overrides=["ps.idle_timeout_s=null"]) as server:
        assert server.join(timeout=0.3) is False and server.running
        threading.Timer(0.2, server.stop).start()
        assert server.join(timeout=20) is True and server.exit_code == 0
    # No chief ever comes: the ps gives up after transport.startup_timeout_s, and join() says so.
    server = psdk.serve(cluster(1), 0, secure=False, overrides=["transport.startup_timeout_s=0.3"])
    with pytest.raises(psdk.PsdkError, match="exit code 1"):
        server.join(timeout=20)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"overrides": ["ps.idle_timout_s=5"]},
            r"ps\.idle_timout_s: there is no such key; did you mean ps\.idle_timeout_s",
        ),
        (
            {"overrides": {"ps.idle_timeout_s": "soon"}},
            r"ps\.idle_timeout_s: must be a number in \(0, .*, got 'soon'",
        ),
        ({"task_index": 1}, r"task_index: is 1 but ps_hosts lists 1 task"),
        ({"task_index": "0"}, r"task_index: must be a whole number"),
        ({"secure": True}, r"keys: psdk\.serve needs the job's keys: keys=DIR"),
        ({"overrides": ["transport.keys_dir=keys"]}, r"transport\.keys_dir: is an argument of psdk\.serve.*keys="),
        ({"overrides": ["task_index=1"]}, r"task_index: is an argument of psdk\.serve"),
        ({"overrides": "ps.bind=0.0.0.0"}, r"overrides: must be a list of key=value strings"),
        ({"keys": "no-such-folder"}, r"transport\.keys_dir"),
    ],
)
def test_a_bad_argument_is_refused_at_once_naming_it(kwargs: dict[str, Any], match: str, tmp_path: Path) -> None:
    given: dict[str, Any] = {"secure": False, **kwargs}
    if "keys" in kwargs:
        given["keys"], given["secure"] = tmp_path / kwargs["keys"], True
    with pytest.raises(ConfigError, match=match):
        psdk.serve(cluster(1), **given)


def test_an_address_in_use_is_refused_when_serve_returns() -> None:
    with psdk.serve(cluster(1), 0, secure=False) as first:
        taken = first.address.removeprefix("tcp://")
        with pytest.raises(PortInUseError, match=r"ps 0 cannot bind .*the port is in use"):
            psdk.serve(cluster(1, taken), 0, secure=False)
        assert first.running


def test_event_files_take_a_str_or_a_path(tmp_path: Path) -> None:
    for folder in (str(tmp_path / "a"), tmp_path / "b"):
        writer = EventWriter(folder)
        writer.scalars(3, {"loss": 0.5}, wall_time=10.0)
        writer.close()
        (path,) = Path(folder).glob("events.out.tfevents.*")
        assert events(path)[1] == {"wall_time": 10.0, "step": 3, "scalars": {"loss": 0.5}}


def test_a_summary_writer_without_a_cluster_writes_events_curves_and_a_summary(tmp_path: Path) -> None:
    with psdk.SummaryWriter(tmp_path, task_index=2) as writer:
        for step in range(1, 6):
            writer.scalars({"loss": 1.0 / step, "accuracy": 0.5 + step / 20}, step)
        writer.scalar("learning_rate", np.float32(0.01), 5)  # a numpy number, as a loop has them
        with pytest.raises(psdk.PsdkError, match="is no scalar number"):
            writer.scalar("loss", "low", 6)
        summary = writer.write_summary(test_accuracy=0.75, steps=5)
    assert summary["test_accuracy"] == 0.75 and summary["steps"] == 5
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    check_png(tmp_path / "curves.png")
    (path,) = (tmp_path / "tensorboard" / "worker2").glob("events.out.tfevents.*")
    logged = [e for e in events(path) if "scalars" in e]
    assert logged[-1]["scalars"] == pytest.approx({"learning_rate": 0.01}, rel=1e-6)
    assert [e["step"] for e in logged] == [1, 2, 3, 4, 5, 5]
    with pytest.raises(psdk.PsdkError, match="closed"):
        writer.scalar("loss", 0.1, 7)
