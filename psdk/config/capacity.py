"""Settings checked against the job they run: its model, its workers, its data set and this host.

Each key's own range is in :mod:`psdk.config.ranges`; a value inside it can
still not fit the job, and a model not fit the workload's data (the
workload's ``check`` entry says, :func:`check_data_fits`). A message limit
below the chief's first message left the job waiting for an init the ps
had dropped; a model that does not fit in memory, or an address the host
does not have, failed only once the tasks had started. The launcher checks all of this before it starts a
task (:func:`check_job`, and :func:`check_host` for the tasks it starts on
this host), and a ps or worker started by hand checks its own share
(:func:`check_task`); each refusal names the key and what it must be.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.config import build
from psdk.config.options import TaskOptions, options_from
from psdk.config.ranges import MESSAGE_MAX, check_ranges
from psdk.errors import ConfigError
from psdk.launch import LAUNCHED_ENV
from psdk.plugins.loading import run_entry
from psdk.protocol.cluster import parse_hosts
from psdk.protocol.sharding import largest_message_bytes, shard_sizes

FLOAT_BYTES = 4
WORKER_COPIES = 2
"""A worker holds at least the model's weights and one gradient (its framework keeps more)."""


def _model_key(cfg: DictConfig) -> str:
    """The key that makes a model big: its hidden layers where it has them."""
    return "model.hidden" if cfg.model.get("hidden") else "model"


def _slots(rule: Any) -> int:
    return len(rule.slot_names())


def _shard_sizes(cfg: DictConfig, variables: list[tuple[str, tuple[int, ...]]], num_ps: int) -> list[int]:
    """The floats each ps holds: as ``topology.sharding`` places the variables, the partitioned ones in parts."""
    plan = build.topology(cfg).partitioning().plan(variables, num_ps)
    return shard_sizes(variables, num_ps, str(cfg.topology.sharding), plan)


def check_message_limit(cfg: DictConfig, options: TaskOptions, num_ps: int, shards: range | None = None) -> None:
    """``transport.max_message_bytes`` lets the largest message of this job through (the ps's own formula).

    ``shards``: the ps tasks to check (all of the job's unless given: a ps
    started by hand checks its own).
    """
    spec, rule = build.model_spec(cfg), build.update_rule(cfg)
    sizes = _shard_sizes(cfg, spec.variables(), num_ps)
    chosen = [(i, sizes[i]) for i in (shards if shards is not None else range(num_ps)) if i < len(sizes)]
    if not chosen:
        return
    index, size = max(chosen, key=lambda item: item[1])
    need = largest_message_bytes(size, _slots(rule))
    limit = options.transport.max_message_bytes
    if limit >= need:
        return
    where = f"ps {index}'s" if num_ps > 1 else "the ps's"
    raise ConfigError(
        "transport.max_message_bytes",
        f"is {limit:,} but this job's largest message is {need:,} bytes (the chief's restore of {where} "
        f"{size:,} parameters of model {spec.name} and their {_slots(rule)} {rule.name} slot(s), 4 bytes each, "
        f"and a header), which the ps would drop; must be in [{need}, {MESSAGE_MAX}]: use "
        f"transport.max_message_bytes={need} or more, or spread the model over more ps tasks (topology.num_ps)",
    )


