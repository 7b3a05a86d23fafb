"""CTR on a ``torch.distributed.rpc`` parameter server: the table split by id over ``--num-ps`` ps, async workers.

Written as PyTorch's "Implementing a Parameter Server Using Distributed RPC
Framework" tutorial writes a ps (ps ranks that only serve and then call
``rpc.shutdown()``; trainers that drive their own loop and call the ps's
functions with ``rpc_sync``/``rpc_async``), grown to a sharded embedding
table the way such a team grows it:

* **The table.** Id ``i`` lives on ps ``i % num_ps`` at row ``i // num_ps``
  (TF1 ``embedding_lookup``'s default ``mod`` split): ``capacity / num_ps``
  rows x ``dim`` float32 per ps, drawn N(0, 0.01**2) on the ps from the seed
  (never shipped), and an Adagrad accumulator of the same shape filled with
  ``--init-acc``. The dense layers (25k floats) live on ps0 with a
  ``torch.optim.Adagrad(lr, initial_accumulator_value, eps=0)``: they are
  0.3% of a step's bytes, so splitting them would change nothing measurable.
* **A worker's step** (``--workers`` async workers, no barrier between
  them): ``torch.unique(cat, return_inverse=True)``; one ``rpc_async`` per ps
  pulls that ps's unique ids' rows (ps0 also returns the dense weights); the
  worker waits for all of them (``torch.futures.wait_all``: the shards are
  pulled in parallel, not one after the other); ``rows[inverse]`` feeds
  :class:`_ctr_torch.DenseDlrm` and the loss, ``backward()`` leaves in
  ``rows.grad`` each unique id's gradient summed over its occurrences; one
  ``rpc_async`` per ps pushes (that ps's unique ids, their summed rows), ps0
  also the dense gradients, and the worker waits for the pushes to be applied
  (as the tutorial's ``rpc_sync`` does) before its next pull.
* **The ps's update**, under the shard's lock (the tutorial's): element-wise
  Adagrad on the pushed rows only, ``a[ids] += g*g; w[ids] -= lr * g /
  sqrt(a[ids])`` (``index_select``/``index_copy_``/``index_add_``; ids are
  unique within a push), and ``optimizer.step()`` on the dense layers.
  Pulls read under the same lock.
* **Transport**: what the MNIST RPC peer (``torch_rpc_ps.py``) measured:
  TensorPipe's ``uv`` transport (the default ``shm`` busy-polls a core per
  process) and its ``basic`` channel; ``--tp-transports``/``--tp-channels
  default`` for TensorPipe's own choice. ``num_worker_threads=4``.

Every worker trains its share of ``--steps`` on psdk's stream for its task
index (:func:`_ctr.worker_batches`). When every worker is done (a barrier
of marker files), worker 0 pulls the test set's rows and the dense weights
and scores them, so the AUC is the final model's.

``time_split`` (milliseconds per worker step, mean over every worker's
steps after the warm-up): ``batch`` (generating it, ``unique``, splitting
ids by ps), ``pull`` and ``push`` (the round trips, waited for), ``compute``
(gather, forward, backward); then the ps side, per worker step summed over
the ps: ``ps_pull`` (reading the rows under the lock) and ``ps_apply`` (the
Adagrad on rows and dense), both included in the worker's ``pull``/``push``.

Measured (10M ids, 2 ps, 2 workers, 2000 steps, ``nice -n 19`` on 2 shared
cores): test AUC 0.7788 and 0.7798 against the single process's 0.7832, with
the recipe's lr and 1 thread; 1.05x the single process's CPU per example, a
quarter of it on the ps; peak RSS 930 MB per ps (5M rows and accumulators).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c
import _ctr

RPC_THREADS = 4
WORKER_PHASES = ("batch", "pull", "compute", "push")

# The ps's state lives in this module of the ps process (the tutorial's global ``param_server``).
_shard: Any = None


def ps_name(s: int) -> str:
    return f"ps{s}"


def worker_name(i: int) -> str:
    return f"worker{i}"


class Shard:
    """One ps's rows ``id % num_ps == index`` (row ``id // num_ps``) and their accumulators; ps0 also the dense."""

    def __init__(self, args: argparse.Namespace, index: int) -> None:
        import _ctr_torch as t
        import torch

        rows = len(range(index, args.capacity, args.num_ps))
        self.lr = args.lr
        self.weight = t.init_rows(rows, args, args.seed * 1000 + index)
        self.acc = torch.full_like(self.weight, args.init_acc)
        self.lock = threading.Lock()
        self.dense = t.DenseDlrm(args) if index == 0 else None
        self.opt = (
            torch.optim.Adagrad(self.dense.parameters(), lr=args.lr, initial_accumulator_value=args.init_acc, eps=0.0)
            if self.dense is not None
            else None
        )
        self.pull_s = self.apply_s = 0.0
        self.pulls = self.pushes = 0

    def pull(self, ids: Any, with_dense: bool, count: bool) -> tuple[Any, list[Any] | None]:
        with self.lock:
            t0 = time.perf_counter()
            rows = self.weight.index_select(0, ids)
            dense = [p.detach().clone() for p in self.dense.parameters()] if with_dense and self.dense else None
            if count:
                self.pull_s += time.perf_counter() - t0
                self.pulls += 1
        return rows, dense

    def push(self, ids: Any, grads: Any, dense_grads: list[Any] | None) -> None:
        with self.lock:
            t0 = time.perf_counter()
            acc = self.acc.index_select(0, ids).addcmul_(grads, grads)
            self.acc.index_copy_(0, ids, acc)
            self.weight.index_add_(0, ids, grads.div_(acc.sqrt_()).mul_(-self.lr))
            if dense_grads is not None and self.dense is not None and self.opt is not None:
                for p, g in zip(self.dense.parameters(), dense_grads, strict=True):
                    p.grad = g
                self.opt.step()
            self.apply_s += time.perf_counter() - t0
            self.pushes += 1


