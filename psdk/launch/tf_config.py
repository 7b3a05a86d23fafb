"""``TF_CONFIG``: the cluster and this task's role, as Kubeflow and Kubernetes jobs set them.

A TFJob (and TensorFlow's own tooling) gives every pod the whole cluster and
its own place in it as JSON::

    {"cluster": {"chief": ["job-chief-0:2222"],
                 "worker": ["job-worker-0:2222", "job-worker-1:2222"],
                 "ps": ["job-ps-0:2222"]},
     "task": {"type": "worker", "index": 0}}

psdk has no separate chief job: the chief is worker 0 and trains like the
others, as in TensorFlow 1.x. So ``chief`` becomes worker 0 and ``worker i``
becomes worker ``i + 1``; without a ``chief`` entry ``worker 0`` is the chief
(a TFJob with only Worker replicas). ``master`` is the old name of ``chief``.
``evaluator`` is refused: psdk has no evaluator task. This module is pure:
it turns the JSON into a :class:`TfConfigTask` and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psdk.errors import ConfigError
from psdk.protocol.cluster import parse_hosts

ENV = "TF_CONFIG"
CHIEF_TYPES = ("chief", "master")
TASK_TYPES = ("chief", "master", "worker", "ps", "evaluator")
EVALUATOR_ADVICE = (
    "psdk has no evaluator task: the chief (worker 0) evaluates the final parameters itself, and "
    "`python -m psdk evaluate weights=<params.npz or checkpoint>` evaluates any saved ones. "
    "Remove the Evaluator replicas from the job (or run `psdk evaluate` in them instead)"
)


@dataclass(frozen=True)
class TfConfigTask:
    """This task in psdk's terms: its job name and index, and the cluster."""

    job_name: str
    task_index: int
    ps_hosts: tuple[str, ...]
    worker_hosts: tuple[str, ...]
    tf_type: str
    tf_index: int

    @property
    def origin(self) -> str:
        """Where this role came from, for messages: ``TF_CONFIG task chief 0``."""
        return f"TF_CONFIG task {self.tf_type} {self.tf_index}"

    def values(self) -> dict[str, Any]:
        """The per-task config keys this sets."""
        return {
            "job_name": self.job_name,
            "task_index": self.task_index,
            "ps_hosts": self.ps_hosts,
            "worker_hosts": self.worker_hosts,
        }


def _key(path: str) -> str:
    return f"{ENV} {path}"


def _hosts(cluster: Mapping[str, Any], name: str) -> list[str]:
    value = cluster.get(name, [])
    if isinstance(value, str) or not isinstance(value, list):
        raise ConfigError(_key(f"cluster.{name}"), f"must be a list of host:port, got {value!r}")
    return list(parse_hosts(value, _key(f"cluster.{name}")))


def _index(task: Mapping[str, Any]) -> int:
    index = task.get("index", 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(_key("task.index"), f"must be a non-negative integer, got {index!r}")
    return index


def parse_tf_config(text: str) -> TfConfigTask:
    """This task's role and the cluster, from the text of ``TF_CONFIG``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(ENV, f"is not valid JSON ({exc}); unset it to give the cluster by flags") from None
    if not isinstance(data, dict):
        raise ConfigError(ENV, "must be a JSON object with 'cluster' and 'task'")
    cluster, task = data.get("cluster"), data.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ConfigError(_key("cluster"), "is missing or empty; it lists the ps, chief and worker hosts")
    if not isinstance(task, dict) or "type" not in task:
        raise ConfigError(_key("task"), 'is missing; it says which task this is, e.g. {"type": "worker", "index": 0}')
    unknown = set(cluster) - set(TASK_TYPES)
    if unknown:
        raise ConfigError(_key("cluster"), f"has unknown task type(s) {sorted(unknown)}", TASK_TYPES)

    tf_type, tf_index = str(task["type"]), _index(task)
    if tf_type == "evaluator":
        raise ConfigError(_key("task.type"), f"is 'evaluator'. {EVALUATOR_ADVICE}")
    if tf_type not in TASK_TYPES:
        raise ConfigError(_key("task.type"), f"is {tf_type!r}", [t for t in TASK_TYPES if t != "evaluator"])

    chiefs = [h for name in CHIEF_TYPES for h in _hosts(cluster, name)]
    if len(chiefs) > 1:
        raise ConfigError(_key("cluster.chief"), f"lists {len(chiefs)} hosts; a job has one chief")
    workers = _hosts(cluster, "worker")
    ps = _hosts(cluster, "ps")
    if not ps:
        raise ConfigError(
            _key("cluster.ps"),
            "is missing or empty: a psdk job needs at least one ps task (add PS replicas to the job)",
        )
    worker_hosts = tuple(chiefs + workers)
    if not worker_hosts:
        raise ConfigError(_key("cluster"), "has no chief and no worker: a psdk job needs at least one worker")

    if tf_type in CHIEF_TYPES:
        job, index, count = "worker", tf_index, len(chiefs)
    elif tf_type == "worker":
        job, index, count = "worker", tf_index + len(chiefs), len(workers)
    else:
        job, index, count = "ps", tf_index, len(ps)
    if tf_index >= count:
        raise ConfigError(
            _key("task.index"),
            f"is {tf_index} but cluster.{tf_type} lists {count} host(s)"
            + (f" (valid: 0..{count - 1})" if count else ""),
        )
    return TfConfigTask(job, index, tuple(ps), worker_hosts, tf_type, tf_index)


def from_environ(environ: Mapping[str, str]) -> TfConfigTask | None:
    """The task ``TF_CONFIG`` describes, or ``None`` when it is unset or empty."""
    text = environ.get(ENV, "").strip()
    return parse_tf_config(text) if text else None
