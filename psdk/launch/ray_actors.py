"""The two halves of a task on Ray: the actor that runs it on a node, and its handle on the launcher.

:class:`TaskRunner` is a plain class that Ray turns into an actor on the
node it picks; it starts the task's own ``python -m psdk`` command as a
subprocess there. :class:`RemoteProcess` makes that subprocess look like a
``Popen`` to the local launcher's supervision.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psdk.launch.local import TASK_ENV
from psdk.runtime import liveness

POLL_S = 0.2  # how often the launcher asks an actor whether its task ended
RPC_TIMEOUT_S = 30.0  # every call to an actor is bounded
TAIL_LINES = 20
RESULTS = ("summary.json", "params.npz", "metrics.jsonl")


# ------------------------------------------------------------------ on the node
def _pdeathsig() -> Callable[[], None]:
    """A ``preexec_fn`` that has the child killed when the actor dies (libc resolved before the fork)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: ray.kill still ends the actor
        return lambda: None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TaskRunner:
    """A Ray actor that runs one psdk task as a subprocess on its node.

    Its methods return at once (Ray runs them one at a time on the actor's
    main thread, which is also the subprocess's parent, as
    ``PR_SET_PDEATHSIG`` needs). The task's output goes to the actor's
    stdout, which Ray forwards to the launcher prefixed with the task's name;
    the last lines are kept for error messages.
    """

    def __init__(self, name: str):
        self.name = name
        self.process: subprocess.Popen[str] | None = None
        self.started = 0.0  # time.monotonic() on this node when the task was started
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return self.name.replace(" ", "")

    def where(self) -> tuple[str, str]:
        """The IP and Ray node id of the node this task landed on."""
        import ray

        return str(ray.util.get_node_ip_address()), str(ray.get_runtime_context().get_node_id())

    def start(self, args: list[str], env: dict[str, str]) -> int:
        full_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # the launcher gives the cluster
        full_env.update(TASK_ENV)
        full_env.update(env)
        for arg in args:  # a run folder used before holds the last run's address and beats: never read them
            if arg.startswith(("ps.announce_file=", "liveness.file=")):
                Path(arg.split("=", 1)[1]).unlink(missing_ok=True)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "psdk", *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_pdeathsig(),
        )
        threading.Thread(target=self._pump, args=(self.process,), daemon=True).start()
        return self.process.pid

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.tail.append(line.rstrip("\n"))
            print(line, end="", flush=True)

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def announced(self, path: str) -> str | None:
        """The address a ps announced in ``path`` on this node, once it has."""
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            return str(json.loads(Path(path).read_text())["address"])
        return None

    def last_lines(self) -> list[str]:
        return list(self.tail)

    def liveness(self, path: str) -> liveness.Seen | None:
        """The running task's liveness file on this node, read here: its clock is the task's (None: not running)."""
        if self.process is None or self.process.poll() is not None:
            return None
        return liveness.observe(Path(path), self.process.pid, self.started)

    def signal(self, kill: bool) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()

    def write_files(self, folder: str, files: dict[str, bytes]) -> None:
        """Put ``files`` (CURVE keys) under ``folder`` on this node, readable by their owner only."""
        root = Path(folder)
        for name, data in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_bytes(data)
            path.chmod(0o600)

    def read_results(self, folder: str) -> dict[str, bytes]:
        """The chief's results in ``folder`` on this node, for a launcher on another machine."""
        root = Path(folder)
        paths = [root / name for name in RESULTS] + sorted((root / "checkpoints").glob("*.npz"))
        return {str(p.relative_to(root)): p.read_bytes() for p in paths if p.is_file()}


# ------------------------------------------------------------- on the launcher
class RemoteProcess:
    """A task's subprocess on a Ray node, seen through its actor and shaped like ``Popen``."""

    def __init__(self, ray: Any, actor: Any):
        self._ray, self.actor = ray, actor
        self.returncode: int | None = None
        self.lost: str | None = None
        self._polled = 0.0

    def poll(self) -> int | None:
        now = time.monotonic()
        if self.returncode is None and now - self._polled >= POLL_S:
            self._polled = now
            try:
                self.returncode = self._ray.get(self.actor.poll.remote(), timeout=RPC_TIMEOUT_S)
            except self._ray.exceptions.GetTimeoutError:
                pass
            except self._ray.exceptions.RayError as exc:  # the actor, or its node, died
                self.lost = f"was lost with its Ray actor ({type(exc).__name__}; did its node die?)"
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("psdk task on Ray", timeout or 0.0)
            time.sleep(POLL_S / 4)
        return code

    def terminate(self) -> None:
        self._signal(kill=False)

    def kill(self) -> None:
        self._signal(kill=True)

    def _signal(self, kill: bool) -> None:
        with contextlib.suppress(self._ray.exceptions.RayError):
            self._ray.get(self.actor.signal.remote(kill), timeout=RPC_TIMEOUT_S)

    def last_lines(self) -> list[str]:
        try:
            return list(self._ray.get(self.actor.last_lines.remote(), timeout=RPC_TIMEOUT_S))
        except self._ray.exceptions.RayError:
            return []

    def liveness(self, path: str) -> liveness.Seen | None:
        """What the task's actor reads of its liveness file (None: no answer; its poll says why)."""
        try:
            seen = self._ray.get(self.actor.liveness.remote(path), timeout=RPC_TIMEOUT_S)
        except self._ray.exceptions.RayError:  # a timeout too: judged at the next look
            return None
        return seen if isinstance(seen, liveness.Seen) else None
