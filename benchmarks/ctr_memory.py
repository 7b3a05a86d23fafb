"""Each ps's peak memory in a real ``workload=ctr`` job, against the bound 1.5 x rows x (row + slot bytes) + 150 MB.

Runs ``python -m psdk run workload=ctr`` (2 ps, 2 async workers) and, every
0.2 s while it runs, reads each ps process's ``VmHWM`` (``/proc/<pid>/status``,
the peak resident set since it started) beside the rows its table holds
(``tasks/ps<i>.progress.json``, which the ps rewrites a few times a second);
the pids come from ``tasks/ps<i>.pid``, rewritten when the launcher restarts a
ps. So a killed ps and the process that replaced it are two lines, each with
its own peak and the most rows it held. After the job, ``summary.json``'s
per-ps ``max_rss_mb`` (the ps's own VmHWM, read at the end) is taken too.

The bound per ps process: ``1.5 x rows held x (row bytes + slot bytes) + 150 MB``
(MB = 10^6 bytes), rows held being the most that process held; row bytes are
``4 x dim``, slot bytes the rule's slots (Adagrad: one slot, the row's bytes;
Adam: two). The ratio VmHWM / bound must be at most 1.0.

Cases (``--case``):

* ``lazy``: a table over 10 million ids, hash-sharded, rows created on first
  touch; a flat id distribution (``workload.zipf=0.1``) and batches of 4,096
  make about 2.3 million rows per ps in 320 steps; a checkpoint every 100
  steps, and the final one.
* ``lazy-restore``: the same, with ps 1 killed at its 250th update (after the
  checkpoint at 200): the launcher restarts it, the chief restores it from
  that checkpoint and rolls ps 0 back to it, and the job trains on.
* ``preallocated``: ``+tables.emb.sharding=range +tables.emb.preallocate=true``,
  10 million x 16 rows, 5 million per ps made on the ps from the seed at init;
  10 steps, then the final checkpoint (all 10 million rows, read a chunk at a time).
* ``preallocated-resume``: a new job resumed from ``preallocated``'s
  checkpoint (each ps restored from it at init: its table is never filled
  from the seed first), trained to step 20 and checkpointed again.

Usage: ``nice -n 19 python benchmarks/ctr_memory.py --case lazy [--backend numpy] [--out DIR] [key=value ...]``
(extra ``key=value`` overrides go to the job). 4 to 5 minutes a preallocated case, 24 for lazy-restore, on
the 2-core development machine shared with six other jobs (load 25 to 30).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psdk.bench.ctr import BUSY_PS_TIMEOUTS, PREALLOCATED_TABLE

MB = 1e6
BASE_MB = 150.0
TEN_MILLION = 10_000_000
COMMON = [
    "workload=ctr", "topology.num_ps=2", "topology.num_workers=2", f"model.capacity={TEN_MILLION}",
    f"workload.vocab={TEN_MILLION}", "workload.test_size=2000", "workload.validation_size=0",
    "train.validate_every=0", "progress.mode=plain", "checkpoint.every_seconds=0", "checkpoint.keep=2",
]  # fmt: skip
LAZY = [*COMMON, "workload.zipf=0.1", "train.batch_size=4096", "train.steps=320", "checkpoint.every_steps=100"]
PREALLOCATED = [
    *COMMON, *PREALLOCATED_TABLE, "train.batch_size=1024", "train.steps=10", "checkpoint.every_steps=0",
    *BUSY_PS_TIMEOUTS,
]  # fmt: skip
"""Every row made at init: with the timeouts a ps busy making its 5 million rows needs (``BUSY_PS_TIMEOUTS``)."""
CASES: dict[str, tuple[list[str], str | None]] = {
    "lazy": (LAZY, None),
    "lazy-restore": (LAZY, "ps1/ps.update@250"),
    "preallocated": (PREALLOCATED, None),
    "preallocated-resume": ([*PREALLOCATED, "train.steps=20"], None),
}
SLOTS = {"adagrad": 1, "adagrad_ctr": 1, "adam": 2, "momentum": 1, "sgd": 0, "rmsprop": 1}


@dataclass
class Process:
    """One ps process as sampled: its task, pid, peak memory and the most rows its table held."""

    task: int
    pid: int
    hwm_kb: int = 0
    rows: int = 0
    alive: bool = True
    seen: float = field(default_factory=time.time)
    """When its pid first appeared: an older progress file is its predecessor's (a restarted ps)."""
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, VmRSS kB, rows held) at each sample: where in the job the memory goes."""


def read_kb(pid: int, key: str = "VmHWM") -> int | None:
    """A ``/proc/<pid>/status`` field in kB (``VmHWM``: the peak resident set); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Polls every ps's pid file, VmHWM and progress file until stopped."""

    def __init__(self, out: Path, num_ps: int, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.out, self.num_ps, self.every_s = out, num_ps, every_s
        self.processes: dict[int, Process] = {}
        self.stop = threading.Event()

    def sample(self) -> None:
        for task in range(self.num_ps):
            try:
                pid = int((self.out / "tasks" / f"ps{task}.pid").read_text())
            except (OSError, ValueError):
                continue
            proc = self.processes.setdefault(pid, Process(task, pid))
            hwm, rss = read_kb(pid), read_kb(pid, "VmRSS")
            if hwm is None:
                proc.alive = False
                continue
            proc.hwm_kb = max(proc.hwm_kb, hwm)
            try:
                progress = json.loads((self.out / "tasks" / f"ps{task}.progress.json").read_text())
                if float(progress.get("time", 0)) >= proc.seen and progress.get("table_rows"):
                    proc.rows = max(proc.rows, sum(int(r) for r in progress["table_rows"].values()))
            except (OSError, ValueError):
                pass
            proc.timeline.append((time.time(), rss or 0, proc.rows))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.every_s)


