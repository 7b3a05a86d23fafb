"""A whole psdk job from a test: ``python -m psdk run`` in a subprocess, with its summary back.

Backend plugins test the end-to-end MNIST job with it; a subprocess keeps the
framework (and torch or TensorFlow never both) out of the pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

FAST_HEARTBEATS = ("transport.heartbeat_interval_s=0.2", "transport.heartbeat_timeout_s=5")
"""Heartbeats that notice a lost task in seconds, not the default tens of seconds."""


def run_job(
    out: Path, *overrides: str, data_dir: Path | None = None, timeout_s: float = 240.0, cwd: Path | None = None
) -> tuple[dict[str, Any], str]:
    """Run the job with ``overrides`` into ``out``; its ``summary.json`` and stdout.

    Fails the test (with the end of the job's output) if the job fails;
    ``data_dir`` is where MNIST is (default: ``$PSDK_DATA_DIR`` or the cache).
    """
    env = dict(os.environ)
    if data_dir is not None:
        env["PSDK_DATA_DIR"] = str(data_dir)
    done = subprocess.run(
        [sys.executable, "-m", "psdk", "run", *overrides, *FAST_HEARTBEATS, f"hydra.run.dir={out}"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=cwd,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), done.stdout
