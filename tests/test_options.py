"""The typed options: every key of the plain groups reaches them, and the task that owns it behaves by it.

The behaviour tests run the real tasks (``run_worker``, ``run_ps``) in this
process against a real ps over TCP, and observe what changed: the ps's reply
counters, the worker's shard flags, its sockets, files, thread settings.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq
from hydra import compose
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

import psdk.jobs.worker as mnist_job
import psdk.ps.main as ps_main
from psdk.api import WorkerSession
from psdk.client import ClientOptions, ParameterClient, checkpoint
from psdk.config import build, schema
from psdk.config.options import GROUPS, TaskOptions, TransportOptions, options_from
from psdk.errors import ConfigError, PeerTimeoutError, PsdkError
from psdk.jobs.setup import worker_setup
from psdk.jobs.worker import run_worker
from psdk.plugins.models import init_weights
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.main import run_ps
from psdk.ps.rules import SGD, Adam, NoOp
from psdk.ps.server import ServerOptions
from psdk.transport.lending import ATTACHED, REFUSED
from psdk.transport.zeromq import ZmqOptions, ZmqServer, ZmqTransport

from .conftest import MNIST_DIR, PsCluster, running_ps
from .helpers import FAST

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("hydra_context")]

BASE = ["output_dir=/tmp/psdk-options-test"]


# ------------------------------------------------------------------ every key reaches its options
def changed(value: Any, name: str) -> Any:
    """A valid value other than ``value`` for key ``name`` (None-able keys get one of their type)."""
    special = {"device": "cpu", "dir": "/tmp/elsewhere", "gpu_memory_fraction": 0.5, "compute_nice": 3, "epochs": 2.5}
    if name in special:
        return special[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value * 2 + 1
    if name in ("io_threads", "max_connections"):
        return 7
    if name.endswith("_s"):
        return 42.0
    return f"/tmp/{name}"  # bind, announce_file, progress_file, keys_dir


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_key_of_a_typed_group_reaches_its_options(group: str) -> None:
    cfg = compose("config", overrides=BASE)
    keys = list(cfg[group])
    assert keys == [f.name for f in dataclasses.fields(GROUPS[group])]  # type: ignore[arg-type]  # no key without a field
    defaults = getattr(options_from(cfg), group)
    for key in keys:
        value = changed(cfg[group][key], key)
        text = str(value).lower() if isinstance(value, bool) else value
        options = getattr(options_from(compose("config", overrides=[*BASE, f"{group}.{key}={text}"])), group)
        assert getattr(options, key) == value != getattr(defaults, key), f"{group}.{key} was lost"


@pytest.mark.parametrize(
    "override",
    [
        "transport.io_threads=0",
        "transport.heartbeat_timeout_s=0.5",  # shorter than the heartbeat interval
        "transport.max_message_bytes=0",
        "ps.io_threads=0",  # the old ps took 0 for "auto", silently
        "ps.log_every_s=0",
        "train.threads=0",
        "train.log_every=-1",
        "checkpoint.keep=-1",
        "recovery.timeout_s=0",
        "recovery.max_restarts=-1",
        "placement.device=tpu",
        "placement.gpu_memory_fraction=1.5",
        "placement.compute_nice=-5",  # the old worker ignored it: a thread may only lower its priority
    ],
)
def test_a_bad_value_is_refused_naming_its_key(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as caught:
        options_from(compose("config", overrides=[*BASE, override]))
    assert caught.value.key == key


def test_a_value_of_the_wrong_type_fails_at_composition() -> None:
    for override in ("ps.io_threads=many", "transport.shared_memory=maybe", "sync.replicas_to_aggregate=all"):
        with pytest.raises(ConfigCompositionException):
            compose("config", overrides=[override])


WORKER = ["job_name=worker", "ps_hosts=127.0.0.1:2222", "worker_hosts='127.0.0.1,127.0.0.1'", "backend=numpy"]


def test_where_keys_overlap_one_wins() -> None:
    cfg = compose("config", overrides=[*BASE, *WORKER, "transport.io_threads=5", "recovery.enabled=false"])
    options = options_from(cfg)
    client = worker_setup(cfg).client
    assert client.transport.io_threads == 5  # the workers' I/O threads
    assert ps_main.ps_transport(options, 2, None).transport.io_threads == min(2, os.cpu_count() or 1)  # one per worker
    ps_set = options_from(compose("config", overrides=[*BASE, "transport.io_threads=5", "ps.io_threads=3"]))
    assert ps_main.ps_transport(ps_set, 2, None).transport.io_threads == 3
    assert client.recovery_timeout_s is None and options.recovery.restarts == 0  # enabled=false wins
    lease = ps_main.server_options(options, None).pause_lease_s
    assert lease == 3 * options.transport.heartbeat_interval_s  # a null lease


def test_each_transport_setting_is_declared_once_and_held_as_it_is() -> None:
    """The client, the ZeroMQ transport and the server hold the ``transport.*`` group; none declares one of its keys."""
    keys = {f.name for f in dataclasses.fields(TransportOptions)}
    for holder in (ClientOptions, ZmqOptions, ServerOptions):
        fields = {f.name: f for f in dataclasses.fields(holder)}
        assert not keys & set(fields), f"{holder.__name__} declares {sorted(keys & set(fields))} again"
        assert fields["transport"].type in (TransportOptions, "TransportOptions")
    heartbeats = ["transport.heartbeat_interval_s=0.3", "transport.heartbeat_timeout_s=7", "transport.io_threads=2"]
    cfg = compose("config", overrides=[*BASE, *WORKER, *heartbeats])
    setup = worker_setup(cfg)
    assert setup.client.transport is setup.options.transport  # the worker's: the group itself, not a copy
    assert ps_main.server_options(setup.options, None).transport is setup.options.transport
    ps_side = ps_main.ps_transport(setup.options, 2, None).transport
    assert (ps_side.heartbeat_interval_s, ps_side.heartbeat_timeout_s) == (0.3, 7.0)


def test_a_worker_builds_its_typed_setup_once() -> None:
    """Cluster, sync spec, rule, model, backend options and run id, built from the config when the task starts."""
    overrides = ["sync=ssp", "optimizer=adam", "optimizer.lr=0.002", "model=softmax", "run_id=r1", "seed=4"]
    setup = worker_setup(compose("config", overrides=[*BASE, *WORKER, "task_index=1", *overrides]))
    assert (setup.task, setup.is_chief, setup.cluster.num_workers, setup.cluster.num_ps) == (1, False, 2, 1)
    assert isinstance(setup.sync, SyncSpec) and setup.sync.mode == "ssp"
    assert isinstance(setup.rule, Adam) and setup.rule.lr == pytest.approx(0.002, abs=1e-12)
    assert (setup.model.name, setup.backend, setup.run_id, setup.seed) == ("softmax", "numpy", "r1", 4)
    assert setup.resume is None and setup.ps_hosts_from is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.seed = 5  # type: ignore[misc]


# ------------------------------------------------------------------ the schemas are the dataclasses
def test_the_optimizer_and_sync_schemas_are_the_fields_of_their_dataclasses() -> None:
    assert NoOp not in schema.rules().values()  # the ps's own: never optimizer=
    for rule in schema.rules().values():
        base = schema.group_schemas()["optimizer"][f"base_{rule.name}"]
        fields = {f.name: f.default for f in dataclasses.fields(base)}
        assert fields.pop("_target_") == f"{rule.__module__}:{rule.__qualname__}"
        assert fields == {f.name: f.default for f in dataclasses.fields(rule)}
    sync = {f.name: f.default for f in dataclasses.fields(schema.SyncConfig)}
    assert sync.pop("_target_") == "psdk.ps.consistency:SyncSpec"
    assert sync == {f.name: f.default for f in dataclasses.fields(SyncSpec)}


def test_a_field_added_to_a_rule_is_a_key_without_editing_the_schemas() -> None:
    @dataclasses.dataclass(frozen=True)
    class Lookahead(SGD):
        horizon: int = 5
        """A field schema.py has never heard of."""

    derived = schema.schema_of(Lookahead, "LookaheadConfig", target=True)
    node = {f.name: f.default for f in dataclasses.fields(derived)}
    assert node["horizon"] == 5 and node["momentum"] == 0.0
    assert node["_target_"] == f"{__name__}:{Lookahead.__qualname__}"
    assert not hasattr(schema, "LookaheadConfig")  # making a schema writes no module's globals


# ------------------------------------------------------------------ the tasks behave by their keys
def task_config(tmp_path: Path, ps: PsCluster, *overrides: str, task: int = 0, workers: int = 1) -> DictConfig:
    """A worker task's config for the ps ``ps``: numpy backend, softmax, one quick job, no curve."""
    hosts = ",".join(["127.0.0.1"] * workers)
    return compose(
        "config",
        overrides=[
            "job_name=worker",
            f"task_index={task}",
            f"ps_hosts={ps.addresses[0]}",
            f"worker_hosts='{hosts}'",
            "backend=numpy",
            "model=softmax",
            "optimizer=sgd",
            "transport.secure=false",
            "transport.heartbeat_interval_s=0.2",
            "transport.heartbeat_timeout_s=5",
            f"output_dir={tmp_path}",
            f"data.dir={MNIST_DIR}",
            "train.steps=6",
            "train.log_every=0",
            "train.validate_every=0",
            "train.final_wait_s=10",
            "checkpoint.every_seconds=0",
            "checkpoint.final=false",
            *overrides,
        ],
    )


