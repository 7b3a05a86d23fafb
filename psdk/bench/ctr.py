"""The click-through suite of ``python -m psdk bench suite=ctr``: psdk against the CTR peers.

Every system trains ``workload=ctr`` alike (``benchmarks/peers/_ctr.py``):
the same generated click log, DLRM, batch, Adagrad and test set; psdk as
``python -m psdk run workload=ctr`` with the settings under ``ctr:`` in
``conf/bench.yaml``, each peer as its script. Runs are interleaved and every
figure is a median. psdk is measured as the peers measure themselves
(:mod:`psdk.bench.window`): between the chief's warm-up and the first worker
finishing, examples counted from each step's end, CPU summed over every
process of the job. The table puts the throughput beside the single process,
the CPU per example beside TensorFlow 1.x's and the RPC server's (the
issue's primary target: steadier than throughput on a shared machine), and
flags an AUC more than 0.005 from the single process's (no strawman peers).
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from psdk.bench import window
from psdk.bench.suite import _env, _fmt, benchmarks_dir, can_isolate, median
from psdk.errors import ConfigError
from psdk.report.metrics import write_json_atomic

log = logging.getLogger(__name__)

SINGLE, TF1, RPC = "ctr_single", "ctr_tf1_ps_worker", "ctr_torch_rpc_ps"
"""The peers the ratios divide by (their scripts' names in ``benchmarks/peers``)."""
FAIR_AUC = 0.005
"""A system whose test AUC is further than this from the single process's is flagged."""
TIME_SPLIT_KEY = "time_split"
"""Where a system reports where its time goes: the peers' JSON key, and psdk's ``summary.json`` key if it has one."""


@dataclass
class CtrRun:
    """One run of one system, in the CTR peers' figures (``_ctr.KEYS``)."""

    system: str
    framework: str = "?"
    examples: int | None = None
    examples_per_s: float | None = None
    cpu_s_per_1k_examples: float | None = None
    cpu_split: dict[str, float] = field(default_factory=dict)
    test_auc: float | None = None
    test_logloss: float | None = None
    best_auc: float | None = None
    wall_s: float | None = None
    ps_max_rss_mb: float | None = None
    table_rows: int | None = None
    """Rows psdk's table held at the end (every one when preallocated; those pulled when lazy)."""
    time_split: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def recipe_flags(ctr: DictConfig) -> list[str]:
    """The recipe as the peers' flags (``_ctr.parser``)."""
    return [
        "--steps", str(ctr.steps), "--batch", str(ctr.batch_size), "--lr", str(ctr.lr),
        "--workers", str(ctr.workers), "--num-ps", str(ctr.num_ps), "--vocab", str(ctr.vocab),
        "--capacity", str(ctr.capacity), "--dim", str(ctr.dim), "--init-acc", str(ctr.init_acc),
        "--test-size", str(ctr.test_size), "--warmup", str(ctr.warmup), "--threads", "1",
    ]  # fmt: skip


PLAINTEXT = "-plaintext"
"""The suffix of a psdk row run with ``transport.secure=false`` (``ctr.plaintext``): the peers encrypt nothing."""
LAZY = "-lazy"
"""The suffix of a psdk row whose table makes rows on their first pull (``ctr.lazy``), hash-sharded."""
PREALLOCATED_TABLE = ["+tables.emb.sharding=range", "+tables.emb.preallocate=true"]
"""psdk's table as the peers have theirs (``ctr.preallocate``): every row made on its ps at init, in contiguous
blocks (TensorFlow 1.x's ``fixed_size_partitioner`` variable, the RPC server's tensor)."""
BUSY_PS_TIMEOUTS = [
    "transport.heartbeat_timeout_s=240", "liveness.stall_timeout_s=300", "ps.idle_timeout_s=900",
    "recovery.timeout_s=900",
]  # fmt: skip
"""A ps making its 5 million rows at init answers no heartbeat until done: over the default 10 s on a loaded
2-core machine, so the chief would take it for dead (docs/ctr.md). The liveness and idle timeouts must exceed
the heartbeat timeout (and recovery.timeout_s the liveness one), so they move too."""


def preallocates(ctr: DictConfig) -> bool:
    """Whether psdk's rows run with :data:`PREALLOCATED_TABLE` (``ctr.preallocate``); the lazy row never does."""
    return bool(ctr.get("preallocate", False))


def psdk_system(backend: str, plaintext: bool = False, lazy: bool = False) -> str:
    """A psdk row's name: ``psdk-<backend>``, then ``-plaintext`` and ``-lazy`` for those runs."""
    return f"psdk-{backend}{PLAINTEXT if plaintext else ''}{LAZY if lazy else ''}"


def psdk_command(
    ctr: DictConfig, backend: str, seed: int, run_dir: str, plaintext: bool = False, lazy: bool = False
) -> list[str]:
    """``python -m psdk run workload=ctr`` with the recipe; each worker's step ends (``report.step_ends``), kept in
    memory as the peers keep theirs, give the window its steps."""
    table = [*PREALLOCATED_TABLE, *BUSY_PS_TIMEOUTS] if preallocates(ctr) and not lazy else []
    return [
        sys.executable, "-m", "psdk", "run", "workload=ctr", f"backend={backend}", "sync=async",
        f"seed={seed}", f"workload.seed={seed}", f"workload.vocab={ctr.vocab}", f"workload.test_size={ctr.test_size}",
        f"model.capacity={ctr.capacity}", f"model.dim={ctr.dim}", f"optimizer.lr={ctr.lr}",
        f"optimizer.initial_accumulator_value={ctr.init_acc}", f"train.steps={ctr.steps}",
        f"train.batch_size={ctr.batch_size}", "train.threads=1", "train.validate_every=0", "report.step_ends=true",
        f"topology.num_workers={ctr.workers}", f"topology.num_ps={ctr.num_ps}", "checkpoint.final=false",
        "checkpoint.every_seconds=0", "progress.mode=off", "report.plot=false", *table, *ctr.psdk_overrides,
        *(["transport.secure=false"] if plaintext else []), f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def task_names(run_dir: Path, launcher: int) -> dict[int, str]:
    """The job's processes by pid: the launcher, and each task from the launcher's ``tasks/<task>.pid``."""
    names = {launcher: "launcher"}
    for path in sorted((run_dir / "tasks").glob("*.pid")):
        try:
            names[int(path.read_text())] = path.stem
        except (OSError, ValueError):
            continue
    return names


def flat(found: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested split as one level: ``{"ps": {"rule_ms": 1}}`` is ``{"ps rule_ms": 1}``."""
    out: dict[str, Any] = {}
    for key, value in found.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key} "))
        else:
            out[f"{prefix}{key}"] = value
    return out


def found_time_split(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Where psdk's time went, as its summary says: its ``time_split`` if it has one, and each worker's step.

    The summary's keys are read as they are (a psdk without ``time_split`` has the workers' ``time_per_step``).
    """
    split: dict[str, Any] = {}
    if isinstance(summary.get(TIME_SPLIT_KEY), Mapping):
        split.update(flat(summary[TIME_SPLIT_KEY]))
    for index, worker in sorted(summary.get("workers", {}).items()):
        split.update(flat(worker.get("time_per_step") or {}, f"worker{index} "))
    return split


def run_psdk(cfg: DictConfig, backend: str, plaintext: bool = False, lazy: bool = False) -> CtrRun:
    """One psdk job, its window measured from outside (:mod:`psdk.bench.window`)."""
    ctr = cfg.ctr
    system = psdk_system(backend, plaintext, lazy)
    with tempfile.TemporaryDirectory(prefix="psdk-bench-ctr-") as tmp:
        run_dir = Path(tmp)
        started = time.time()
        with (run_dir / "job.log").open("w") as out:
            job = subprocess.Popen(
                psdk_command(ctr, backend, int(cfg.seed), tmp, plaintext, lazy), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=_env(None),
            )  # fmt: skip
            with window.CpuSampler(job.pid) as sampler:
                try:
                    code = job.wait(timeout=float(cfg.timeout_s))
                except subprocess.TimeoutExpired:
                    job.terminate()  # the launcher kills its tasks
                    job.wait(timeout=30)
                    return CtrRun(system, backend, error=f"timed out after {cfg.timeout_s} s")
                names = task_names(run_dir, job.pid)
        summary_path = run_dir / "summary.json"
        if code != 0 or not summary_path.exists():
            tail = (run_dir / "job.log").read_text(errors="replace").strip().splitlines()[-3:]
            return CtrRun(system, backend, error=f"exit {code}: {' | '.join(tail)}")
        summary = json.loads(summary_path.read_text())
        try:
            measured = window.measure(
                window.step_ends(run_dir / "step_ends.jsonl"), int(ctr.warmup) // int(ctr.workers),
                int(ctr.batch_size), sampler, names,
            )  # fmt: skip
        except ValueError as exc:
            return CtrRun(system, backend, error=str(exc))
    metrics = summary.get("metrics", {})
    return CtrRun(
        system=system,
        framework=backend,
        examples=int(summary["global_step"]) * int(ctr.batch_size),  # trained by the job, as the peers count them
        **measured.figures(),
        test_auc=metrics.get("auc"),
        test_logloss=metrics.get("logloss"),
        best_auc=metrics.get("best_auc"),
        wall_s=round(time.time() - started, 2),
        ps_max_rss_mb=max((p.get("max_rss_mb") or 0.0) for p in summary["ps"]) or None,
        table_rows=sum(int(t.get("rows", 0)) for t in summary.get("tables", {}).values()) or None,
        time_split=found_time_split(summary),
    )


def run_peer(cfg: DictConfig, script: str, isolate: bool) -> CtrRun:
    """A CTR peer of ``benchmarks/peers``, which prints its figures as one JSON line (``_ctr.KEYS``)."""
    path = benchmarks_dir() / "peers" / f"{script}.py"
    if not path.exists():
        return CtrRun(script, error=f"{path} does not exist")
    args = [sys.executable, str(path), "--mode", "async", *recipe_flags(cfg.ctr), "--seed", str(cfg.seed),
            "--timeout", str(cfg.timeout_s)]  # fmt: skip
    if isolate:
        args = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "peer", *args]
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=float(cfg.timeout_s) + 60, env=_env(None), check=False
        )
    except subprocess.TimeoutExpired:
        return CtrRun(script, error="timed out")
    try:
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = done.stderr.strip().splitlines()[-3:]
        return CtrRun(script, error=f"exit {done.returncode}: {' | '.join(tail)}")
    known = {k: figures.get(k) for k in CtrRun.__dataclass_fields__ if k not in ("system", "error")}
    known["cpu_split"], known["time_split"] = known["cpu_split"] or {}, flat(known["time_split"] or {})
    return CtrRun(system=str(figures.get("system") or script), **known)


# ---------------------------------------------------------------- medians, ratios, the table


@dataclass
class CtrRow:
    """Medians of one system's runs, and the ratios the issue's targets read."""

    key: str
    system: str
    runs: int
    failed: int
    examples_per_s: float | None
    cpu_s_per_1k_examples: float | None
    test_auc: float | None
    test_logloss: float | None
    best_auc: float | None
    ps_max_rss_mb: float | None
    cpu_split: dict[str, float]
    time_split: dict[str, float]
    vs_single: float | None = None
    cpu_vs_tf1: float | None = None
    cpu_vs_rpc: float | None = None
    auc_diff: float | None = None


def medians(dicts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Key by key, the median of the numbers the runs have for it."""
    keys = dict.fromkeys(k for d in dicts for k in d)
    out = {}
    for key in keys:
        found = median([float(d[key]) for d in dicts if isinstance(d.get(key), int | float)])
        if found is not None:
            out[key] = found
    return out


def summarise(key: str, runs: Sequence[CtrRun]) -> CtrRow:
    ok = [r for r in runs if r.error is None]
    return CtrRow(
        key=key,
        system=ok[0].system if ok else runs[0].system,
        runs=len(runs),
        failed=len(runs) - len(ok),
        examples_per_s=median([r.examples_per_s for r in ok]),
        cpu_s_per_1k_examples=median([r.cpu_s_per_1k_examples for r in ok]),
        test_auc=median([r.test_auc for r in ok]),
        test_logloss=median([r.test_logloss for r in ok]),
        best_auc=median([r.best_auc for r in ok]),
        ps_max_rss_mb=median([r.ps_max_rss_mb for r in ok]),
        cpu_split=medians([r.cpu_split for r in ok]),
        time_split=medians([r.time_split for r in ok]),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(rows: Sequence[CtrRow]) -> list[CtrRow]:
    """Each row's ratios to the single process (throughput, AUC) and to TF1 and the RPC server (CPU)."""
    by_key = {row.key: row for row in rows}
    single, tf1, rpc = by_key.get(SINGLE), by_key.get(TF1), by_key.get(RPC)
    for row in rows:
        row.vs_single = _ratio(row.examples_per_s, single.examples_per_s if single else None)
        row.cpu_vs_tf1 = _ratio(row.cpu_s_per_1k_examples, tf1.cpu_s_per_1k_examples if tf1 else None)
        row.cpu_vs_rpc = _ratio(row.cpu_s_per_1k_examples, rpc.cpu_s_per_1k_examples if rpc else None)
        if single is not None and single.test_auc is not None and row.test_auc is not None:
            row.auc_diff = row.test_auc - single.test_auc
    return list(rows)


def _auc_cell(row: CtrRow) -> str:
    if row.test_auc is None:
        return "—"
    if row.auc_diff is None:
        return f"{row.test_auc:.4f}"
    flag = f" **over {FAIR_AUC}**" if abs(row.auc_diff) > FAIR_AUC else ""
    return f"{row.test_auc:.4f} ({row.auc_diff:+.4f}{flag})"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def table(rows: Sequence[CtrRow]) -> str:
    lines = [
        "| system | examples/s | ÷ single | CPU s per 1k examples | ÷ TF1's | ÷ RPC's | test AUC (− single's) "
        "| ps VmHWM MB | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        failed = f" ({r.failed} failed)" if r.failed else ""
        lines.append(
            f"| {r.system} | {_fmt(r.examples_per_s, '.0f')} | {_times(r.vs_single)} | "
            f"{_fmt(r.cpu_s_per_1k_examples, '.3f')} | {_times(r.cpu_vs_tf1)} | {_times(r.cpu_vs_rpc)} | "
            f"{_auc_cell(r)} | {_fmt(r.ps_max_rss_mb, '.0f')} | {r.runs}{failed} |"
        )
    return "\n".join(lines)


def splits(rows: Sequence[CtrRow], attribute: str, spec: str) -> str:
    """One line per system: a dict of medians (``cpu_split`` or ``time_split``), key by key."""
    lines = []
    for r in rows:
        found = getattr(r, attribute)
        if found:
            lines.append(f"- {r.system}: " + ", ".join(f"{k} {format(v, spec)}" for k, v in found.items()))
    return "\n".join(lines) or "- (none reported)"


TARGETS = (
    ("CPU per example ≤ 0.5× TF1's", "cpu_vs_tf1", 0.5, False),
    ("CPU per example ≤ 0.67× the RPC server's", "cpu_vs_rpc", 0.67, False),
    ("examples/s > the single process's", "vs_single", 1.0, True),
)


def targets(rows: Sequence[CtrRow], tf1: CtrRow | None, rpc: CtrRow | None) -> str:
    """The issue's targets for each psdk row, met or missed, from the medians above."""
    lines = []
    for r in rows:
        if not r.key.startswith("psdk-"):
            continue
        checks = [(name, getattr(r, attr), bound, above) for name, attr, bound, above in TARGETS]
        for name, peer, bound in (("examples/s ≥ 1.5× TF1's", tf1, 1.5), ("examples/s ≥ 1.2× the RPC's", rpc, 1.2)):
            checks.append((name, _ratio(r.examples_per_s, peer.examples_per_s if peer else None), bound, True))
        auc_ok = None if r.auc_diff is None else abs(r.auc_diff) <= FAIR_AUC
        for name, value, bound, above in checks:
            verdict = "—" if value is None else ("met" if (value >= bound if above else value <= bound) else "missed")
            lines.append(f"- {r.system}: {name}: {_times(value)} ({verdict})")
        lines.append(f"- {r.system}: test AUC within {FAIR_AUC} of the single process's: "
                     f"{'—' if auc_ok is None else ('met' if auc_ok else 'missed')}")  # fmt: skip
    return "\n".join(lines)


def interleave(plan: Mapping[str, Callable[[], CtrRun]], reps: int) -> dict[str, list[CtrRun]]:
    """Every system once per repetition, in the same order, so a slow minute hurts all alike."""
    runs: dict[str, list[CtrRun]] = {key: [] for key in plan}
    for rep in range(reps):
        for key, run in plan.items():
            began = time.monotonic()
            result = run()
            runs[key].append(result)
            status = result.error or (
                f"{_fmt(result.examples_per_s, '.0f')} examples/s, {_fmt(result.cpu_s_per_1k_examples, '.3f')} "
                f"CPU s per 1k examples, AUC {_fmt(result.test_auc, '.4f')}"
            )
            log.info("bench ctr: rep %d/%d %s: %s (%.0f s)", rep + 1, reps, key, status, time.monotonic() - began)
    return runs


def check(cfg: DictConfig) -> None:
    """Settings every run would fail on, refused before the first run."""
    ctr = cfg.ctr
    if int(cfg.reps) < 1:
        raise ConfigError("reps", f"must be at least 1, got {cfg.reps}")
    if int(ctr.workers) < 1 or not int(ctr.workers) <= int(ctr.warmup) < int(ctr.steps):
        raise ConfigError(
            "ctr.warmup", f"must be at least ctr.workers ({ctr.workers}) and below ctr.steps ({ctr.steps}), "
            f"got {ctr.warmup}"
        )  # fmt: skip


def run_ctr_suite(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """psdk and the CTR peers, interleaved; writes ``bench.md`` and ``bench.json`` to ``out`` and prints the table."""
    check(cfg)
    isolate = bool(cfg.isolate_peers) and bool(cfg.ctr.peers) and can_isolate()
    plan: dict[str, Callable[[], CtrRun]] = {}
    for peer in cfg.ctr.peers:
        plan[str(peer)] = functools.partial(run_peer, cfg, str(peer), isolate)
    for backend in cfg.ctr.backends:
        plan[psdk_system(backend)] = functools.partial(run_psdk, cfg, str(backend))
        if cfg.ctr.get("plaintext", False):
            plan[psdk_system(backend, plaintext=True)] = functools.partial(run_psdk, cfg, str(backend), True)
        if preallocates(cfg.ctr) and cfg.ctr.get("lazy", False):
            plan[psdk_system(backend, lazy=True)] = functools.partial(run_psdk, cfg, str(backend), lazy=True)
    runs = interleave(plan, int(cfg.reps))
    rows = compare([summarise(key, rs) for key, rs in runs.items()])
    by_key = {row.key: row for row in rows}
    ctr = cfg.ctr
    recipe = (
        f"workload=ctr: DLRM, {ctr.capacity:,}-row table of {ctr.dim} dims on {ctr.num_ps} ps "
        f"(psdk's {'preallocated' if preallocates(ctr) else 'lazy'}), {ctr.workers} async "
        f"workers, batch {ctr.batch_size}, Adagrad lr {ctr.lr} (initial accumulator {ctr.init_acc}), {ctr.steps} "
        f"global steps, 1 thread per process; window from global step {ctr.warmup} to the first worker's end; "
        f"medians of {cfg.reps} interleaved runs."
    )
    sections = [
        "## Click-through workload (medians)", recipe, table(rows),
        "### Targets (psdk)", targets(rows, by_key.get(TF1), by_key.get(RPC)),
        "### CPU s per 1k examples, by process", splits(rows, "cpu_split", ".3f"),
        "### Where the time goes (each system's own split)", splits(rows, "time_split", ".3g"),
    ]  # fmt: skip
    report = {
        "suite": "ctr",
        "workload": {**OmegaConf.to_container(cfg.ctr, resolve=True), "reps": cfg.reps, "peers_isolated": isolate},
        "rows": [asdict(r) for r in rows],
        "runs": {key: [asdict(r) for r in rs] for key, rs in runs.items()},
    }
    text = "\n\n".join(sections) + "\n"
    (out / "bench.md").write_text(text)
    write_json_atomic(out / "bench.json", report)
    print(text, flush=True)
    return report
