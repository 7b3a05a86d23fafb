"""CURVE keys: who may talk to a ps, and an encrypted channel for what they say.

CURVE is on wherever a ps listens, one host included: every ps socket is a
CURVE server and every worker socket a CURVE client, unless a task is told
``transport.secure=false`` (and then the ps says what that exposes). A ps
accepts only the public keys of the job's workers (a ZAP handler checks each
connection before its first message is read), and it knows which worker each
key belongs to, so a worker's key cannot claim another worker's id. Every ps
task has a keypair of its own and every worker one; a folder holds them::

    keys/ps/ps-<j>.key, keys/ps/ps-<j>.key_secret            ps task j's keypair
    keys/workers/worker-<i>.key, ....key_secret               worker i's keypair

Each task needs only its own secret and the others' public keys
(:func:`files_for`): ps task j ``ps/ps-<j>.key_secret`` and
``workers/*.key``; worker i ``workers/worker-<i>.key_secret`` and
``ps/*.key``. A secret file readable by group or others is refused, as ssh
refuses a private key. ``python -m psdk keys`` makes a folder (and never
overwrites one unless asked); ``python -m psdk run`` makes a fresh one per run.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from psdk.errors import ConfigError
from psdk.runtime.logs import RateLimitedLog
from psdk.transport.contract import worker_name

log = logging.getLogger(__name__)

PS = "ps"
WORKERS = "workers"
DENIAL_LOG_INTERVAL_S = 60.0
REMEMBERED_DENIALS = 256
"""Unknown keys remembered (to log each once a minute): the oldest is forgotten first, so a flood of fresh keys
costs a bounded table and, past the log's own limit, a count."""
KEY_ENV_HINT = "make them with `python -m psdk keys keys_dir=DIR workers=N ps=M`"


def ps_name(index: int) -> str:
    return f"ps-{index}"


@dataclass(frozen=True)
class CurveKeys:
    """One task's key material."""

    public: bytes
    secret: bytes
    servers: tuple[bytes, ...] = ()
    """Clients: each ps task's public key, by ps index."""
    allowed: dict[bytes, str] = field(default_factory=dict)
    """Servers: the public key of every worker that may connect, and its name."""


def files_for(job: str, index: int) -> list[str]:
    """The files of a key folder that task ``job`` ``index`` needs, as globs: its own secret, the others' publics."""
    if job == "ps":
        return [f"{PS}/{ps_name(index)}.key_secret", f"{WORKERS}/*.key"]
    return [f"{WORKERS}/{worker_name(index)}.key_secret", f"{PS}/*.key"]


def generate(folder: Path, num_workers: int, num_ps: int = 1, overwrite: bool = False) -> Path:
    """A fresh keypair per ps task and per worker (secrets readable by the owner only).

    An existing key folder is kept unless ``overwrite``: replacing keys under
    a running job locks its tasks out, and a copy elsewhere may be the only one.
    """
    if (folder / PS).exists() or (folder / WORKERS).exists():
        if not overwrite:
            raise ConfigError(
                "keys_dir",
                f"{folder} already holds keys; pass overwrite=true to replace them (every task of a job using "
                "them then needs the new ones), or choose another keys_dir",
            )
        for old in [*(folder / PS).glob("*.key*"), *(folder / WORKERS).glob("*.key*")]:
            old.unlink()
    if folder.exists():
        problem = _unsafe(folder)
        if problem:  # its mode is not this command's to change: a shared folder stays as its owner set it
            raise ConfigError("keys_dir", f"{problem}, so keys made there would be refused; {SAFE_FOLDER_HINT}")
    else:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o700)
    tasks = {PS: [ps_name(j) for j in range(num_ps)], WORKERS: [worker_name(i) for i in range(num_workers)]}
    for sub, names in tasks.items():
        (folder / sub).mkdir(exist_ok=True, mode=0o700)
        for name in names:
            zmq.auth.create_certificates(str(folder / sub), name)
    for secret in folder.rglob("*.key_secret"):
        os.chmod(secret, 0o600)
    return folder


def _unsafe(path: Path) -> str | None:
    """What lets another user replace ``path``: another owner (root aside), or group/others' write access.

    A folder with the sticky bit (like /tmp) is safe to hold others' files: nobody
    else can rename or delete what belongs to this user in it.
    """
    info = path.lstat()
    if info.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to another user (uid {info.st_uid})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX):
        who = " and ".join(w for w, bits in (("its group", 0o020), ("other users", 0o002)) if mode & bits)
        return f"{path} can be written by {who} (mode {mode:04o})"
    return None


SAFE_FOLDER_HINT = "use a keys_dir of your own that only you can write (`chmod go-w` it, or a new folder)"