def available_memory() -> int | None:
    """Bytes this host can give new processes without swapping (``MemAvailable``); None where unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(cfg: DictConfig, num_ps_here: list[int], workers_here: int, num_ps: int) -> None:
    """The model fits this host's memory with the tasks that run here: refused when even a lower bound does not.

    ``num_ps_here``: the ps tasks (indices) on this host; ``workers_here``:
    its workers. Counted: each ps's shard with its rule's slots and
    scratch buffers, each worker's weights and gradient (a framework keeps
    more: the real need is higher, so nothing that fits is refused).
    """
    available = available_memory()
    if available is None:
        return
    spec, rule = build.model_spec(cfg), build.update_rule(cfg)
    sizes = _shard_sizes(cfg, spec.variables(), num_ps)
    total = sum(sizes)
    per_ps = 1 + _slots(rule) + rule.scratch_count()
    here = sum(sizes[i] for i in num_ps_here if 0 <= i < len(sizes))
    need = FLOAT_BYTES * (per_ps * here + WORKER_COPIES * total * workers_here)
    if need <= available:
        return
    per_parameter = FLOAT_BYTES * (per_ps * len(num_ps_here) / max(1, num_ps) + WORKER_COPIES * workers_here)
    most = int(available / per_parameter) if per_parameter else total
    tasks = []
    if num_ps_here:
        tasks.append(f"{len(num_ps_here)} ps task(s) with {rule.name}'s {_slots(rule)} slot(s) and scratch")
    if workers_here:
        tasks.append(f"{workers_here} worker(s)' weights and gradient")
    raise ConfigError(
        _model_key(cfg),
        f"makes model {spec.name} {total:,} parameters ({_gb(FLOAT_BYTES * total)} in float32); the tasks on this "
        f"host ({', '.join(tasks)}) need at least {_gb(need)} but {_gb(available)} are available; must be a model "
        f"of at most {most:,} parameters here: make it smaller, or run fewer tasks on this host",
    )


def check_data_fits(cfg: DictConfig) -> None:
    """The model against the data, by the workload's ``check`` entry: whatever fitting means to it.

    A model's input and output against the data set's shape, a batch
    against a worker's shard of it, known before any worker reads the data;
    a workload without a ``check`` entry has nothing checked here.
    """
    run_entry(cfg, "check")


def check_job(cfg: DictConfig, options: TaskOptions, num_ps: int, num_workers: int) -> None:
    """What the launcher checks against the whole job before it starts a task."""
    check_data_fits(cfg)
    options.ps_max_connections(num_workers)
    check_message_limit(cfg, options, num_ps)


def check_host(cfg: DictConfig, num_ps: int, num_workers: int) -> None:
    """What the local launcher checks against this host, where it starts every task: the address, the memory."""
    check_bindable(str(cfg.topology.host), "topology.host")
    check_memory(cfg, list(range(num_ps)), num_workers, num_ps)


def check_task(cfg: DictConfig, options: TaskOptions) -> None:
    """A ps or worker started by hand (``python -m psdk ps|worker|task``): its own share of the job.

    A cluster the task cannot place itself in (no ``ps_hosts``, a
    ``task_index`` beyond its list) is left to the task's own start, which
    says how to fix it.
    """
    ps_hosts = parse_hosts(build.plain(cfg.ps_hosts), "ps_hosts") if cfg.ps_hosts else []
    workers = parse_hosts(build.plain(cfg.worker_hosts), "worker_hosts", require_port=False) if cfg.worker_hosts else []
    task = int(cfg.task_index)
    if cfg.job_name == "ps" and 0 <= task < len(ps_hosts):
        options.ps_max_connections(max(1, len(workers)))
        check_message_limit(cfg, options, len(ps_hosts), range(task, task + 1))
        check_memory(cfg, [task], 0, len(ps_hosts))
    elif cfg.job_name == "worker" and ps_hosts and 0 <= task < len(workers):
        check_data_fits(cfg)
        check_memory(cfg, [], 1, len(ps_hosts))


def check_settings(cfg: DictConfig) -> None:
    """What every psdk process checks in its config before it starts anything (``python -m psdk <command>``).

    Every numeric key's range; and for a ps or worker started by hand, its
    share of the job (one a launcher started was checked by the launcher,
    with the whole job, in :meth:`~psdk.launch.local.LocalLauncher.validate`).
    """
    check_ranges(cfg)
    if cfg.job_name in ("ps", "worker") and not os.environ.get(LAUNCHED_ENV):
        check_task(cfg, options_from(cfg))


def check_bindable(host: str, key: str) -> None:
    """``host`` is an address of this host (a ps can bind it), or ``key`` is refused before any task starts."""
    fix = (
        "must be an address of this host: 127.0.0.1 (this host only), the address of one of its interfaces, "
        "or 0.0.0.0 (every interface)"
    )
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(key, f"{host!r} cannot be resolved ({exc}); {fix}") from None
    reason = ""
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
                return
            except OSError as exc:
                reason = exc.strerror or str(exc)
    raise ConfigError(key, f"{host} is not an address of this host ({reason}), so no ps can bind it; {fix}")