class Observed:
    """What a worker's session looked like: its transport while connected, its shards when it finished."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.io_threads = 0
        self.sharing: list[str] = []
        self.options: ClientOptions | None = None
        real = mnist_job.connect

        def connect(*args: Any, **kwargs: Any) -> WorkerSession:
            session = real(*args, **kwargs)
            assert session._own_transport is not None, "the job lets connect make its transport"
            self.options = session.client.options
            self.io_threads = session._own_transport.context.get(zmq.IO_THREADS)
            finish = session.finish

            def finished(*a: Any, **k: Any) -> dict[str, Any]:
                self.sharing = [session.client.endpoint.sharing(i) for i in range(len(session.client.shards))]
                return finish(*a, **k)

            session.finish = finished
            return session

        monkeypatch.setattr(mnist_job, "connect", connect)


@pytest.mark.parametrize(
    "overrides, sharing, io_threads",
    [
        (["transport.io_threads=2"], "shared memory, doorbell and knocks", 2),
        (["transport.shared_memory=false"], "frames", 1),
        (["transport.doorbells=false"], "shared memory", 1),
    ],
    ids=["io_threads", "no-shared-memory", "no-doorbells"],
)
def test_the_transport_keys_reach_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], sharing: str, io_threads: int
) -> None:
    """``python -m psdk worker transport.shared_memory=false`` (and the others) change the worker, not only the ps."""
    seen = Observed(monkeypatch)
    with running_ps(1, scheme="tcp") as ps:  # a ps that takes shared memory, with doorbells
        run_worker(task_config(tmp_path, ps, *overrides))
        endpoint = ps.servers[0].endpoint
        assert isinstance(endpoint, ZmqServer)
        answers = endpoint.links.answers
    assert (seen.sharing, seen.io_threads) == ([sharing], io_threads)
    # The ps's transport saw it too: a worker without shared memory never offers it (nothing to turn down).
    assert (answers[ATTACHED], answers[REFUSED]) == (int(sharing != "frames"), 0), answers


def test_the_train_keys_reach_the_job_on_the_ps(tmp_path: Path) -> None:
    with running_ps(1, scheme="tcp") as ps:
        run_worker(task_config(tmp_path, ps, "train.steps=9", "train.log_every=3"))
        server = ps.servers[0]
        assert server.job is not None and server.job.steps == 9 and server.store.version == 9
    assert [r.get("global_step") for r in read_metrics(tmp_path)] == [3, 6, 9]


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_checkpoint_keys_reach_the_chief(tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    with running_ps(1, scheme="tcp") as ps:
        overrides = ["train.steps=13", "checkpoint.every_steps=4", "checkpoint.keep=2", f"checkpoint.dir={folder}"]
        run_worker(task_config(tmp_path, ps, *overrides))
    steps = sorted(checkpoint.load(path).global_step for path in folder.glob("*.npz"))
    assert steps == [8, 12]  # written at 4, 8 and 12; the newest 2 kept; no final one


def chief_paused(ps: PsCluster, cfg: DictConfig) -> ParameterClient:
    """The job's chief, as a bare client: it initialises the softmax job and pauses it, so pushes wait."""
    chief = ParameterClient(ps.transport, ps.cluster(3), 0, FAST)
    spec = build.model_spec(cfg)
    assert chief.initialize(init_weights(spec, 0), JobSpec(SyncSpec().resolved(3), 10**6, 3), SGD(lr=0.1))
    chief.request(chief.to_all("pause_at", version=0), "a pause")
    return chief