def run_case(case: str, backend: str, out: Path, extra: list[str], resume: Path | None) -> dict[str, Any]:
    overrides, kill = CASES[case]
    last = {o.split("=", 1)[0]: o for o in [*overrides, f"backend={backend}", *extra]}  # a later one wins
    args = [*last.values(), f"hydra.run.dir={out}"]
    if resume is not None:
        args.append(f"resume={resume}")
    env = dict(os.environ)
    if kill:
        env["PSDK_FAILPOINT"] = f"{kill}:{out / 'killed.marker'}"
    out.mkdir(parents=True, exist_ok=True)
    sampler = Sampler(out, 2)
    started = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "psdk", "run", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    sampler.start()
    log = job.communicate()[0]
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join(timeout=5)
    (out / "job.log").write_text(log)
    if job.returncode != 0:
        sys.exit(f"{case}: the job failed ({job.returncode}); the end of its output:\n{log[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    optimizer = str(summary["rule_applied"]["name"])
    return {"case": case, "wall_s": wall, "summary": summary, "optimizer": optimizer, "dim": dim_of(args),
            "processes": list(sampler.processes.values())}  # fmt: skip


def dim_of(args: list[str]) -> int:
    """The table's width: ``model.dim`` if overridden, else the dlrm model's 16."""
    given = [int(a.split("=", 1)[1]) for a in args if a.startswith("model.dim=")]
    return given[-1] if given else 16


def report(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per ps process: rows, bytes, bound, VmHWM, ratio."""
    summary = result["summary"]
    row_bytes = 4 * result["dim"]
    slot_bytes = SLOTS[result["optimizer"]] * row_bytes
    final = {i: entry for i, entry in enumerate(summary["ps"])}
    lines = []
    latest = {p.task: p.pid for p in result["processes"]}  # in the order they were seen: the last one ran to the end
    for proc in sorted(result["processes"], key=lambda p: (p.task, p.seen)):
        ps = final.get(proc.task, {})
        last = proc.pid == latest[proc.task]
        rows = max(proc.rows, int(ps.get("tables", {}).get("emb", {}).get("rows", 0)) if last else 0)
        hwm_mb = proc.hwm_kb * 1024 / MB
        if last and ps.get("max_rss_mb"):
            hwm_mb = max(hwm_mb, float(ps["max_rss_mb"]) * 2**20 / MB)
        bound = (1.5 * rows * (row_bytes + slot_bytes)) / MB + BASE_MB
        lines.append({"ps": proc.task, "pid": proc.pid, "process": "killed" if not last else "final",
                      "rows": rows, "row_bytes": row_bytes, "slot_bytes": slot_bytes, "bound_mb": bound,
                      "vmhwm_mb": hwm_mb, "ratio": hwm_mb / bound})  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="lazy")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--out", type=Path, default=None, help="a folder for the runs (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the job")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="psdk-ctr-memory-"))
    cases = list(CASES) if args.case == "all" else [args.case]
    print("| case | ps | process | rows held | row B | slot B | bound MB | VmHWM MB | VmHWM / bound | job wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for case in cases:
        resume = None
        if case == "preallocated-resume":
            resume = root / "preallocated" / "checkpoints"
            if not resume.is_dir():
                sys.exit(f"{case} resumes the preallocated case's checkpoints: run --case preallocated first")
        result = run_case(case, args.backend, root / case, args.overrides, resume)
        for line in report(result):
            failed |= line["ratio"] > 1.0
            print(f"| {case} | {line['ps']} | {line['process']} | {line['rows']:,} | {line['row_bytes']} "
                  f"| {line['slot_bytes']} | {line['bound_mb']:.0f} | {line['vmhwm_mb']:.0f} | {line['ratio']:.2f} "
                  f"| {result['wall_s']:.0f} |", flush=True)  # fmt: skip
        timelines = {str(p.pid): p.timeline for p in result["processes"]}
        (root / case / "memory.json").write_text(json.dumps({"ps": report(result), "timelines": timelines}))
    print(f"\nruns in {root}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
