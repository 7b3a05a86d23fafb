"""Turning a composed config into the objects the tasks run with.

The typed options of the plain groups (transport, ps, train, ...) come from
:mod:`psdk.config.options`; this module instantiates the groups with a
``_target_`` and checks what spans several groups.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from psdk.config.options import TaskOptions, TransportOptions
from psdk.errors import ConfigError, PsdkError
from psdk.launch import announce
from psdk.plugins.models import ModelSpec
from psdk.plugins.registry import locate, resolve_backend_name
from psdk.protocol.cluster import ClusterSpec, Topology
from psdk.protocol.jobspec import check_run_id
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import UpdateRule
from psdk.transport import security
from psdk.transport.security import CurveKeys

log = logging.getLogger(__name__)


def plain(value: Any) -> Any:
    """A config node as plain Python containers."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def cluster_from(cfg: DictConfig) -> ClusterSpec:
    """The cluster of a per-task run, from ``ps_hosts`` and ``worker_hosts``."""
    if cfg.ps_hosts is None or cfg.worker_hosts is None:
        missing = [k for k in ("ps_hosts", "worker_hosts") if cfg[k] is None]
        raise ConfigError(
            " and ".join(missing),
            "a per-task run needs both ps_hosts and worker_hosts, e.g. "
            "ps_hosts=127.0.0.1:2222 worker_hosts='127.0.0.1:2223,127.0.0.1:2224' "
            "(or use `python -m psdk run` to start the whole job here)",
        )
    return ClusterSpec({"ps": plain(cfg.ps_hosts), "worker": plain(cfg.worker_hosts)})


def with_announced_ps(folder: str | None, cluster: ClusterSpec, transport: TransportOptions) -> ClusterSpec:
    """``cluster`` with the ps addresses the ps tasks announced in ``folder`` (``ps_hosts_from``), once they have.

    ``run`` starts the workers together with the ps tasks, which bind free
    ports: a worker waits for the addresses only once its own start-up is done.
    """
    if not folder:
        return cluster
    addresses = announce.wait_for(Path(str(folder)), cluster.num_ps, transport.startup_timeout_s)
    return ClusterSpec({"ps": addresses, "worker": cluster.as_dict()["worker"]})


def worker_keys(transport: TransportOptions, cluster: ClusterSpec, task: int) -> CurveKeys | None:
    """Worker ``task``'s CURVE keys and every ps task's public key (``None`` only with transport.secure=false)."""
    if not security.require_keys(transport.secure, transport.keys_dir):
        return None
    return security.load_worker(Path(str(transport.keys_dir)), task, cluster.num_ps)


def server_keys(transport: TransportOptions, task: int) -> CurveKeys | None:
    """Ps task ``task``'s CURVE keys and the workers it accepts (``None`` only with transport.secure=false)."""
    if not security.require_keys(transport.secure, transport.keys_dir):
        return None
    return security.load_server(Path(str(transport.keys_dir)), task)


