"""Failpoints: a task kills itself at one named point of its work, for tests of what survives that.

A test that must kill the chief *between* two messages of a checkpoint
cannot do it from outside at the right moment: the window lasts
milliseconds. Set ``PSDK_FAILPOINT=<name>:<marker file>`` in the task's
environment and the task sends itself SIGKILL when it reaches ``<name>``,
the first time only: the marker file, created atomically, tells a restarted
task (which inherits the environment) to go on. Unset (the normal case), a
failpoint costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

FAILPOINT_ENV = "PSDK_FAILPOINT"

CHECKPOINT_PAUSED = "checkpoint.paused"
"""The chief has paused every shard for a checkpoint and not yet resumed them."""
TRAINED = "trained"
"""The chief has finished training and waited for the others, and has not yet written its results."""


def failpoint(name: str) -> None:
    spec = os.environ.get(FAILPOINT_ENV)
    if not spec:
        return
    point, _, marker = spec.partition(":")
    if point != name:
        return
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return  # this failpoint has fired once already
    os.kill(os.getpid(), signal.SIGKILL)
