"""Failpoints: a task kills or stalls itself at one named point of its work, for tests of what survives that.

A test that must kill the chief *between* two messages of a checkpoint
cannot do it from outside at the right moment: the window lasts
milliseconds. Set ``PSDK_FAILPOINT=<spec>:<marker file>`` in the task's
environment, where ``<spec>`` is ``[<task>/]<name>[@<n>][=<action>]``:

* ``<task>/``: only in that task (``worker1``, ``ps0``): every task of a
  job inherits the launcher's environment, and a test that stalls one
  worker of two must say which;
* ``<name>``: the point (the constants below);
* ``@<n>``: act the n-th time this process reaches it (default: the first),
  so a test injects a fault at measured progress, e.g. a ps's 300th update;
* ``=<action>``: ``kill`` (the default: SIGKILL), ``stall`` (the thread
  that reached it blocks for ever, while the process's other threads go
  on: a hung loop), or ``sleep<seconds>`` (sleep that long every time from
  the n-th on: a task that is slow but alive).

``kill`` and ``stall`` act once: the marker file, created atomically, tells
a restarted task (which inherits the environment) to go on. Unset (the
normal case), a failpoint costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

from psdk.runtime.logs import task_label

FAILPOINT_ENV = "PSDK_FAILPOINT"

CHECKPOINT_PAUSED = "checkpoint.paused"
"""The chief has paused every shard for a checkpoint and not yet resumed them."""
TRAINED = "trained"
"""The chief has finished training and waited for the others, and has not yet written its results."""
PS_UPDATE = "ps.update"
"""A ps has applied an update (``@n``: its n-th since it started)."""
PS_STATE = "ps.state"
"""A ps is about to hand the chief its state for a checkpoint (the shards are paused)."""
PS_WRAP_UP = "ps.wrap_up"
"""A ps whose job reached its target step was told by the chief that it finished: the chief is wrapping up."""
PS_SERVE = "ps.serve"
"""A ps's serving loop turns (many times a second: give ``@n`` or a sleep)."""
WORKER_STEP = "worker.step"
"""A worker of the built-in job starts a training step."""

ACTIONS = ("kill", "stall")
_reached: Counter[str] = Counter()


@dataclass(frozen=True)
class Spec:
    name: str
    at: int = 1
    action: str = "kill"
    sleep_s: float = 0.0
    marker: str = ""
    task: str = ""
    """Only in this task (``worker1``); empty: in every task."""


def parse(text: str) -> Spec:
    """``[<task>/]<name>[@<n>][=<action>]:<marker>``, as the module docstring says."""
    spec, _, marker = text.partition(":")
    spec, _, action = spec.partition("=")
    task, _, spec = spec.rpartition("/")
    name, _, at = spec.partition("@")
    action = action or "kill"
    sleep_s = 0.0
    if action.startswith("sleep"):
        sleep_s, action = float(action[len("sleep") :]), "sleep"
    elif action not in ACTIONS:
        raise ValueError(f"{FAILPOINT_ENV}: unknown action {action!r} (kill, stall or sleep<seconds>)")
    return Spec(name, int(at) if at else 1, action, sleep_s, marker, task)


def failpoint(name: str) -> None:
    text = os.environ.get(FAILPOINT_ENV)
    if not text:
        return
    spec = parse(text)
    if spec.name != name or (spec.task and spec.task != task_label().replace(" ", "")):
        return
    _reached[name] += 1
    if _reached[name] < spec.at:
        return
    if spec.action == "sleep":
        time.sleep(spec.sleep_s)
        return
    if _reached[name] > spec.at:
        return
    if spec.marker:
        try:
            os.close(os.open(spec.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return  # this failpoint has acted once already
    if spec.action == "stall":
        threading.Event().wait()
    os.kill(os.getpid(), signal.SIGKILL)
