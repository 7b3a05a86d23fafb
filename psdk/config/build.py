"""Turning a composed config into the objects the tasks run with."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from psdk import announce, security
from psdk.cluster import ClusterSpec, Topology
from psdk.consistency import SyncSpec
from psdk.errors import ConfigError, PsdkError
from psdk.models import ModelSpec
from psdk.optim import UpdateRule
from psdk.security import CurveKeys

if TYPE_CHECKING:  # imported where used: a launcher checks a config without loading the transport
    from psdk.client import ClientOptions
    from psdk.ps.server import ServerOptions
    from psdk.zmq_transport import ZmqOptions

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


def with_announced_ps(cfg: DictConfig, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with the ps addresses the ps tasks announced in ``ps_hosts_from`` (if set), once they have.

    ``run`` starts the workers together with the ps tasks, which bind free
    ports: a worker waits for the addresses only once its own start-up is done.
    """
    folder = cfg.get("ps_hosts_from")
    if not folder:
        return cluster
    addresses = announce.wait_for(Path(str(folder)), cluster.num_ps, float(cfg.transport.startup_timeout_s))
    return ClusterSpec({"ps": addresses, "worker": cluster.as_dict()["worker"]})


def worker_keys(cfg: DictConfig, cluster: ClusterSpec, task: int) -> CurveKeys | None:
    """Worker ``task``'s CURVE keys and every ps task's public key (``None`` only with transport.secure=false)."""
    if not security.require_keys(cfg.transport.secure, cfg.transport.keys_dir):
        return None
    return security.load_worker(Path(cfg.transport.keys_dir), task, cluster.num_ps)


def server_keys(cfg: DictConfig, task: int) -> CurveKeys | None:
    """Ps task ``task``'s CURVE keys and the workers it accepts (``None`` only with transport.secure=false)."""
    if not security.require_keys(cfg.transport.secure, cfg.transport.keys_dir):
        return None
    return security.load_server(Path(cfg.transport.keys_dir), task)


def instantiate_node(node: Any, **kwargs: Any) -> Any:
    """``instantiate``, letting psdk's own errors out unwrapped (Hydra wraps them in its own)."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, PsdkError):
            raise exc.__cause__ from None
        raise


def launcher(cfg: DictConfig) -> Any:
    """The launcher ``launcher=`` selects (local processes, Ray)."""
    return instantiate_node(cfg.launcher)


def topology(cfg: DictConfig) -> Topology:
    return cast(Topology, instantiate_node(cfg.topology))


def model_spec(cfg: DictConfig) -> ModelSpec:
    return cast(ModelSpec, instantiate_node(cfg.model, _convert_="all"))


def update_rule(cfg: DictConfig) -> UpdateRule:
    return cast(UpdateRule, instantiate_node(cfg.optimizer))


def sync_spec(cfg: DictConfig) -> SyncSpec:
    return cast(SyncSpec, instantiate_node(cfg.sync))


def check_training(cfg: DictConfig, num_workers: int, warn: bool = True) -> None:
    """The training loop's settings, refused before any task starts when they cannot work.

    ``warn``: also warn about settings that work but may train badly (once per job: the launcher).
    """
    from psdk.data.mnist import TRAIN_SIZE

    train = cfg.train
    for key in ("steps", "batch_size"):
        if int(train[key]) < 1:
            raise ConfigError(f"train.{key}", f"must be at least 1, got {train[key]}")
    for key in ("log_every", "validate_every"):
        if int(train[key]) < 0:
            raise ConfigError(f"train.{key}", f"must be 0 (never) or more local steps, got {train[key]}")
    if bool(train.overlap) and not sync_spec(cfg).allows_overlap:
        raise ConfigError(
            "train.overlap",
            "works with sync=async or sync=ssp only: in sync mode the gradient computed while the last push "
            "is in flight is a round stale and the ps would drop it; use train.overlap=false",
        )
    momentum = float(cfg.optimizer.get("momentum") or 0.0)
    if warn and bool(train.overlap) and momentum >= 0.5:
        # Asynchrony acts like extra momentum (Mitliagkas et al., 2016): measured here, the MLP with
        # momentum 0.9 fell from 0.978 to 0.866 with overlap on, and plain SGD kept 0.971.
        log.warning(
            "train.overlap adds a step of staleness, which acts like extra momentum: with "
            "optimizer.momentum=%g training may oscillate; lower it (e.g. optimizer=sgd)",
            momentum,
        )
    held_out = int(cfg.data.validation_size)
    if not 0 <= held_out < TRAIN_SIZE:
        raise ConfigError("data.validation_size", f"must be in [0, {TRAIN_SIZE}), got {held_out}")
    shard = (TRAIN_SIZE - held_out) // num_workers
    if int(train.batch_size) > shard:
        raise ConfigError(
            "train.batch_size",
            f"{train.batch_size} is more than a worker's shard of the training set ({shard} images: "
            f"{TRAIN_SIZE - held_out} split over {num_workers} workers); use train.batch_size={min(shard, 100)} "
            "or fewer workers",
        )


def client_options(cfg: DictConfig) -> ClientOptions:
    from psdk.client import ClientOptions

    t = cfg.transport
    return ClientOptions(
        heartbeat_interval_s=float(t.heartbeat_interval_s),
        heartbeat_timeout_s=float(t.heartbeat_timeout_s),
        request_timeout_s=float(t.request_timeout_s),
        init_timeout_s=float(t.init_timeout_s),
        recovery_timeout_s=float(cfg.recovery.timeout_s) if cfg.recovery.enabled else None,
    )


def server_options(cfg: DictConfig) -> ServerOptions:
    from psdk.ps.server import ServerOptions  # a ps's only: a worker does not pay for importing the server

    idle = cfg.ps.idle_timeout_s
    if idle is not None and float(idle) <= 0:
        raise ConfigError("ps.idle_timeout_s", f"must be a positive number of seconds or null (never), got {idle}")
    lease = cfg.ps.pause_lease_s
    if lease is not None and float(lease) <= 0:
        raise ConfigError("ps.pause_lease_s", f"must be a positive number of seconds or null, got {lease}")
    if lease is None:  # a few heartbeats: the chief's heartbeats renew it while it writes the file
        lease = 3 * float(cfg.transport.heartbeat_interval_s)
    workers = plain(cfg.worker_hosts)
    cluster = cluster_from(cfg) if workers and cfg.ps_hosts is not None else None
    chief = cluster.worker_host(0) if cluster is not None else None
    return ServerOptions(
        heartbeat_timeout_s=float(cfg.transport.heartbeat_timeout_s),
        startup_timeout_s=float(cfg.transport.startup_timeout_s),
        log_every_s=float(cfg.ps.log_every_s),
        idle_timeout_s=None if idle is None else float(idle),
        chief_host=chief,
        recovery=bool(cfg.recovery.enabled),
        max_workers=cluster.num_workers if cluster is not None else ServerOptions.max_workers,
        pause_lease_s=float(lease),
    )


def zmq_options(cfg: DictConfig) -> ZmqOptions:
    from psdk.zmq_transport import ZmqOptions

    t = cfg.transport
    return ZmqOptions(
        io_threads=int(t.io_threads),
        max_message_bytes=int(t.max_message_bytes),
        heartbeat_interval_s=float(t.heartbeat_interval_s),
        heartbeat_timeout_s=float(t.heartbeat_timeout_s),
        shared_memory=bool(t.shared_memory),
        doorbells=bool(t.doorbells),
    )
