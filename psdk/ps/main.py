"""Entry point of one ps task: bind, announce, serve until the chief ends the job."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from psdk.cluster import ClusterSpec, parse_hosts
from psdk.config import build
from psdk.errors import ConfigError
from psdk.ps.server import ParameterServer
from psdk.zmq_transport import ZmqTransport

log = logging.getLogger(__name__)


def announce(path: Path, address: str) -> None:
    """Tell the launcher where this ps listens (written atomically)."""
    host_port = address.split("://", 1)[-1]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"address": host_port, "pid": os.getpid()}))
    os.replace(tmp, path)


def run_ps(cfg: DictConfig) -> int:
    """Serve ps task ``task_index``; returns the process exit code."""
    task = int(cfg.task_index)
    ps_hosts = parse_hosts(build.plain(cfg.ps_hosts), "ps_hosts")
    if not ps_hosts:
        raise ConfigError("ps_hosts", "a ps task needs ps_hosts, e.g. ps_hosts=127.0.0.1:2222")
    if not 0 <= task < len(ps_hosts):
        raise ConfigError("task_index", f"is {task} but ps_hosts lists {len(ps_hosts)} ps task(s)")
    bind = str(cfg.ps.bind or ps_hosts[task])
    workers = parse_hosts(build.plain(cfg.worker_hosts), "worker_hosts", require_port=False)
    # One ZeroMQ I/O thread per worker (up to the cores) moves their messages in parallel.
    io_threads = int(cfg.ps.io_threads or min(max(1, len(workers)), os.cpu_count() or 1))
    cluster = ClusterSpec({"ps": ps_hosts, "worker": workers or ["localhost"]})
    curve = build.server_keys(cfg, cluster)
    transport = ZmqTransport(dataclasses.replace(build.zmq_options(cfg), io_threads=io_threads, curve=curve))
    if curve is not None:
        log.info("ps %d: CURVE on: %d worker key(s) accepted, traffic encrypted", task, len(curve.allowed))
    try:
        endpoint = transport.serve(bind, f"ps {task}")
        if cfg.ps.announce_file:
            announce(Path(cfg.ps.announce_file), endpoint.address)
        return ParameterServer(endpoint, task, build.server_options(cfg)).serve()
    finally:
        transport.close()
