"""Where a ps listens, told through a file: how ``run`` starts workers before the ps is up.

A ps started by a launcher binds port 0 (no race for a free port) and
writes its address atomically to ``ps<i>.json``. The launcher and the
workers it starts at the same moment as the ps read it from there, so a
worker spends the ps's start-up on its own imports and data instead of
waiting for it to finish first.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from psdk.errors import PsdkError
from psdk.report.metrics import write_json_atomic
from psdk.runtime.liveness import beat
from psdk.runtime.logs import task_label
from psdk.runtime.waits import WaitLog, seconds

log = logging.getLogger(__name__)

POLL_S = 0.02


def file_for(folder: Path, index: int) -> Path:
    return folder / f"ps{index}.json"


def announce(path: Path, address: str) -> None:
    """Write where this ps listens (``host:port``), atomically: a reader never sees half a file."""
    write_json_atomic(path, {"address": address.split("://", 1)[-1], "pid": os.getpid()})


def wait_for(
    folder: Path, num_ps: int, timeout_s: float, still_worth_it: Callable[[], None] | None = None
) -> list[str]:
    """The addresses of ps 0..num_ps-1 once each has announced it; ``PsdkError`` after ``timeout_s``.

    ``still_worth_it`` is called on every poll and raises to stop waiting (a
    launcher whose ps died before it listened).
    """
    files = [file_for(folder, i) for i in range(num_ps)]
    deadline = time.monotonic() + timeout_s
    clock = WaitLog()
    while not all(f.exists() for f in files):
        beat()  # a worker waiting for its ps tasks is not hung (psdk.runtime.liveness)
        if still_worth_it is not None:
            still_worth_it()
        waiting = ", ".join(f"ps {i}" for i, f in enumerate(files) if not f.exists())
        if (waited := clock.due()) is not None:
            log.info(
                "%s: waiting for %s to announce its address in %s: %s of %s; the ps task has not bound its port yet",
                task_label(),
                waiting,
                folder,
                seconds(waited),
                seconds(timeout_s),
            )
        if time.monotonic() > deadline:
            raise PsdkError(f"{waiting} did not announce an address in {folder} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return [str(json.loads(f.read_text())["address"]) for f in files]
