"""TF_CONFIG, as Kubeflow and Kubernetes jobs set it: parsed, merged with flags, and one real job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from psdk.errors import ConfigError
from psdk.launch.cli import apply_tf_config, main
from psdk.launch.tf_config import from_environ, parse_tf_config
from psdk.transport import security

from .conftest import REPO, free_port
from .jobs import FAST_FLAGS, env

CLUSTER = {
    "chief": ["job-chief-0.ns.svc:2222"],
    "worker": ["job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"],
    "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"],
}
WORKERS = ("job-chief-0.ns.svc:2222", "job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222")


def tf_config(task_type: str, index: Any = 0, cluster: dict[str, Any] | None = None) -> str:
    return json.dumps({"cluster": CLUSTER if cluster is None else cluster, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize(
    "task_type, index, job, task_index",
    [("chief", 0, "worker", 0), ("worker", 0, "worker", 1), ("worker", 1, "worker", 2), ("ps", 1, "ps", 1)],
)
def test_chief_is_worker_0_and_worker_i_is_worker_i_plus_1(
    task_type: str, index: int, job: str, task_index: int
) -> None:
    task = parse_tf_config(tf_config(task_type, index))
    assert (task.job_name, task.task_index) == (job, task_index)
    assert task.worker_hosts == WORKERS
    assert task.ps_hosts == ("job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222")
    assert task.origin == f"TF_CONFIG task {task_type} {index}"


def test_without_a_chief_worker_0_is_the_chief_and_master_is_the_old_chief() -> None:
    only_workers = {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    task = parse_tf_config(tf_config("worker", 1, only_workers))
    assert (task.job_name, task.task_index, task.worker_hosts) == ("worker", 1, ("w0:1", "w1:1"))
    master = parse_tf_config(tf_config("master", 0, {"master": ["m:1"], "worker": ["w:1"], "ps": ["p:1"]}))
    assert (master.job_name, master.task_index, master.worker_hosts) == ("worker", 0, ("m:1", "w:1"))


def test_a_string_index_and_extra_keys_are_accepted() -> None:
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": "1"}, "environment": "cloud"})
    assert parse_tf_config(text).task_index == 2


def test_the_evaluator_is_refused_saying_what_to_do_instead() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tf_config(tf_config("evaluator", 0, {**CLUSTER, "evaluator": ["e:1"]}))
    text = str(info.value)
    assert "TF_CONFIG task.type" in text and "no evaluator task" in text and "psdk evaluate" in text


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("{not json", ["TF_CONFIG", "not valid JSON"]),
        ("[1]", ["TF_CONFIG", "JSON object"]),
        (json.dumps({"task": {"type": "ps"}}), ["TF_CONFIG cluster", "missing"]),
        (json.dumps({"cluster": CLUSTER}), ["TF_CONFIG task", '"type"']),
        (tf_config("trainer"), ["TF_CONFIG task.type", "'trainer'", "chief", "ps", "worker"]),
        (tf_config("worker", 2), ["TF_CONFIG task.index", "is 2", "valid: 0..1"]),
        (tf_config("chief", 1), ["TF_CONFIG task.index", "is 1"]),
        (tf_config("ps", -1), ["TF_CONFIG task.index", "non-negative"]),
        (tf_config("ps", 0, {"worker": ["w:1"]}), ["TF_CONFIG cluster.ps", "at least one ps"]),
        (tf_config("ps", 0, {"ps": ["p:1"]}), ["TF_CONFIG cluster", "no chief and no worker"]),
        (tf_config("ps", 0, {**CLUSTER, "chief": ["a:1", "b:1"]}), ["TF_CONFIG cluster.chief", "one chief"]),
        (tf_config("ps", 0, {**CLUSTER, "trainer": ["t:1"]}), ["TF_CONFIG cluster", "trainer", "valid choices"]),
        (tf_config("ps", 0, {**CLUSTER, "ps": "p:1"}), ["TF_CONFIG cluster.ps", "list"]),
        (tf_config("ps", 0, {**CLUSTER, "ps": ["p"]}), ["TF_CONFIG cluster.ps", "no port"]),
    ],
)
def test_bad_tf_config_names_the_key(text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tf_config(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_unset_or_empty_tf_config_means_none() -> None:
    assert from_environ({}) is None and from_environ({"TF_CONFIG": "  "}) is None
    assert from_environ({"TF_CONFIG": tf_config("ps")}) is not None


def test_tf_config_fills_in_the_role_and_agreeing_flags_are_fine() -> None:
    task = parse_tf_config(tf_config("worker", 0))
    args = apply_tf_config(task, "task", ["backend=numpy"])
    assert args == [
        "job_name=worker",
        "task_index=1",
        "ps_hosts='job-ps-0.ns.svc:2222,job-ps-1.ns.svc:2222'",
        f"worker_hosts='{','.join(WORKERS)}'",
        "backend=numpy",
    ]
    agreeing = ["task_index=1", "ps_hosts=[job-ps-0.ns.svc:2222,job-ps-1.ns.svc:2222]", "job_name=worker"]
    assert apply_tf_config(task, "worker", agreeing)[-3:] == agreeing


@pytest.mark.parametrize(
    "command, args, fragments",
    [
        ("task", ["task_index=0"], ["task_index", "is 0 on the command line", "TF_CONFIG task worker 0 says 1"]),
        ("task", ["job_name=ps"], ["job_name", "says worker"]),
        ("task", ["ps_hosts='a:1'"], ["ps_hosts", "is 'a:1'", "job-ps-0.ns.svc:2222"]),
        ("task", ["worker_hosts=[x,y,z]"], ["worker_hosts", "unset TF_CONFIG"]),
        ("ps", [], ["job_name", "`python -m psdk ps`", "makes this worker 1", "python -m psdk task"]),
    ],
)
def test_flags_that_disagree_with_tf_config_are_an_error(command: str, args: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        apply_tf_config(parse_tf_config(tf_config("worker", 0)), command, args)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_cli_refuses_run_and_an_evaluator_under_tf_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TF_CONFIG", tf_config("chief"))
    assert main(["run", "backend=numpy"]) == 2
    err = capsys.readouterr().err
    assert "TF_CONFIG" in err and "python -m psdk task" in err
    monkeypatch.setenv("TF_CONFIG", tf_config("evaluator"))
    assert main(["task"]) == 2
    assert "no evaluator task" in capsys.readouterr().err


@pytest.mark.slow
def test_a_job_run_only_by_tf_config_env_vars(tmp_path: Path) -> None:
    """chief, worker 0 and ps 0 as three processes that get nothing but TF_CONFIG: the job completes."""
    port = free_port()
    cluster = {"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"], "ps": [f"127.0.0.1:{port}"]}
    keys = security.generate(tmp_path / "keys", 2)  # a Kubernetes Secret mounted in every pod, say
    flags = ["backend=numpy", "train.steps=200", f"transport.keys_dir={keys}", *FAST_FLAGS]
    procs = {}
    for task_type in ("ps", "worker", "chief"):
        task_env = dict(env(), TF_CONFIG=tf_config(task_type, 0, cluster), OMP_NUM_THREADS="1")
        procs[task_type] = subprocess.Popen(
            [sys.executable, "-m", "psdk", "task", *flags, f"hydra.run.dir={tmp_path / task_type}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=task_env,
            cwd=REPO,
        )
    try:
        outputs = {name: p.communicate(timeout=90)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    assert {name: p.returncode for name, p in procs.items()} == {"ps": 0, "worker": 0, "chief": 0}, outputs
    summary = json.loads((tmp_path / "chief" / "summary.json").read_text())
    assert summary["global_step"] == 200 and summary["num_workers"] == 2
    assert summary["workers"]["1"]["status"] == "finished"
    assert "worker 0: role and cluster from TF_CONFIG task chief 0" in outputs["chief"]
    assert "worker 1: role and cluster from TF_CONFIG task worker 0" in outputs["worker"]
    assert "shut down by the chief" in outputs["ps"]