def pull(ids: Any, with_dense: bool, count: bool = True) -> tuple[Any, list[Any] | None]:
    """Runs on a ps (``rpc_async``): the rows of its local ids ``ids``, and the dense weights if asked."""
    return _shard.pull(ids, with_dense, count)


def push(ids: Any, grads: Any, dense_grads: list[Any] | None) -> None:
    """Runs on a ps (``rpc_async``): apply Adagrad to the rows of ``ids`` (unique) and to the dense layers."""
    _shard.push(ids, grads, dense_grads)


def rpc_options(args: argparse.Namespace, port: int) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=RPC_THREADS,
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=max(10.0, args.deadline - time.time()),
        _transports=None if args.tp_transports == "default" else args.tp_transports.split(","),
        _channels=None if args.tp_channels == "default" else args.tp_channels.split(","),
    )


def run_ps(args: argparse.Namespace, port: int) -> None:
    global _shard
    import _ctr_torch as t
    from torch.distributed import rpc

    t.set_threads(args.threads)
    index = args.task_index
    _shard = Shard(args, index)  # before serving: the rows are drawn here, never shipped
    world = args.num_ps + args.workers
    rpc.init_rpc(ps_name(index), rank=index, world_size=world, rpc_backend_options=rpc_options(args, port))
    c.log(f"ps{index}: serving {len(_shard.weight)} rows")
    rpc.shutdown()  # waits for every worker to finish and shut down
    c.write_result(
        args.run_dir,
        ps_name(index),
        {
            "pull_s": _shard.pull_s,
            "apply_s": _shard.apply_s,
            "pulls": _shard.pulls,
            "pushes": _shard.pushes,
            "max_rss_mb": c.max_rss_mb(),
        },
    )


