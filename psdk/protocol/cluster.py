"""The cluster as TensorFlow 1.x users describe it: ps and worker host lists.

``ClusterSpec({"ps": ["h1:2222"], "worker": ["h2:2223", "h3:2224"]})`` works
as ``tf.train.ClusterSpec`` did. Host lists may also be given as one
comma-separated string or a single host, the forms ``--ps_hosts`` took.
Workers bind nothing in psdk (they only connect to the ps tasks), so a worker
entry may omit the port; the list still fixes the number of workers and which
share a host, which decides their GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psdk.errors import ConfigError
from psdk.protocol.partitions import Partitioning

_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)$")
JOBS = ("ps", "worker")


def task_out_of_range(task_index: int, count: int, hosts_key: str) -> str:
    """What is wrong with a task_index beyond the host list, and the two ways to fix it."""
    valid = f"0..{count - 1}" if count > 1 else "0"
    return (
        f"is {task_index} but {hosts_key} lists {count} task(s) (valid: {valid}); use task_index={valid}, "
        f"or add this task's host:port to {hosts_key}"
    )


def _split_host(entry: str, key: str, require_port: bool) -> tuple[str, int | None]:
    if "://" in entry:
        scheme = entry.split("://", 1)[0]
        if scheme not in ("tcp", "inproc", "ipc"):
            raise ConfigError(key, f"{entry!r} uses an unknown scheme {scheme!r}", ["tcp", "inproc", "ipc"])
        if scheme != "tcp":
            return entry, None
        entry = entry.split("://", 1)[1]
    host, sep, port_text = entry.rpartition(":")
    if not sep or host.endswith(":"):
        host, port_text = entry, ""
    if not _HOST.match(host or "-invalid-"):
        if len(entry.split()) > 1:
            raise ConfigError(key, f"{entry!r} is not host:port; separate hosts with commas: {key}='a:2222,b:2222'")
        raise ConfigError(key, f"{entry!r} is not host:port (e.g. 127.0.0.1:2222)")
    if not port_text:
        if require_port:
            raise ConfigError(key, f"{entry!r} has no port; write host:port, e.g. {entry}:2222")
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(key, f"{entry!r} has a bad port {port_text!r} (0..65535)")
    return host, int(port_text)


def split_host(entry: str, key: str) -> tuple[str, int | None]:
    """``host:port`` as (host, port); port ``None`` when absent (or for ``inproc://``/``ipc://``)."""
    return _split_host(entry.strip(), key, require_port=False)


def parse_hosts(value: Any, key: str, require_port: bool = True) -> tuple[str, ...]:
    """A host list from a list, a comma-separated string or one host."""
    if value is None:
        return ()
    if isinstance(value, str):
        items: Sequence[Any] = value.split(",")
    elif isinstance(value, Sequence) or hasattr(value, "__iter__"):
        items = list(value)
    else:
        raise ConfigError(key, f"expected a list of host:port, got {value!r}")
    hosts = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(key, f"has an empty or non-string entry in {value!r}")
        entry = item.strip()
        host, port = _split_host(entry, key, require_port)
        if "://" in entry and not entry.startswith("tcp://"):
            hosts.append(entry)
        else:
            hosts.append(host if port is None else f"{host}:{port}")
    return tuple(hosts)


@dataclass(frozen=True)
class Topology:
    """How many tasks the local launcher starts, and how variables are sharded."""

    num_ps: int = 1
    num_workers: int = 2
    host: str = "127.0.0.1"
    sharding: str = "round_robin"
    worker_backends: Sequence[str] | None = None
    partition_min_bytes: int | None = None
    """Split each variable of at least this many bytes across the ps tasks (null or 0: none is split)."""
    partitions: int | None = None
    """Into how many parts (null: one per ps task), capped by the variable's rows."""

    def __post_init__(self) -> None:
        if self.worker_backends is not None:
            names = tuple(str(b) for b in self.worker_backends)
            if not names:
                raise ConfigError("topology.worker_backends", "is empty; give at least one backend or null")
            object.__setattr__(self, "worker_backends", names)
        if self.num_ps < 1:
            raise ConfigError("topology.num_ps", f"must be at least 1, got {self.num_ps}")
        if self.num_workers < 1:
            raise ConfigError("topology.num_workers", f"must be at least 1, got {self.num_workers}")
        self.partitioning()  # refuses a bad partition_min_bytes or partitions, naming the key

    def partitioning(self) -> Partitioning:
        """Which variables the chief splits across the ps tasks (TensorFlow 1.x's partitioners)."""
        return Partitioning(self.partition_min_bytes, self.partitions)

    def backend_of(self, worker: int, default: str) -> str:
        """The backend worker ``worker`` trains with (``worker_backends`` cycles)."""
        if not self.worker_backends:
            return default
        return self.worker_backends[worker % len(self.worker_backends)]


class ClusterSpec:
    """The ps and worker tasks of one job."""

    def __init__(self, cluster: Mapping[str, Any]):
        unknown = set(cluster) - set(JOBS)
        if unknown:
            raise ConfigError("cluster", f"unknown job name(s) {sorted(unknown)}", JOBS)
        self.ps = parse_hosts(cluster.get("ps"), "ps_hosts", require_port=True)
        self.worker = parse_hosts(cluster.get("worker"), "worker_hosts", require_port=False)
        if not self.ps:
            raise ConfigError("ps_hosts", "the cluster needs at least one ps task")
        if not self.worker:
            raise ConfigError("worker_hosts", "the cluster needs at least one worker task")

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def num_workers(self) -> int:
        return len(self.worker)

    def ps_address(self, index: int) -> str:
        return self.ps[index]

    def worker_host(self, index: int) -> str:
        return _split_host(self.worker[index], "worker_hosts", require_port=False)[0]

    def local_rank(self, index: int) -> int:
        """This worker's rank among the workers that share its host."""
        host = self.worker_host(index)
        return sum(1 for i in range(index) if self.worker_host(i) == host)

    def check_task(self, job_name: str, task_index: int) -> None:
        if job_name not in JOBS:
            raise ConfigError("job_name", f"got {job_name!r}", JOBS)
        count = self.num_ps if job_name == "ps" else self.num_workers
        if not 0 <= task_index < count:
            raise ConfigError("task_index", task_out_of_range(task_index, count, f"{job_name}_hosts"))

    def as_dict(self) -> dict[str, list[str]]:
        return {"ps": list(self.ps), "worker": list(self.worker)}

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash((self.ps, self.worker))
