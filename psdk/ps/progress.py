"""A ps task's counters, written to a small file the launcher's live display reads.

The launcher cannot ask a ps over the transport without keys of its own (and
a request would compete with the workers'), so a ps started with
``ps.progress_file`` rewrites that file a few times a second from a thread of
its own: version (the global step on shard 0), target, gradients applied and
dropped. The counters are plain ints updated by the serving thread; reading
them without a lock can only be a fraction of a second stale.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psdk.ps.server import ParameterServer
from psdk.report.metrics import write_json_atomic

INTERVAL_S = 0.5
MIN_INTERVAL_S = 0.05


def snapshot(server: ParameterServer) -> dict[str, Any]:
    """What the live display shows of one ps."""
    job = server.job
    return {
        "task": server.task_index,
        "version": server.store.version,
        "target": job.steps if job is not None else None,
        "applied": server.stats.applied,
        "dropped": server.stats.dropped,
        "rejected": server.stats.rejected,
        # Rows held per table now: a benchmark pairs them with the process's memory (benchmarks/ctr_memory.py).
        "table_rows": {name: len(table.rows) for name, table in list(getattr(server.store, "tables", {}).items())},
        "time": time.time(),
    }


def write(path: Path, data: dict[str, Any]) -> None:
    write_json_atomic(path, data)


@contextlib.contextmanager
def progress_file(server: ParameterServer, path: Path | None, display_every_s: float = INTERVAL_S) -> Iterator[None]:
    """While the block runs, keep ``path`` up to date with the server's counters (nothing if None).

    Rewritten every :data:`INTERVAL_S`, or every ``display_every_s`` (``progress.every_s``) when the
    launcher prints lines more often than that: each line would otherwise repeat stale counters.
    """
    if path is None:
        yield
        return
    interval_s = min(INTERVAL_S, max(MIN_INTERVAL_S, display_every_s))
    stop = threading.Event()

    def loop() -> None:
        while True:
            with contextlib.suppress(OSError):  # a full disk must not take the ps down
                write(path, snapshot(server))
            if stop.wait(interval_s):
                break

    thread = threading.Thread(target=loop, name="psdk-ps-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(OSError):
            write(path, snapshot(server))  # the last word: the counters the ps ended with
