"""The benchmark suite behind ``python -m psdk bench``.

Every system runs the same workload as its own set of processes, and the
runs are interleaved (every system once, then every system again, ...), so a
slow minute on a shared machine hurts all systems alike; each figure is the
median of ``reps`` runs and every ratio divides by a baseline measured in
this same invocation. The peers (TensorFlow 1.x ps/worker, a torch RPC
parameter server, DDP) are scripts in ``benchmarks/peers/`` that print one
JSON line; they bind every interface, so by default they run in a network
namespace of their own with only loopback (``unshare -n``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.bench import flood, load, transport
from psdk.errors import ConfigError
from psdk.ps.consistency import SyncSpec
from psdk.report.metrics import write_json_atomic

log = logging.getLogger(__name__)


@dataclass
class Run:
    """One run of one system, as every system reports it."""

    system: str
    framework: str
    mode: str
    updates_per_s: float | None = None
    test_accuracy: float | None = None
    wall_s: float | None = None
    ps_max_rss_mb: float | None = None
    staleness_p50: float | None = None
    staleness_p99: float | None = None
    error: str | None = None


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this psdk runs from."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "peers").is_dir():
        raise ConfigError(
            "peers",
            f"the peer scripts are not in {folder / 'peers'}: run the benchmark from a "
            "source checkout of psdk, or set peers=[]",
        )
    return folder


def _env(data_dir: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if data_dir:
        env["PSDK_DATA_DIR"] = str(data_dir)
    return env


def can_isolate() -> bool:
    """Whether ``unshare -n`` works here (root, or user namespaces allowed)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10, check=False)
    return probe.returncode == 0


def run_psdk(
    cfg: DictConfig,
    backend: str,
    mode: str,
    num_workers: int = 2,
    num_ps: int = 1,
    secure: bool = True,
    overlap: bool = False,
    frames: bool = False,
) -> Run:
    """psdk's own job through its CLI; figures from the summary the chief writes.

    As it runs by default: CURVE on (``secure=False`` for the comparison),
    shared memory between the tasks (``frames`` turns it off: every array
    goes through ZeroMQ frames, as between hosts).
    """
    system = f"psdk-{backend}" + ("" if secure else " (CURVE off)") + (" (frames)" if frames else "")
    label = f"{mode}+overlap" if overlap else mode
    with tempfile.TemporaryDirectory(prefix="psdk-bench-") as tmp:
        command = [
            sys.executable, "-m", "psdk", "run", f"backend={backend}", f"sync={mode}", "optimizer=sgd",
            f"optimizer.lr={cfg.lr}", f"train.steps={cfg.steps}", f"train.batch_size={cfg.batch_size}",
            "train.validate_every=0", f"train.log_every={10 * int(cfg.steps)}", "train.threads=1",
            "checkpoint.final=false", f"topology.num_workers={num_workers}", f"topology.num_ps={num_ps}",
            f"seed={cfg.seed}", *cfg.psdk_overrides, f"transport.secure={str(secure).lower()}",
            f"train.overlap={str(overlap).lower()}", f"transport.shared_memory={str(not frames).lower()}",
            f"hydra.run.dir={tmp}",
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=float(cfg.timeout_s), env=_env(cfg.data_dir), check=False
        )
        summary_path = Path(tmp) / "summary.json"
        if done.returncode != 0 or not summary_path.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return Run(system, backend, label, error=f"exit {done.returncode}: {' | '.join(tail)}")
        summary = json.loads(summary_path.read_text())
    stale = [w for w in summary["workers"].values() if w.get("staleness_p50") is not None]
    return Run(
        system=system,
        framework=backend,
        mode=label,
        updates_per_s=summary["global_steps_per_s"],
        test_accuracy=summary["test_accuracy"],
        wall_s=summary["wall_s"],
        ps_max_rss_mb=max((p.get("max_rss_mb") or 0.0) for p in summary["ps"]) or None,
        staleness_p50=max((w["staleness_p50"] for w in stale), default=None),
        staleness_p99=max((w["staleness_p99"] for w in stale), default=None),
    )