class Worker:
    """A worker's model and its pull/push of one batch's unique ids."""

    def __init__(self, args: argparse.Namespace) -> None:
        import _ctr_torch as t

        self.args, self.num_ps = args, args.num_ps
        self.model = t.DenseDlrm(args)  # its weights come from ps0 every step
        self.params = list(self.model.parameters())

    def split(self, cat: np.ndarray) -> tuple[Any, Any, list[tuple[Any, Any]]]:
        """Unique ids, each position's index into them, and per ps (positions in the unique ids, local rows)."""
        import torch

        uniq, inverse = torch.unique(torch.from_numpy(cat), return_inverse=True)
        shard = uniq % self.num_ps
        parts = []
        for s in range(self.num_ps):
            where = (shard == s).nonzero().squeeze(1)
            parts.append((where, uniq.index_select(0, where) // self.num_ps))
        return uniq, inverse, parts

    def pull(self, uniq: Any, parts: list[tuple[Any, Any]], count: bool = True) -> Any:
        """Every ps's rows in parallel, into one [unique, dim] tensor; the dense weights into the model."""
        import torch
        from torch.distributed import rpc

        futs = [rpc.rpc_async(ps_name(s), pull, args=(local, s == 0, count)) for s, (_, local) in enumerate(parts)]
        torch.futures.wait_all(futs)
        rows = torch.empty(len(uniq), self.args.dim)
        for (where, _), fut in zip(parts, futs, strict=True):
            got, dense = fut.value()
            rows.index_copy_(0, where, got)
            if dense is not None:
                with torch.no_grad():
                    for p, v in zip(self.params, dense, strict=True):
                        p.copy_(v)
        return rows

    def push(self, grads: Any, parts: list[tuple[Any, Any]]) -> None:
        """Every ps's (local ids, summed rows) in parallel, ps0 with the dense gradients; wait until applied."""
        import torch
        from torch.distributed import rpc

        dense = [p.grad for p in self.params]
        futs = [
            rpc.rpc_async(ps_name(s), push, args=(local, grads.index_select(0, where), dense if s == 0 else None))
            for s, (where, local) in enumerate(parts)
        ]
        torch.futures.wait_all(futs)


def run_worker(args: argparse.Namespace, port: int) -> None:
    import _ctr_torch as t
    import torch
    from torch.distributed import rpc

    t.set_threads(args.threads)
    index, n = args.task_index, args.workers
    worker = Worker(args)
    steps = _ctr.local_steps(args, index)
    batches = _ctr.worker_batches(args, index)
    test = _ctr.test_set(args) if index == 0 else None
    rpc.init_rpc(worker_name(index), rank=args.num_ps + index, world_size=args.num_ps + n,
                 rpc_backend_options=rpc_options(args, port))  # fmt: skip
    c.barrier(args.run_dir, "start", index, n, args.deadline)
    clock = _ctr.StepClock(args.run_dir, index, steps, _ctr.warm_steps(args))
    split = np.zeros((steps, len(WORKER_PHASES)))
    for step in range(steps):
        t0 = time.perf_counter()
        dense, cat, labels = next(batches)
        uniq, inverse, parts = worker.split(cat)
        t1 = time.perf_counter()
        rows = worker.pull(uniq, parts).requires_grad_()
        t2 = time.perf_counter()
        worker.model.zero_grad()
        loss = t.loss_fn(worker.model(torch.from_numpy(dense), rows[inverse]), labels)
        loss.backward()
        t3 = time.perf_counter()
        worker.push(rows.grad, parts)
        t4 = time.perf_counter()
        split[step] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        clock.tick()
    clock.finish()
    c.log(f"worker {index}: {steps} local steps, last loss {float(loss.detach()):.4f}")

    result: dict[str, Any] = {"step_ends": clock.times(), "split_s": split[_ctr.warm_steps(args) :].sum(0).tolist()}
    result["split_steps"] = max(0, steps - _ctr.warm_steps(args))
    c.barrier(args.run_dir, "trained", index, n, args.deadline)  # the final model: every worker's pushes applied
    if test is not None:
        uniq, inverse, parts = worker.split(test.cat)
        rows = worker.pull(uniq, parts, count=False)
        logits = t.predict(worker.model, test.dense, lambda a, b: rows[inverse[a:b]])
        result["score"] = _ctr.score(logits, test)
    c.write_result(args.run_dir, worker_name(index), result)
    rpc.shutdown()


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        (port,) = c.free_ports(1)
        servers = [ps_name(s) for s in range(args.num_ps)]
        workers = [worker_name(i) for i in range(args.workers)]
        for s, name in enumerate(servers):
            launcher.start(name, c.task_argv(args, "ps", s, launcher.run_dir, [port]))
        for i, name in enumerate(workers):
            launcher.start(name, c.task_argv(args, "worker", i, launcher.run_dir, [port]))
        window = _ctr.measure_window(launcher, [*servers, *workers], args.workers)
        launcher.wait([*workers, *servers], what="training")
        ps = [launcher.result(s) for s in servers]
        results = [launcher.result(w) for w in workers]
        measured = sum(r["split_steps"] for r in results)
        split = {
            name: 1000.0 * sum(r["split_s"][k] for r in results) / max(1, measured)
            for k, name in enumerate(WORKER_PHASES)
        }
        split["ps_pull"] = sum(1000.0 * p["pull_s"] / max(1, p["pulls"]) for p in ps)
        split["ps_apply"] = sum(1000.0 * p["apply_s"] / max(1, p["pushes"]) for p in ps)
        return {
            "examples": args.steps * args.batch,
            **window.figures([r["step_ends"] for r in results], args.batch),
            **results[0]["score"],
            "ps_max_rss_mb": max(p["max_rss_mb"] for p in ps),
            "time_split": {k: round(v, 3) for k, v in split.items()},
            "notes": f"torch.distributed.rpc, TensorPipe transports={args.tp_transports}, "
            f"channels={args.tp_channels}, num_worker_threads={RPC_THREADS}; {args.num_ps} ps (id % num_ps), "
            f"dense layers on ps0; {args.workers} async workers, {args.threads} thread(s) each; element-wise "
            f"Adagrad(lr={args.lr}, initial_accumulator_value={args.init_acc}, eps=0) on pushed unique rows",
        }

    return _ctr.run_launcher(args, "ctr_torch_rpc_ps", "torch", body)


def main() -> int:
    p = _ctr.parser(__doc__.splitlines()[0])
    p.add_argument("--tp-transports", default="uv", help="TensorPipe transports, or 'default' (shm busy-polls)")
    p.add_argument("--tp-channels", default="basic", help="TensorPipe CPU channels, or 'default'")
    args = p.parse_args()
    if args.role is None:
        return launch(args)
    c.task_setup()
    port = int(args.ports)
    if args.role == "ps":
        run_ps(args, port)
    else:
        run_worker(args, port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
