"""Test accuracy of one recipe as an async job grows: by worker count and ps count, over seeds.

A recipe that suits 2 async workers can overshoot with 8: asynchrony adds
momentum of its own (Mitliagkas et al. 2016). This runs ``python -m psdk run``
for every worker count, ps count and seed asked, one run after the other,
and prints one row per (workers, ps): the accuracy of each seed, their
median and minimum, the median global steps/s, the median staleness p50 of
the chief's gradients, and whether the job said it diverged. Usage::

    python benchmarks/worker_scaling.py [--workers 1,2,4,8] [--ps 1,2] [--seeds 0-4] [overrides...]

with ``PSDK_DATA_DIR`` set or MNIST in psdk's cache; overrides go to every
run (``backend=numpy``, ``optimizer.momentum=0.5``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def one_run(folder: Path, workers: int, ps: int, seed: int, overrides: list[str]) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "psdk", "run", "progress.mode=off", "report.plot=false", f"hydra.run.dir={folder}",
        f"topology.num_workers={workers}", f"topology.num_ps={ps}", f"seed={seed}", *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    chief = summary["workers"].get("0", {})
    return {
        "accuracy": float(summary["test_accuracy"]),
        "steps_per_s": float(summary.get("global_steps_per_s") or 0.0),
        "staleness_p50": chief.get("staleness_p50"),
        "diverged": bool(summary.get("divergence")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--ps", default="1,2")
    parser.add_argument("--seeds", default="0-4")
    args, overrides = parser.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="psdk-scaling-") as scratch:
        for workers in (int(w) for w in args.workers.split(",")):
            for ps in (int(p) for p in args.ps.split(",")):
                runs = []
                for seed in seeds_of(args.seeds):
                    began = time.monotonic()
                    run = one_run(Path(scratch) / f"w{workers}-p{ps}-s{seed}", workers, ps, seed, overrides)
                    runs.append(run)
                    print(
                        f"# workers={workers} ps={ps} seed={seed}: accuracy {run['accuracy']:.4f}, "
                        f"{run['steps_per_s']:.0f} steps/s, staleness p50 {run['staleness_p50']} "
                        f"({time.monotonic() - began:.0f} s)",
                        flush=True,
                    )
                rows.append((workers, ps, runs))
    print(f"\noverrides: {' '.join(overrides) or '(none)'}\n")
    print("| workers | ps | accuracy by seed | median | min | global steps/s (median) | staleness p50 | diverged |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for workers, ps, runs in rows:
        accuracies = [r["accuracy"] for r in runs]
        staleness = [r["staleness_p50"] for r in runs if r["staleness_p50"] is not None]
        print(
            f"| {workers} | {ps} | {', '.join(f'{a:.4f}' for a in accuracies)} | {statistics.median(accuracies):.4f} "
            f"| {min(accuracies):.4f} | {statistics.median(r['steps_per_s'] for r in runs):.0f} "
            f"| {statistics.median(staleness) if staleness else 'n/a'} | {sum(r['diverged'] for r in runs)} |"
        )


if __name__ == "__main__":
    main()
