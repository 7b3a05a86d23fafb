"""Where a job's wall time goes besides training: start-up and wrap-up of ``python -m psdk run``, by phase.

Runs the command ``--reps`` times, one after the other (the first finds the
caches as they are, the others warm), each in its own folder, and splits
each run's wall time, as the process running it saw it, at moments read from
the run's files:

* **launcher**: the command starting until the launcher started the first
  task (its pid file);
* **tasks up**: until the ps applied its first update (every worker
  imported its framework, read its data, connected; the chief initialised);
* **training**: the ps's first applied update to its last (``training_s``
  in ``summary.json``), the figure the others are measured against;
* **wrap-up**: the last update until the command returned (the chief's
  evaluation and results, the tasks' exits, the figure, the last line).

It prints one row per run and the median of the warm runs, with the
overhead (wall minus training). With ``--cold`` (root only) the kernel's
page cache is dropped before the first run, which then reads Python,
torch and MNIST from disk as after a reboot. Usage:
``python benchmarks/startup.py [--reps 4] [--cold] [overrides...]``, with
``PSDK_DATA_DIR`` set or MNIST in psdk's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("launcher", "tasks up", "training", "wrap-up")


def one_run(folder: Path, overrides: list[str]) -> dict[str, float]:
    command = [sys.executable, "-m", "psdk", "run", "progress.mode=off", f"hydra.run.dir={folder}", *overrides]
    began = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    first_task = min(p.stat().st_mtime for p in (folder / "tasks").glob("*.pid"))
    training = float(summary["training_s"])
    first_update = float(summary["training_began"])  # the ps's first applied update, wall-clock
    return {
        "launcher": first_task - began,
        "tasks up": first_update - first_task,
        "training": training,
        "wrap-up": ended - (first_update + training),
        "wall": ended - began,
        "overhead": ended - began - training,
        "accuracy": float(summary["test_accuracy"]),
    }


def drop_page_cache() -> None:
    """Written pages to disk, then every clean page out of memory: the next run reads its files from disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold drops the page cache, which needs root: {exc}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=4, help="runs; the first is cold-ish, the rest warm")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the first run (root)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. backend=tf")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="psdk-startup-") as tmp:
        for rep in range(args.reps):
            if rep == 0 and args.cold:
                drop_page_cache()
            rows.append(one_run(Path(tmp) / f"run{rep}", args.overrides))
    columns = [*PHASES, "wall", "overhead"]
    print(f"python -m psdk run {' '.join(args.overrides)}: seconds by phase")
    print("| run | " + " | ".join(columns) + " | test accuracy |")
    print("|---" * (len(columns) + 2) + "|")
    for number, row in enumerate(rows):
        label = ("cold" if args.cold else "first") if number == 0 else f"warm {number}"
        print(f"| {label} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + f" | {row['accuracy']:.4f} |")
    warm = rows[1:] or rows
    median = {c: statistics.median(r[c] for r in warm) for c in columns}
    print("| warm median | " + " | ".join(f"{median[c]:.2f}" for c in columns) + " | |")
    print(f"warm overhead (wall - training): {median['overhead']:.2f} s")


if __name__ == "__main__":
    main()