def run_script(cfg: DictConfig, script: str, mode: str, extra: Sequence[str] = (), isolate: bool = False) -> Run:
    """A peer script of ``benchmarks/peers``, which prints its figures as one JSON line."""
    path = benchmarks_dir() / "peers" / f"{script}.py"
    args = [
        sys.executable,
        str(path),
        "--mode",
        mode,
        "--steps",
        str(cfg.steps),
        "--batch",
        str(cfg.batch_size),
        "--lr",
        str(cfg.lr),
        "--workers",
        "2",
        "--seed",
        str(cfg.seed),
        "--timeout",
        str(cfg.timeout_s),
        *extra,
    ]
    if cfg.data_dir:
        args += ["--data", str(cfg.data_dir)]
    if isolate:
        args = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "peer", *args]
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=float(cfg.timeout_s) + 60, env=_env(cfg.data_dir), check=False
        )
    except subprocess.TimeoutExpired:
        return Run(script, "?", mode, error="timed out")
    lines = done.stdout.strip().splitlines()
    try:
        figures = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = done.stderr.strip().splitlines()[-3:]
        return Run(script, "?", mode, error=f"exit {done.returncode}: {' | '.join(tail)}")
    return Run(
        system=str(figures.get("system", script)),
        framework=str(figures.get("framework", "?")),
        mode=mode,
        updates_per_s=figures.get("updates_per_s"),
        test_accuracy=figures.get("test_accuracy"),
        wall_s=figures.get("wall_s"),
        ps_max_rss_mb=figures.get("ps_max_rss_mb"),
    )


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    """Medians of one system in one mode, and its ratio to the baseline of its framework."""

    system: str
    framework: str
    mode: str
    runs: int
    failed: int
    updates_per_s: float | None
    ratio: float | None
    test_accuracy: float | None
    wall_s: float | None
    ps_max_rss_mb: float | None
    staleness_p50: float | None
    staleness_p99: float | None


# psdk backends by the name the peer scripts give their framework.
FRAMEWORKS = {"tf": "tensorflow"}


