"""Separate hosts for tests: network namespaces with their own addresses on one private LAN.

Each host is a namespace with an ``eth0`` (a veth pair) plugged into a
bridge that lives in a namespace of its own, so nothing touches the root
namespace's interfaces, routes or firewall, and no packet can leave the
machine. Names carry the test process's pid and a counter: concurrent runs
never collide, and :func:`remove_leftovers` deletes only those of processes
that are gone. :func:`lan` removes everything it made, whatever happens.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

PREFIX = "psdkt"
SUBNET = "10.77.0"  # private, and only ever inside these namespaces
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier test runs whose process is gone (a killed run leaves them)."""
    removed = []
    for name in _namespaces():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"`ip netns add` failed: {made.stderr.strip()}"


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    port: str  # its veth's other end, on the bridge

    def command(self, *argv: str) -> list[str]:
        """``argv`` run on this host, with its own process table as on a machine of its own.

        Namespaces of one machine would otherwise see each other's processes,
        and psdk would share memory between a worker and its ps as on one host.
        ``--kill-child``: the task goes when whoever started it kills it.
        """
        return ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]


class Lan:
    """Hosts on one bridge; the processes started on them are killed before the hosts go."""

    def __init__(self, names: Sequence[str]):
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-lan"
        self.hosts = [Host(name, f"{self.tag}-{name}", f"{SUBNET}.{i + 1}", f"p{i}") for i, name in enumerate(names)]
        self.processes: list[subprocess.Popen[str]] = []

    def __getitem__(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                host.netns,
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for name in [h.netns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", name, check=False)

    def start(self, host: Host, argv: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host``; its output is captured as text."""
        process = subprocess.Popen(
            host.command(*argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
        )
        self.processes.append(process)
        return process

    def unplug(self, host: Host) -> None:
        """Take ``host`` off the network, as if its machine vanished."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def rx_bytes(self, host: Host) -> int:
        """Bytes ``host`` has received on its ``eth0``."""
        out = _ip("-n", host.netns, "-s", "-j", "link", "show", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def can_connect(self, host: Host | None, address: str, port: int) -> bool:
        """Whether a TCP connection from ``host`` (``None``: the root namespace) to ``address:port`` opens."""
        code = (
            "import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({address!r}, {port}), timeout=3).close()\n"
            "except OSError:\n"
            "    sys.exit(1)\n"
        )
        argv = [sys.executable, "-c", code]
        done = subprocess.run(argv if host is None else host.command(*argv), capture_output=True, timeout=30)
        return done.returncode == 0


@contextmanager
def lan(names: Sequence[str]) -> Iterator[Lan]:
    """A LAN of hosts called ``names`` at 10.77.0.1, .2, ...; removed afterwards, whatever happens."""
    remove_leftovers()
    net = Lan(names)
    try:
        net.create()
        yield net
    finally:
        net.destroy()
