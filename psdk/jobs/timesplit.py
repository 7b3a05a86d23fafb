"""Where a job's time goes: per step on the workers, per push on each ps (``summary.json``'s ``time_split``).

Each part is a pair of ``perf_counter`` reads around work the step does
anyway, never a per-id loop, so measuring costs the hot path nothing it
would notice (a dozen clock reads a step, about 1 µs). The worker's parts,
in wall milliseconds per local step (``time_split.worker``: each worker's
figures weighted by its steps; each worker's own in its entry):

* ``generation_ms``: cutting the next batch (the data's generator) and its unique ids;
* ``lookup_ms``: the model's side of the ps: gradients and row gradients
  read out of the model, the pulled weights and rows written in (the
  backend's ``write_rows``);
* ``compute_ms``: the forward and backward passes;
* ``wire_ms``: from a push's encode to its reply's decode: the ids sorted
  and cut per shard, the frames sent, the wait for every ps (whose index and
  rule run meanwhile, below), the reply decoded and its rows put in order;
* ``other_ms``: the rest of the loop: logging, validation, checkpoints;
* ``step_ms``: the loop's wall time per step, the sum of the above.

Each ps's parts, in milliseconds per push it was handed
(``time_split.ps``: over every ps, weighted by pushes; each ps's own in
``ps[i].time_per_push``):

* ``index_ms``: the id checks (and the row gradients' finiteness), finding
  the pushed ids' rows, the pull's lookup and the rows it creates;
* ``rule_ms``: the update: the dense apply, the rows and slots gathered,
  the rule on them, its finiteness check, the write back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

WORKER_PARTS = ("generation", "lookup", "compute", "wire")
PS_PARTS = ("index", "rule")


def worker_split(parts_s: Mapping[str, float], steps: int) -> dict[str, float | int]:
    """A worker's ms per step of each part, ``other_ms`` and ``step_ms``, from the seconds summed over ``steps``."""
    if steps <= 0:
        return {"steps": 0}
    ms = {f"{part}_ms": 1000.0 * parts_s.get(part, 0.0) / steps for part in WORKER_PARTS}
    step = 1000.0 * parts_s.get("loop", 0.0) / steps
    out: dict[str, float | int] = {"steps": steps, **{k: round(v, 3) for k, v in ms.items()}}
    out["other_ms"] = round(max(step - sum(ms.values()), 0.0), 3)
    out["step_ms"] = round(step, 3)
    return out


def _weighted(entries: Sequence[Mapping[str, Any]], count: str, keys: Sequence[str]) -> dict[str, Any]:
    """The ``keys`` of ``entries`` averaged, each entry weighted by its ``count``, and the counts summed."""
    total = sum(int(e.get(count) or 0) for e in entries)
    out: dict[str, Any] = {count: total}
    for key in keys:
        value = sum(float(e.get(key) or 0.0) * int(e.get(count) or 0) for e in entries)
        out[key] = round(value / total, 3) if total else None
    return out


def job_split(workers: Mapping[str, Mapping[str, Any]], shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``time_split``: the workers' parts per step and the ps tasks' per push."""
    worker_keys = [f"{part}_ms" for part in (*WORKER_PARTS, "other", "step")]
    splits = [w.get("time_split") or {} for w in workers.values()]
    ps = [s.get("time_per_push") or {} for s in shards]
    return {
        "worker": _weighted(splits, "steps", worker_keys),
        "ps": _weighted(ps, "pushes", [f"{part}_ms" for part in PS_PARTS]),
    }


def split_line(split: Mapping[str, Any]) -> str:
    """The log line: ``where a step's time goes (ms): generation 1.20, lookup 0.80, ...``."""
    worker, ps = split.get("worker") or {}, split.get("ps") or {}

    def shown(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, int | float) else "n/a"

    parts = ", ".join(f"{part} {shown(worker.get(f'{part}_ms'))}" for part in (*WORKER_PARTS, "other"))
    return (
        f"where a step's time goes (ms per step, workers' mean): {parts} of {shown(worker.get('step_ms'))}; "
        f"each ps per push: index {shown(ps.get('index_ms'))}, rule {shown(ps.get('rule_ms'))}"
    )