def instantiate_node(cfg: DictConfig, group: str) -> Any:
    """The object config group ``group`` describes: its ``_target_`` called with the group's other keys.

    As Hydra's ``instantiate`` would for these flat nodes, without
    importing Hydra: a task that a launcher handed its config starts about
    50 ms sooner. Values arrive as plain lists and dicts. The ``_target_``
    is read by :func:`psdk.plugins.registry.locate`, as plugin records' targets are:
    ``package.module:Name``, or the dotted form saved runs hold.
    """
    try:
        values = OmegaConf.to_container(cfg[group], resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise ConfigError(str(exc.full_key or group), "must be given (it has no default)") from None
    if not isinstance(values, dict) or not isinstance(values.get("_target_"), str):
        raise ConfigError(group, "names no class to build (its _target_ is missing)")
    target = values.pop("_target_")
    try:
        factory = locate(target)
    except ImportError as exc:
        raise ConfigError(f"{group}._target_", f"{target} cannot be imported: {exc}") from None
    try:
        return factory(**values)
    except PsdkError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(group, f"{target} refused the values given: {exc}") from None


def launcher(cfg: DictConfig) -> Any:
    """The launcher ``launcher=`` selects (local processes, Ray)."""
    return instantiate_node(cfg, "launcher")


def topology(cfg: DictConfig) -> Topology:
    return cast(Topology, instantiate_node(cfg, "topology"))


def num_workers(cfg: DictConfig) -> int:
    """The job's workers: the launcher's ``topology.num_workers``, or a task's ``worker_hosts``."""
    return topology(cfg).num_workers if cfg.job_name is None else cluster_from(cfg).num_workers


def model_spec(cfg: DictConfig) -> ModelSpec:
    """The job's model spec: a :class:`ModelSpec`, or the spec class of the plugin that provides the model."""
    return cast(ModelSpec, instantiate_node(cfg, "model"))


def backend_options(cfg: DictConfig, backend: str) -> dict[str, Any]:
    """What ``backend_options.<backend>`` sets (the plugin's defaults fill the rest, in ``load_backend``)."""
    node = cfg.get("backend_options") or {}
    chosen = node.get(resolve_backend_name(backend)) or {}
    return dict(plain(chosen))


def update_rule(cfg: DictConfig) -> UpdateRule:
    return cast(UpdateRule, instantiate_node(cfg, "optimizer"))


def sync_spec(cfg: DictConfig) -> SyncSpec:
    return cast(SyncSpec, instantiate_node(cfg, "sync"))


def check_training(cfg: DictConfig, options: TaskOptions, sync: SyncSpec, warn: bool = True) -> None:
    """The training loop's settings, refused before any task starts when they cannot work together.

    Each group's own values were checked when ``options`` and ``sync`` were built; these checks span groups.
    ``warn``: also warn about settings that work but may train badly (once per job: the launcher).
    What depends on the data (a batch against a worker's shard of it) is the workload's ``check``
    entry, run by :func:`psdk.config.capacity.check_job`.
    """
    train = options.train
    if train.overlap and not sync.allows_overlap:
        raise ConfigError(
            "train.overlap",
            "works with sync=async or sync=ssp only: in sync mode the gradient computed while the last push "
            "is in flight is a round stale and the ps would drop it; use train.overlap=false",
        )
    momentum = float(cfg.optimizer.get("momentum") or 0.0)
    if warn and train.overlap and momentum >= 0.5:
        # Asynchrony acts like extra momentum (Mitliagkas et al., 2016): measured here, the MLP with
        # momentum 0.9 fell from 0.978 to 0.866 with overlap on, and plain SGD kept 0.971.
        log.warning(
            "train.overlap adds a step of staleness, which acts like extra momentum: with "
            "optimizer.momentum=%g training may oscillate; lower it (e.g. optimizer=sgd)",
            momentum,
        )


RUN_LOCAL_KEYS = (
    "run_id", "output_dir", "resume", "weights", "job_name", "task_index", "ps_hosts", "ps_hosts_from",
    "worker_hosts", "checkpoint", "data", "transport", "ps", "progress", "report", "launcher", "placement",
)  # fmt: skip
"""Top-level keys that say where and how a run runs, not what it trains: left out of its fingerprint."""


def fingerprint(cfg: DictConfig) -> str:
    """A digest of what the job trains (model, optimizer, sync mode, steps, seed, ...), for its checkpoints.

    Two runs of one command share it; a checkpoint written under another
    config is told apart by it when resumed. Paths, addresses and keys are
    left out: they differ between runs of the same job.
    """
    content = {str(k): plain(cfg.get(k)) for k in cfg if k not in RUN_LOCAL_KEYS and k != "hydra"}
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(content), sort_keys=True).encode()).hexdigest()[:16]


def run_id(cfg: DictConfig) -> str | None:
    """The run id the config gives (``run_id=``), checked; ``None`` when it gives none."""
    value = cfg.get("run_id")
    return check_run_id(str(value)) if value is not None else None


def check_liveness(options: TaskOptions) -> None:
    """A hang must be found before the tasks that wait on the hung one give up; checked by the launcher, which judges.

    Found within ``liveness.stall_timeout_s + 2 * liveness.interval_s``
    (:attr:`~psdk.config.options.LivenessOptions.detect_s`). With recovery on,
    that must come before the ps tasks give up on a silent chief
    (``ps.idle_timeout_s``) and the workers on a lost ps (``recovery.timeout_s``),
    or the job is lost waiting for a task the launcher was about to replace.
    """
    live = options.liveness
    if live.detect_s is None or live.stall_timeout_s is None:
        return
    heartbeat = options.transport.heartbeat_timeout_s
    if live.stall_timeout_s <= heartbeat:
        raise ConfigError(
            "liveness.stall_timeout_s",
            f"is {live.stall_timeout_s:g} but must be longer than transport.heartbeat_timeout_s ({heartbeat:g}): "
            "a worker may wait that long for a connection to a ps without its loop turning",
        )
    found = f"a hang is found within liveness.stall_timeout_s + 2 x liveness.interval_s = {live.detect_s:g} s"
    idle = options.ps.idle_timeout_s
    if options.recovery.enabled and idle is not None and live.detect_s >= idle:
        raise ConfigError(
            "liveness.stall_timeout_s",
            f"{found}, which must be shorter than ps.idle_timeout_s ({idle:g} s), or the ps tasks exit before a "
            "hung chief is replaced; lower liveness.stall_timeout_s or raise ps.idle_timeout_s",
        )
    if options.recovery.enabled and live.detect_s >= options.recovery.timeout_s:
        raise ConfigError(
            "liveness.stall_timeout_s",
            f"{found}, which must be shorter than recovery.timeout_s ({options.recovery.timeout_s:g} s), or the "
            "workers give up on a hung ps before it is replaced; lower liveness.stall_timeout_s or raise "
            "recovery.timeout_s",
        )