def _owned(path: Path, keys_dir: Path) -> None:
    """Refuse a key file that another user could have put there: it, or a folder up to ``keys_dir``, is unsafe.

    The ps takes a worker's identity from its public key file's name, so a
    ``workers/`` folder others can write lets them swap in their own
    ``worker-0.key`` and be let in as the chief.
    """
    for part in (path, *path.parents):
        problem = _unsafe(part)
        if problem:
            raise ConfigError("transport.keys_dir", f"{problem}; refusing the key {path}: {SAFE_FOLDER_HINT}")
        if part == keys_dir:
            return


def _public(path: Path, keys_dir: Path) -> bytes:
    if not path.is_file():
        raise ConfigError("transport.keys_dir", f"{path} is missing; {KEY_ENV_HINT}")
    _owned(path, keys_dir)
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def _secret(path: Path, keys_dir: Path) -> tuple[bytes, bytes]:
    """A keypair from a secret key file that only its owner can read (refused otherwise, as ssh does)."""
    if not path.is_file():
        raise ConfigError("transport.keys_dir", f"{path} is missing; {KEY_ENV_HINT}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("other users", 0o007)) if mode & bits)
        raise ConfigError(
            "transport.keys_dir",
            f"{path} is a secret key that {who} can read or write (mode {mode:04o}); anyone who can read it can act "
            f"as this task: `chmod 600 {path}` (and keep its folder the owner's alone)",
        )
    _owned(path, keys_dir)
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ConfigError("transport.keys_dir", f"{path} holds no secret key; {KEY_ENV_HINT}")
    return public, secret


def load_server(folder: Path, index: int = 0) -> CurveKeys:
    """Ps task ``index``'s keys, and the workers it lets in."""
    public, secret = _secret(folder / PS / f"{ps_name(index)}.key_secret", folder)
    allowed = {_public(path, folder): path.stem for path in sorted((folder / WORKERS).glob("*.key"))}
    if not allowed:
        raise ConfigError("transport.keys_dir", f"{folder} holds no worker public keys (workers/worker-<i>.key)")
    return CurveKeys(public, secret, allowed=allowed)


def load_worker(folder: Path, index: int, num_ps: int = 1) -> CurveKeys:
    """Worker ``index``'s keys, and the public key of each of the ``num_ps`` ps tasks it talks to."""
    public, secret = _secret(folder / WORKERS / f"{worker_name(index)}.key_secret", folder)
    servers = tuple(_public(folder / PS / f"{ps_name(j)}.key", folder) for j in range(num_ps))
    return CurveKeys(public, secret, servers=servers)


def require_keys(secure: Any, keys_dir: Any) -> bool:
    """Whether this task uses CURVE (always, unless ``transport.secure=false``); refuses secure without keys."""
    on = True if secure is None else bool(secure)
    if on and not keys_dir:
        raise ConfigError(
            "transport.keys_dir",
            "a ps and its workers talk CURVE unless told otherwise, and this task was given no keys: "
            f"{KEY_ENV_HINT}, give every task transport.keys_dir=DIR (each host needs only its tasks' files: "
            "docs/security.md), or run the whole job with `python -m psdk run`, which makes its own; "
            "transport.secure=false turns CURVE off (anyone who can reach a ps can then read and change the model)",
        )
    return on


INSECURE_WARNING = (
    "%s: CURVE is off (transport.secure=false): anyone who can reach %s can read the parameters, push gradients, "
    "take any worker's id (the chief's too) before it connects or while it restarts, and stop the job; use it "
    "only where you trust every host and every user that can reach this port"
)


class KeyRing:
    """The ZAP decision: a known worker key is let in under its worker's name; others are refused and logged.

    What unknown keys cost is bounded: the keys remembered (to log each at
    most once a minute) are the latest :data:`REMEMBERED_DENIALS`, and the
    log lines themselves are rate-limited.
    """

    def __init__(self, allowed: dict[bytes, str], owner: str):
        self.allowed = allowed
        self.owner = owner
        self.refused = 0
        self._logged: OrderedDict[bytes, float] = OrderedDict()
        self._lines = RateLimitedLog(log)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(key, -1e9) >= DENIAL_LOG_INTERVAL_S:  # a retrying client logs once a minute
            self._logged[key] = now
            self._logged.move_to_end(key)
            while len(self._logged) > REMEMBERED_DENIALS:
                self._logged.popitem(last=False)
            self._lines.warning("%s: refused a connection with an unknown CURVE key %s…", self.owner, key[:12].decode())
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


def connect_keys(keys: Path | str | CurveKeys | None, secure: bool, num_ps: int, task: int) -> CurveKeys | None:
    """``psdk.connect``'s ``keys``: keys as given, a worker's from the job's folder, or none when not secure."""
    if isinstance(keys, CurveKeys):
        return keys
    if keys is not None:
        return load_worker(Path(keys), task, num_ps)
    if secure:
        raise ConfigError(
            "keys",
            "psdk.connect needs the job's keys: keys=DIR, a folder made by `python -m psdk keys keys_dir=DIR "
            "workers=N` and given to the ps tasks as transport.keys_dir=DIR; or secure=False with ps tasks "
            "started with transport.secure=false, where every host and user is trusted",
        )
    return None