def summarise(runs: Sequence[Run], baselines: dict[str, float | None]) -> Row:
    ok = [r for r in runs if r.error is None]
    first = runs[0]
    rate = median([r.updates_per_s for r in ok])
    base = baselines.get(FRAMEWORKS.get(first.framework, first.framework))
    if base is None:  # no single run of its own framework: compare with single torch, as the issue's table does
        base = baselines.get("torch")
    system, framework = (first.system, first.framework) if not ok else (ok[0].system, ok[0].framework)
    return Row(
        system=f"single-{framework}" if system == "single" else system,  # one baseline row per framework
        framework=framework,
        mode=first.mode,
        runs=len(runs),
        failed=len(runs) - len(ok),
        updates_per_s=rate,
        ratio=rate / base if rate is not None and base else None,
        test_accuracy=median([r.test_accuracy for r in ok]),
        wall_s=median([r.wall_s for r in ok]),
        ps_max_rss_mb=median([r.ps_max_rss_mb for r in ok]),
        staleness_p50=median([r.staleness_p50 for r in ok]),
        staleness_p99=median([r.staleness_p99 for r in ok]),
    )


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(rows: Sequence[Row]) -> str:
    head = (
        "| system | mode | updates/s | ÷ single | test accuracy | wall s | ps RSS MB | staleness p50/p99 "
        "| runs |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for r in rows:
        stale = "—" if r.staleness_p50 is None else f"{r.staleness_p50:.0f}/{r.staleness_p99:.0f}"
        failed = f" ({r.failed} failed)" if r.failed else ""
        lines.append(
            f"| {r.system} | {r.mode} | {_fmt(r.updates_per_s, '.0f')} | {_fmt(r.ratio, '.2f')}× | "
            f"{_fmt(r.test_accuracy, '.4f')} | {_fmt(r.wall_s, '.1f')} | {_fmt(r.ps_max_rss_mb, '.0f')} | "
            f"{stale} | {r.runs}{failed} |"
        )
    return "\n".join(lines)


def transport_table(results: Sequence[dict[str, Any]]) -> str:
    """psdk as it runs on one host (shared memory) and over ZeroMQ frames only (as between hosts)."""
    lines = [
        "| floats | MB | raw pyzmq round trips/s | psdk (shared memory) | ÷ raw | psdk (frames) | ÷ raw "
        "| raw MB/s | psdk MB/s (shm / frames) | CPU µs/rt raw (client+server) | CPU µs/rt psdk (shm / frames) "
        "| psdk ps RSS MB (shm / frames) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cpu(side: dict[str, Any]) -> float:
        return float(side["client_cpu_us"] + side["server_cpu_us"])

    for r in results:
        raw, ours, frames = r["raw"], r["psdk"], r["psdk-frames"]
        lines.append(
            f"| {r['size']:,} | {r['mbytes']:.1f} | {raw['round_trips_per_s']:.0f} | {ours['round_trips_per_s']:.0f} | "
            f"{r['ratio']:.2f}× | {frames['round_trips_per_s']:.0f} | {r['ratio_frames']:.2f}× | "
            f"{raw['megabytes_per_s']:.0f} | {ours['megabytes_per_s']:.0f} / {frames['megabytes_per_s']:.0f} | "
            f"{cpu(raw):.0f} | {cpu(ours):.0f} / {cpu(frames):.0f} | "
            f"{_fmt(ours.get('server_max_rss_mb'), '.0f')} / {_fmt(frames.get('server_max_rss_mb'), '.0f')} |"
        )
    return "\n".join(lines)


def curve_table(results: Sequence[dict[str, Any]]) -> str:
    """CURVE's cost: round trips/s and CPU per round trip with it off and on, one host and between hosts."""
    lines = [
        "| floats | path | round trips/s off / on | ÷ | CPU µs/rt (client+server) off / on | ÷ |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for kind, path in (("psdk", "shared memory (one host)"), ("psdk-frames", "frames (between hosts)")):
            side = r[kind]
            lines.append(
                f"| {r['size']:,} | {path} | {side['off']['round_trips_per_s']:.0f} / "
                f"{side['on']['round_trips_per_s']:.0f} | {side['rate_ratio']:.2f}× | {side['off']['cpu_us']:.0f} / "
                f"{side['on']['cpu_us']:.0f} | {side['cpu_ratio']:.2f}× |"
            )
    return "\n".join(lines)


def interleave(plan: dict[str, Callable[[], Run]], reps: int) -> dict[str, list[Run]]:
    """Every item once per repetition, in the same order, so drift hits all alike."""
    runs: dict[str, list[Run]] = {key: [] for key in plan}
    for rep in range(reps):
        for key, run in plan.items():
            started = time.monotonic()
            result = run()
            runs[key].append(result)
            status = result.error or (
                f"{_fmt(result.updates_per_s, '.0f')} updates/s, accuracy {_fmt(result.test_accuracy, '.4f')}"
            )
            log.info("bench: rep %d/%d %s: %s (%.0f s)", rep + 1, reps, key, status, time.monotonic() - started)
    return runs


def run_suite(cfg: DictConfig, out: Path) -> dict[str, Any]:
    isolate = bool(cfg.isolate_peers) and can_isolate()
    if cfg.isolate_peers and not isolate:
        log.warning("bench: cannot create a network namespace here (unshare -n); peers run unisolated")
    plan: dict[str, Callable[[], Run]] = {}
    for backend in cfg.backends:
        plan[f"single-{backend}"] = functools.partial(run_script, cfg, "single", "async", ["--framework", backend])
    for backend in cfg.backends:
        for mode in cfg.modes:
            plan[f"psdk-{backend}-{mode}"] = functools.partial(run_psdk, cfg, backend, mode)
            if cfg.overlap and SyncSpec(mode).allows_overlap:
                plan[f"psdk-{backend}-{mode}-overlap"] = functools.partial(run_psdk, cfg, backend, mode, overlap=True)
        if cfg.frames:
            plan[f"psdk-{backend}-async-frames"] = functools.partial(run_psdk, cfg, backend, "async", frames=True)
        if cfg.curve:
            plan[f"psdk-{backend}-async-curve-off"] = functools.partial(run_psdk, cfg, backend, "async", secure=False)
    for peer in cfg.peers:
        for mode in cfg.modes:
            if peer == "torch_ddp" and not SyncSpec(mode).waits_for_rounds:
                continue  # allreduce has rounds only: no async, no bounded staleness
            plan[f"{peer}-{mode}"] = functools.partial(run_script, cfg, peer, mode, isolate=isolate)
    runs = interleave(plan, int(cfg.reps))
    singles = {key.removeprefix("single-"): summarise(r, {}) for key, r in runs.items() if key.startswith("single-")}
    baselines = {FRAMEWORKS.get(fw, fw): row.updates_per_s for fw, row in singles.items()}
    rows = [summarise(runs[key], baselines) for key in plan]
    report: dict[str, Any] = {
        "workload": {
            "steps": cfg.steps,
            "batch_size": cfg.batch_size,
            "lr": cfg.lr,
            "reps": cfg.reps,
            "peers_isolated": isolate,
        },
        "rows": [asdict(r) for r in rows],
        "runs": {key: [asdict(r) for r in rs] for key, rs in runs.items()},
    }
    note = (
        "Every ratio divides by the single-process run of the same framework in this invocation; "
        "TensorFlow peers by single torch when no single TensorFlow run was asked for (`backends: [torch, tf]`)."
    )
    sections = ["## Training throughput (medians)", note, markdown_table(rows)]
    if cfg.transport:
        results = [
            transport.compare(int(size), transport_count(int(size)), reps=int(cfg.transport_reps))
            for size in cfg.transport_sizes
        ]
        report["transport"] = results
        sections += ["## Transport: push-and-pull against raw pyzmq (medians)", transport_table(results)]
    if cfg.curve:
        costs = [transport.curve_cost(int(size), transport_count(int(size)), reps=int(cfg.curve_reps))
                 for size in cfg.transport_sizes[:1]]  # fmt: skip
        report["curve"] = costs
        sections += [
            f"## CURVE: push-and-pull with it off and on (medians of {cfg.curve_reps} interleaved runs)",
            curve_table(costs),
        ]
    if cfg.load:
        loaded = load.run(clients=16, replicas=12, seconds=float(cfg.load_seconds))
        report["load"] = load.summary(loaded)
        sections += [
            "## Load: 16 clients, one ps, sync (replicas_to_aggregate=12)",
            "\n".join(f"- {line}" for line in loaded.lines()),
        ]
    if cfg.flood:
        flooded = flood.run(connections=16, seconds=float(cfg.flood_seconds))
        report["flood"] = flood.summary(flooded)
        sections += [
            "## Flood: 16 hostile connections against one ps, peak memory against its bound",
            "\n".join(f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}" for line in flooded.lines()),
        ]
    if cfg.scaling:
        scaling = {
            f"{m} workers={w} ps={p}": [run_psdk(cfg, cfg.backends[0], m, w, p) for _ in range(int(cfg.reps))]
            for m in cfg.modes
            for w in cfg.scaling_workers
            for p in cfg.scaling_ps
        }
        report["scaling"] = {k: [asdict(r) for r in v] for k, v in scaling.items()}
        labelled = [
            dataclasses.replace(summarise(v, baselines), system=f"psdk-{cfg.backends[0]} {k.split(' ', 1)[1]}")
            for k, v in scaling.items()
        ]
        sections += ["## Scaling (psdk, medians)", markdown_table(labelled)]
    text = "\n\n".join(sections) + "\n"
    (out / "bench.md").write_text(text)
    write_json_atomic(out / "bench.json", report)
    print(text, flush=True)
    return report


def transport_count(size: int) -> int:
    """Round trips per measurement: a couple of seconds' worth at ~1 GB/s, 20 to 3000."""
    return max(20, min(3000, int(2e9 / (size * 4 * 2))))