def test_the_recovery_keys_reach_a_worker(tmp_path: Path) -> None:
    """A push the ps holds past transport.request_timeout_s: recovery.timeout_s waits it out, enabled=false does not."""
    fast = ["transport.request_timeout_s=0.5", "transport.heartbeat_timeout_s=30"]
    with running_ps(1, scheme="tcp", heartbeat_timeout_s=30.0, pause_lease_s=60.0) as ps:
        cfg = task_config(tmp_path / "on", ps, *fast, "recovery.timeout_s=1", task=1, workers=3)
        chief = chief_paused(ps, cfg)
        try:
            with pytest.raises(PsdkError, match="nothing was rolled back"):  # waited out, then named
                run_worker(cfg)
            off = task_config(tmp_path / "off", ps, *fast, "recovery.enabled=false", task=2, workers=3)
            with pytest.raises(PeerTimeoutError):  # no recovery: the first timeout is the end
                run_worker(off)
        finally:
            chief.close()


def test_the_placement_keys_reach_the_training_thread(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    result: dict[str, Any] = {}

    def worker(cfg: DictConfig) -> None:
        try:
            run_worker(cfg)
            result["cpus"] = os.sched_getaffinity(0)  # this thread, which trained
            result["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except BaseException as exc:
            result["error"] = exc

    with running_ps(1, scheme="tcp") as ps:
        cfg = task_config(tmp_path, ps, "placement.pin_cpus=true", "placement.compute_nice=4", "placement.device=cpu")
        thread = threading.Thread(target=worker, args=(cfg,))
        thread.start()
        thread.join(timeout=50)
    assert "error" not in result, result.get("error")
    assert result["cpus"] == {cpus[0]} and result["nice"] == 4


class SpiedTransport(ZmqTransport):
    """The ps's real transport; records the ZeroMQ I/O threads its context was made with."""

    io_threads: list[int] = []

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        SpiedTransport.io_threads.append(self.context.get(zmq.IO_THREADS))


def test_the_ps_keys_reach_a_ps_and_ps_io_threads_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps_main, "ZmqTransport", SpiedTransport)
    SpiedTransport.io_threads = []
    announced = tmp_path / "ps0.json"
    cfg = compose(
        "config",
        overrides=[
            "job_name=ps",
            "ps_hosts=127.0.0.1:0",
            "worker_hosts=127.0.0.1",
            "transport.secure=false",
            "transport.startup_timeout_s=0.3",  # no chief comes: the ps gives up, and the test goes on
            "transport.io_threads=5",
            "ps.io_threads=3",
            f"ps.announce_file={announced}",
            f"output_dir={tmp_path}",
        ],
    )
    assert run_ps(cfg) != 0  # no chief showed up
    assert SpiedTransport.io_threads == [3]  # ps.io_threads, not transport.io_threads
    assert "127.0.0.1:" in announced.read_text()


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TaskOptions().train.steps = 5  # type: ignore[misc]


def test_a_transport_setting_given_to_client_options_names_where_it_goes() -> None:
    """Scripts wrote ClientOptions(heartbeat_timeout_s=5) when the client copied the transport settings."""
    with pytest.raises(TypeError, match=r"ClientOptions\(transport=psdk\.TransportOptions\(heartbeat_timeout_s=5\)\)"):
        ClientOptions(heartbeat_timeout_s=5, recovery_timeout_s=3)  # type: ignore[call-arg]
    assert ClientOptions(recovery_timeout_s=3).recovery_timeout_s == 3
