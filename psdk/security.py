"""CURVE keys: who may talk to a ps, and an encrypted channel for what they say.

With ``transport.secure`` on, every ps socket is a CURVE server and every
worker socket a CURVE client. A ps accepts only the public keys of the job's
workers (a ZAP handler checks each connection before its first message is
read), and it knows which worker each key belongs to, so a worker's key
cannot claim another worker's id. A refused connection is logged and never
reaches the store. Keys live in one folder::

    keys/server.key, keys/server.key_secret        the ps tasks' keypair
    keys/workers/worker-<i>.key(+_secret)           one keypair per worker

A ps needs ``server.key_secret`` and ``workers/*.key``; worker i needs
``workers/worker-<i>.key_secret`` and ``server.key``. ``python -m psdk keys``
makes them; the local launcher makes a fresh set per run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from psdk.cluster import ClusterSpec
from psdk.errors import ConfigError

log = logging.getLogger(__name__)

SERVER = "server"
WORKERS = "workers"
DENIAL_LOG_INTERVAL_S = 60.0


def worker_name(index: int) -> str:
    return f"worker-{index}"


@dataclass(frozen=True)
class CurveKeys:
    """One task's key material."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None
    """Clients: the ps tasks' public key."""
    allowed: dict[bytes, str] = field(default_factory=dict)
    """Servers: the public key of every worker that may connect, and its name."""


def generate(folder: Path, num_workers: int) -> Path:
    """A fresh keypair for the ps tasks and one per worker (secrets readable by the owner only)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    (folder / WORKERS).mkdir(exist_ok=True)
    zmq.auth.create_certificates(str(folder), SERVER)
    for index in range(num_workers):
        zmq.auth.create_certificates(str(folder / WORKERS), worker_name(index))
    for secret in folder.rglob("*.key_secret"):
        os.chmod(secret, 0o600)
    return folder


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise ConfigError("transport.keys_dir", f"{path} is missing; make keys with `python -m psdk keys`")
    public, secret = zmq.auth.load_certificate(str(path))
    return public, secret


def load_server(folder: Path) -> CurveKeys:
    public, secret = _load(folder / f"{SERVER}.key_secret")
    allowed = {}
    for path in sorted((folder / WORKERS).glob("*.key")):
        key, _ = zmq.auth.load_certificate(str(path))
        allowed[key] = path.stem
    if not allowed or secret is None:
        raise ConfigError("transport.keys_dir", f"{folder} holds no worker public keys (workers/worker-<i>.key)")
    return CurveKeys(public, secret, allowed=allowed)


def load_worker(folder: Path, index: int) -> CurveKeys:
    public, secret = _load(folder / WORKERS / f"{worker_name(index)}.key_secret")
    server_public, _ = _load(folder / f"{SERVER}.key")
    if secret is None:
        raise ConfigError("transport.keys_dir", f"no secret key for worker {index} in {folder}")
    return CurveKeys(public, secret, server_public=server_public)


def _loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secure_by_default(cluster: ClusterSpec) -> bool:
    """On when the tasks are not all on one host (every loopback name counts as one host)."""
    hosts = {cluster.worker_host(i) for i in range(cluster.num_workers)}
    hosts |= {entry.rsplit(":", 1)[0] for entry in cluster.ps if "://" not in entry}
    named = {"loopback" if _loopback(h) else h for h in hosts}
    return len(named) > 1


def is_secure(secure: bool | None, keys_dir: str | None, cluster: ClusterSpec) -> bool:
    """Whether this task must use CURVE, refusing a secure setup without keys."""
    on = secure_by_default(cluster) if secure is None else bool(secure)
    if on and not keys_dir:
        why = "transport.secure=true" if secure else "the tasks are on more than one host, so transport.secure is on"
        raise ConfigError(
            "transport.keys_dir",
            f"{why} but no keys were given: make them with `python -m psdk keys keys_dir=DIR workers=N`, "
            "copy the folder to every host and pass transport.keys_dir=DIR to every task "
            "(or set transport.secure=false on a trusted network)",
        )
    return on


class KeyRing:
    """The ZAP decision: a known worker key is let in under its worker's name; others are refused and logged."""

    def __init__(self, allowed: dict[bytes, str], owner: str):
        self.allowed = allowed
        self.owner = owner
        self._logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        now = time.monotonic()
        if now - self._logged.get(key, -1e9) >= DENIAL_LOG_INTERVAL_S:  # a retrying client logs once a minute
            self._logged[key] = now
            log.warning("%s: refused a connection with an unknown CURVE key %s…", self.owner, key[:12].decode())
        return False


class PsdkAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, naming each accepted client after its key (the ROUTER sees it as User-Id)."""

    def __init__(self, context: zmq.Context[Any], ring: KeyRing):
        super().__init__(context)
        self.ring = ring

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.ring.allowed.get(z85.encode(client_public_key), "unknown")


def start_authenticator(context: zmq.Context[Any], keys: CurveKeys, owner: str) -> PsdkAuthenticator:
    ring = KeyRing(keys.allowed, owner)
    auth = PsdkAuthenticator(context, ring)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=ring)
    return auth
