"""Entry point of one ps task: bind, announce, serve until the chief ends the job.

A ps binds exactly the address it is told: its own ``ps_hosts`` entry, or
``ps.bind`` when the address the others reach it by cannot be bound here (a
Kubernetes service name, a load balancer, a NAT). It never binds every
interface unless told to (``ps.bind=0.0.0.0``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

from omegaconf import DictConfig

from psdk.config import build
from psdk.config.options import TaskOptions, options_from
from psdk.errors import BindError, ConfigError, TransportError
from psdk.launch import announce
from psdk.protocol.cluster import ClusterSpec, parse_hosts, split_host, task_out_of_range
from psdk.ps.progress import progress_file
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport import security
from psdk.transport.security import CurveKeys
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

log = logging.getLogger(__name__)


def bind_address(bind: object, advertised: str) -> str:
    """What the ps binds: ``ps.bind`` if set, else its own ``ps_hosts`` entry.

    ``ps.bind`` without a port (``ps.bind=eth0``, ``ps.bind=10.0.0.5``) takes
    the port of the ``ps_hosts`` entry, so the two cannot drift apart.
    """
    if bind is None or str(bind).strip() == "":
        return advertised
    text = str(bind).strip()
    host, port = split_host(text, "ps.bind")
    if port is not None or "://" in host:
        return f"{host}:{port}" if port is not None else host
    _, own_port = split_host(advertised, "ps_hosts")
    if own_port is None:
        raise ConfigError("ps.bind", f"{text!r} has no port and the ps_hosts entry {advertised!r} has none to lend")
    return f"{host}:{own_port}"


def ps_transport(options: TaskOptions, num_workers: int, curve: CurveKeys | None) -> ZmqOptions:
    """A ps's socket settings: ``transport.*`` as it is, but ``ps.io_threads``, and ``ps.max_connections``."""
    own = dataclasses.replace(options.transport, io_threads=options.ps_io_threads(num_workers))
    return ZmqOptions(own, max_connections=options.ps_max_connections(num_workers), curve=curve)


def server_options(options: TaskOptions, cluster: ClusterSpec | None) -> ServerOptions:
    """A ps's serving options; ``cluster`` (a per-task run's) names its chief and bounds the worker ids."""
    lease = options.ps.pause_lease_s
    return ServerOptions(
        transport=options.transport,
        log_every_s=options.ps.log_every_s,
        idle_timeout_s=options.ps.idle_timeout_s,
        chief_host=cluster.worker_host(0) if cluster is not None else None,
        recovery=options.recovery.enabled,
        recovery_timeout_s=options.recovery.timeout_s,
        max_workers=cluster.num_workers if cluster is not None else ServerOptions.max_workers,
        # A few heartbeats by default: the chief's heartbeats renew the lease while it writes the file.
        pause_lease_s=lease if lease is not None else 3 * options.transport.heartbeat_interval_s,
    )


class PsTask:
    """A ps task that has bound its address: :meth:`run` serves until the job ends.

    ``python -m psdk ps`` runs it in its main thread; :func:`psdk.serve` in a
    thread of a user's script. Binding first lets both refuse a taken
    address before anything else happens.
    """

    def __init__(self, server: ParameterServer, transport: ZmqTransport, progress: Path | None, every_s: float):
        self.server, self.transport = server, transport
        self.progress, self.every_s = progress, every_s

    @property
    def address(self) -> str:
        """The address bound (with the port picked, for a port 0)."""
        return self.server.endpoint.address

    def run(self, stop: threading.Event | None = None) -> int:
        """Serve until the chief ends the job, or ``stop`` is set; returns the exit code (0: shut down)."""
        try:
            with progress_file(self.server, self.progress, self.every_s):
                return self.server.serve(stop)
        finally:
            self.transport.close()


def start_ps(cfg: DictConfig) -> PsTask:
    """Bind ps task ``task_index`` of ``cfg`` (and announce it); raises a ConfigError or BindError."""
    options = options_from(cfg)
    task = int(cfg.task_index)
    ps_hosts = parse_hosts(build.plain(cfg.ps_hosts), "ps_hosts")
    if not ps_hosts:
        raise ConfigError("ps_hosts", "a ps task needs ps_hosts, e.g. ps_hosts=127.0.0.1:2222")
    if not 0 <= task < len(ps_hosts):
        raise ConfigError("task_index", task_out_of_range(task, len(ps_hosts), "ps_hosts"))
    advertised = ps_hosts[task]
    bind = bind_address(options.ps.bind, advertised)
    if bind != advertised:
        log.info("ps %d: binding %s; the others reach it at %s", task, bind, advertised)
    workers = parse_hosts(build.plain(cfg.worker_hosts), "worker_hosts", require_port=False)
    cluster = ClusterSpec({"ps": ps_hosts, "worker": workers or ["localhost"]})
    curve = build.server_keys(options.transport, task)
    # ps.io_threads wins over transport.io_threads here: by default one I/O thread per worker, up to the cores.
    transport = ZmqTransport(ps_transport(options, cluster.num_workers, curve))
    if curve is not None:
        log.info("ps %d: CURVE on: %d worker key(s) accepted, traffic encrypted", task, len(curve.allowed))
    else:
        log.warning(security.INSECURE_WARNING, f"ps {task}", bind)
    try:
        try:
            endpoint = transport.serve(bind, f"ps {task}")
        except TransportError as exc:
            raise BindError(bind, f"ps {task}", exc.reason or str(exc), explicit=bind != advertised) from None
        if options.ps.announce_file:
            announce.announce(Path(options.ps.announce_file), endpoint.address)
        server = ParameterServer(endpoint, task, server_options(options, cluster if workers else None))
    except BaseException:
        transport.close()
        raise
    progress = Path(options.ps.progress_file) if options.ps.progress_file else None
    return PsTask(server, transport, progress, float(cfg.progress.every_s))


def run_ps(cfg: DictConfig) -> int:
    """Serve ps task ``task_index``; returns the process exit code."""
    return start_ps(cfg).run()
