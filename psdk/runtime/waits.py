"""Waits that say what they wait for, where, and for how long.

A task that waits on another (a worker on its ps, the chief on the other
workers, a worker on the chief, a launcher on its tasks) logs a line at most
every :func:`log_every_s` seconds, as TensorFlow 1.x printed "waiting for
response" lines: a wait of minutes without a word reads as a hang, and the
user cannot tell a ps that is not running from one that is slow. The line
names the likely cause once it can be told (nothing listening at the
address, a key mismatch); docs/errors.md lists the lines.
"""

from __future__ import annotations

import os
import time

LOG_EVERY_S = 10.0
"""The longest a wait goes without a line."""
LOG_EVERY_ENV = "PSDK_WAIT_LOG_S"
"""Seconds between the lines of a wait, when set (tests wait less); at most :data:`LOG_EVERY_S` still."""


def log_every_s() -> float:
    """Seconds between two lines of one wait: :data:`LOG_EVERY_S`, or less when ``PSDK_WAIT_LOG_S`` says so."""
    raw = os.environ.get(LOG_EVERY_ENV, "")
    try:
        every = float(raw) if raw else LOG_EVERY_S
    except ValueError:
        return LOG_EVERY_S
    return min(every, LOG_EVERY_S) if every > 0 else LOG_EVERY_S


class WaitLog:
    """When a wait's next line is due: once it has lasted ``every_s``, then every ``every_s``."""

    def __init__(self, every_s: float | None = None):
        self.every_s = log_every_s() if every_s is None else every_s
        self.start = time.monotonic()
        self._next = self.every_s

    def due(self, waited_s: float | None = None) -> float | None:
        """The seconds waited (since this was made, unless given) when a line is due now, else ``None``."""
        waited = time.monotonic() - self.start if waited_s is None else waited_s
        if waited < self._next:
            return None
        self._next = waited + self.every_s
        return waited


def seconds(waited_s: float) -> str:
    """A wait's length as the lines say it: ``12 s``, or ``1.5 s`` under ten seconds."""
    return f"{waited_s:.0f} s" if waited_s >= 9.95 else f"{waited_s:.1f} s"
