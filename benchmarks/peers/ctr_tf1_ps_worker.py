"""The CTR workload on TensorFlow 1.x's ps/worker: a partitioned table, ``embedding_lookup``, sparse Adagrad.

Written the way a recommendation team wrote it on TF 1.x, through
``tf.compat.v1`` in graph mode (the MNIST peer ``tf1_ps_worker.py`` has the
cluster plumbing; this one follows it):

* every task builds the same ``ClusterSpec`` (``--num-ps`` ps, ``--workers``
  workers) and starts a gRPC ``tf.compat.v1.train.Server``; a ps task only
  ``server.join()``s;
* each worker builds its graph under ``replica_device_setter`` (variables
  round-robin over the ps, computation on the worker). The one table ``emb``
  (``--capacity`` x ``--dim``) is a ``get_variable`` with
  ``partitioner=fixed_size_partitioner(num_ps)``: a ``PartitionedVariable``
  of one contiguous shard per ps, initialised *on the ps* by
  ``random_normal_initializer(stddev=0.01)`` (psdk's row init; the chief
  never ships rows);
* the batch's ids [B, 26] go through ``tf.compat.v1.nn.embedding_lookup(emb,
  ids, partition_strategy="div")`` ("div" is the split the partitioner made;
  TF 2's own default): ids are partitioned per shard, each shard's gather runs
  on its ps, the rows come back and are stitched. Nothing de-duplicates: every
  looked-up row crosses the wire, duplicates included, B x 26 rows each way
  per step (26,624 at batch 1024; the notes count them from the tensors
  themselves and give the unique ids per batch beside them);
* the DLRM of psdk's ``model=dlrm`` (bottom 13-64-dim ReLU, the 351 pairwise
  dots of the 27 vectors in ``np.triu_indices`` order, top (dim+351)-64-1),
  mean ``sigmoid_cross_entropy_with_logits``, psdk's initial dense weights;
* ``AdagradOptimizer(lr, initial_accumulator_value=--init-acc)``: the
  gradient of each shard is an ``IndexedSlices``; the optimizer's sparse apply
  (colocated with the shard, so on its ps) sums duplicates and applies
  ``ResourceSparseApplyAdagrad``; dense variables get the dense apply;
* async training in a ``MonitoredTrainingSession`` (chief = worker 0,
  ``StopAtStepHook(last_step=--steps)``); every ``ConfigProto`` has
  ``--threads`` intra-op and inter-op threads and ``device_filters``.

What it needed to be fair (as the MNIST peer): a non-chief creates its session
only once the chief's exists (it would otherwise poll every 30 s), every
worker passes a start barrier before its first step, and the ps, which never
returns from ``server.join()``, is killed by the launcher after its ``VmHWM``
is read. Each worker trains exactly its share of ``--steps``
(:func:`_ctr.local_steps`) on psdk worker ``i``'s stream, so the examples
trained are the single process's; the learning rate and accumulator are the
recipe's (lr 0.3, 0.1), unchanged.

Measurement: the window and CPU of every process (ps included) as every CTR
peer (:mod:`_ctr`). ``time_split`` (ms per step) is probed by the chief after
training and after the final evaluation, alone with idle ps (uncontended),
on fresh batches: ``step`` (a whole training step), ``pull_rows`` (the
lookup alone: the ids out, the rows back), ``compute`` (forward and backward
with the rows fed, no apply: the dense variables are still read from the
ps), and ``push_and_apply`` (a step with the rows fed, minus ``compute``: the
gradients out and the ps's applies); ``step_in_window`` is the median of
every worker's step inside the measured window (contended).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c
import _ctr
import numpy as np
from tf1_ps_worker import GRACE_S, cluster_hosts, start_cluster, stop_cluster, task, tf_version

PROBES = 20
"""Steps per ``time_split`` probe (each probe's median is kept)."""


def session_config(args: argparse.Namespace, filters: list[str] | None = None) -> Any:
    import tensorflow as tf

    return tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=args.threads,
        inter_op_parallelism_threads=args.threads,
        device_filters=filters or [],
    )


def run_ps(args: argparse.Namespace, ports: list[int]) -> None:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    cluster = tf.compat.v1.train.ClusterSpec(cluster_hosts(ports, args.workers, args.num_ps))
    server = tf.compat.v1.train.Server(cluster, job_name="ps", task_index=args.task_index, config=session_config(args))
    c.log(f"ps {args.task_index}: serving {server.target}")
    server.join()


class Graph:
    """One worker's graph: placeholders, the table, the DLRM, the train op and the probes' tensors."""

    def __init__(self, args: argparse.Namespace, cluster: Any, index: int) -> None:
        import tensorflow as tf

        v1 = tf.compat.v1
        spec = _ctr.spec(args)
        init = _ctr.initial_weights(args)
        v1.set_random_seed(args.seed)
        setter = v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}", cluster=cluster)
        with v1.device(setter):
            self.global_step = v1.train.get_or_create_global_step()
            self.dense = v1.placeholder(tf.float32, [None, 13], name="dense")
            self.cat = v1.placeholder(tf.int64, [None, 26], name="cat")
            self.labels = v1.placeholder(tf.float32, [None], name="labels")
            self.emb = v1.get_variable(
                "emb",
                [args.capacity, args.dim],
                initializer=v1.random_normal_initializer(stddev=spec.init_scale),
                partitioner=v1.fixed_size_partitioner(args.num_ps),
            )
            self.rows = v1.nn.embedding_lookup(self.emb, self.cat, partition_strategy="div")
            weights = {name: v1.get_variable(name, initializer=value) for name, value in init.items()}
            self.logits = dlrm(tf, spec, weights, self.dense, self.rows)
            self.loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=self.labels, logits=self.logits))
            opt = v1.train.AdagradOptimizer(args.lr, initial_accumulator_value=args.init_acc)
            grads = opt.compute_gradients(self.loss)
            self.train_op = opt.apply_gradients(grads, global_step=self.global_step)
            # The probes: what crosses the wire per shard, and the gradients alone.
            self.pushed = [g.values for g, _ in grads if isinstance(g, tf.IndexedSlices)]
            self.backward = tf.group(*(getattr(g, "values", g) for g, _ in grads))  # on the worker: no apply
        graph = tf.compat.v1.get_default_graph()
        self.pulled = [
            op.outputs[0]
            for op in graph.get_operations()
            if op.type in ("ResourceGather", "GatherV2", "Gather") and op.device.startswith("/job:ps")
        ]

    def feed(self, batch: _ctr.Arrays) -> dict[Any, np.ndarray]:
        return {self.dense: batch[0], self.cat: batch[1], self.labels: batch[2]}


def dlrm(tf: Any, spec: Any, w: dict[str, Any], dense: Any, rows: Any) -> Any:
    """psdk's DLRM (psdk.workloads.ctr.model.forward) in TF ops: the logits [B]."""
    from psdk.workloads.ctr.data import FIELDS

    h = dense
    layers = len(spec.bottom) + 1
    for i in range(layers):
        h = tf.nn.relu(tf.matmul(h, w[f"bottom{i}/kernel"]) + w[f"bottom{i}/bias"])
    vectors = tf.concat([h[:, None, :], rows], axis=1)  # [B, 27, dim]
    upper = np.triu_indices(FIELDS + 1, 1)
    flat = tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), [-1, (FIELDS + 1) ** 2])
    products = tf.gather(flat, (upper[0] * (FIELDS + 1) + upper[1]).astype(np.int32), axis=1)
    t = tf.concat([h, products], axis=1)
    layers = len(spec.top) + 1
    for i in range(layers):
        t = tf.matmul(t, w[f"top{i}/kernel"]) + w[f"top{i}/bias"]
        if i < layers - 1:
            t = tf.nn.relu(t)
    return t[:, 0]


def run_worker(args: argparse.Namespace, ports: list[int]) -> None:
    import tensorflow as tf

    index, n = args.task_index, args.workers
    is_chief = index == 0
    tf.compat.v1.disable_eager_execution()
    cluster = tf.compat.v1.train.ClusterSpec(cluster_hosts(ports, n, args.num_ps))
    config = session_config(args, ["/job:ps", f"/job:worker/task:{index}"])
    server = tf.compat.v1.train.Server(cluster, job_name="worker", task_index=index, config=config)
    g = Graph(args, cluster, index)

    deadline = args.deadline
    if not is_chief:  # as tf1_ps_worker: dodge the non-chief's 30-s readiness poll
        c.wait_for_file(args.run_dir, "chief-session", deadline)
    batches = _ctr.worker_batches(args, index)
    mine = _ctr.local_steps(args, index)
    clock = _ctr.StepClock(args.run_dir, index, mine, _ctr.warm_steps(args))
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, config=config, hooks=hooks, stop_grace_period_secs=2
    ) as sess:
        c.log(f"worker {index}: session ready")
        if is_chief:
            Path(args.run_dir, "chief-session").touch()
        c.barrier(args.run_dir, "start", index, n, deadline)
        c.log(f"worker {index}: training {mine} steps")
        while clock.count < mine and not sess.should_stop():
            sess.run(g.train_op, feed_dict=g.feed(next(batches)))
            clock.tick()
        clock.finish()
        c.log(f"worker {index}: left the training loop after {clock.count} local steps")
    result: dict[str, Any] = {"step_ends": clock.times(), "local_steps": clock.count}
    if is_chief:
        try:
            c.barrier(args.run_dir, "trained", index, n, time.time() + GRACE_S)
            result["others_finished"] = True
        except TimeoutError:
            result["others_finished"] = False
        with tf.compat.v1.Session(server.target, config=config) as plain:
            result |= evaluate(args, g, plain)
            result |= probe(g, plain, batches)
        c.log(f"worker {index}: evaluated and probed")
    else:
        Path(args.run_dir, f"trained.{index}").touch()
    c.write_result(args.run_dir, f"worker{index}", result)


def evaluate(args: argparse.Namespace, g: Graph, sess: Any) -> dict[str, Any]:
    """The final weights (read from the ps) on the test set, in chunks of 4,096."""
    test = _ctr.test_set(args)
    parts = [
        sess.run(g.logits, {g.dense: test.dense[i : i + 4096], g.cat: test.cat[i : i + 4096]})
        for i in range(0, len(test.labels), 4096)
    ]
    return {"score": _ctr.score(np.concatenate(parts), test), "final_step": int(sess.run(g.global_step))}


def probe(g: Graph, sess: Any, batches: Any) -> dict[str, Any]:
    """``time_split`` (median ms of ``PROBES`` runs of each kind, interleaved) and the rows on the wire per step."""

    def fed(batch: _ctr.Arrays) -> dict[Any, Any]:
        feed = g.feed(batch)
        feed[g.rows] = sess.run(g.rows, {g.cat: batch[1]})  # pulled before its run is timed
        return feed

    kinds = {
        "step": lambda b: sess.run(g.train_op, g.feed(b)),
        "pull_rows": lambda b: sess.run(g.rows, {g.cat: b[1]}),
        "compute": lambda f: sess.run(g.backward, f),
        "fed_step": lambda f: sess.run(g.train_op, f),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(PROBES):  # interleaved: a shared machine's load moves every kind alike
        for kind, run in kinds.items():
            arg = fed(next(batches)) if kind in ("compute", "fed_step") else next(batches)
            t0 = time.perf_counter()
            run(arg)
            times[kind].append(time.perf_counter() - t0)
    ms = {k: float(np.median(v)) * 1000.0 for k, v in times.items()}
    split = {k: round(ms[k], 3) for k in ("step", "pull_rows", "compute")}
    split["push_and_apply"] = round(ms["fed_step"] - ms["compute"], 3)
    pulled, pushed = sess.run([g.pulled, g.pushed], g.feed(batch := next(batches)))
    return {
        "time_split": split,
        "rows_pulled": sum(len(p) for p in pulled),
        "rows_pushed": sum(len(p) for p in pushed),
        "unique_ids": int(np.unique(batch[1]).size),
    }


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        ps, workers = start_cluster(launcher, args, args.num_ps)
        window = _ctr.measure_window(launcher, ps + workers, args.workers)
        rss, hung = stop_cluster(launcher, ps, workers, "ctr_tf1_ps_worker")
        results = {w: launcher.result(w) for w in workers if w not in hung}
        return summarize(args, window, results, rss, hung)

    return _ctr.run_launcher(args, "ctr_tf1_ps_worker", "tensorflow", body)


def summarize(
    args: argparse.Namespace,
    window: _ctr.Window,
    results: dict[str, dict[str, Any]],
    rss: dict[str, float | None],
    hung: list[str],
) -> dict[str, Any]:
    chief = results["worker0"]
    step_ends = [r["step_ends"] for r in results.values()]
    inside = [
        np.diff(t)[(t[1:] > window.start) & (t[1:] <= window.end)] for t in map(np.asarray, step_ends) if len(t) > 1
    ]
    steps_in = np.concatenate(inside) if inside else np.zeros(0)
    split = dict(chief["time_split"])
    if steps_in.size:
        split["step_in_window"] = round(float(np.median(steps_in)) * 1000.0, 3)
    local = ", ".join(f"{w}: {r['local_steps']}" for w, r in results.items())
    notes = (
        f"tf.compat.v1 graph mode, gRPC, TF {tf_version()}; {args.num_ps} ps (fixed_size_partitioner), "
        f"{args.workers} async workers, {args.threads} intra/inter-op thread(s) per task; "
        f"lr {args.lr}, initial accumulator {args.init_acc}; local steps {local}; "
        f"final global step {chief['final_step']}; rows per step: {chief['rows_pulled']} pulled, "
        f"{chief['rows_pushed']} pushed, {chief['unique_ids']} unique ids; "
        f"ps VmHWM MB {', '.join(f'{k} {v}' for k, v in rss.items())}; "
        "time_split: the chief alone after training (ms), step_in_window contended"
    )
    if hung:
        notes += f"; {', '.join(hung)} hung after the chief stopped and was killed"
    known = [v for v in rss.values() if v is not None]
    return {
        "examples": args.batch * sum(r["local_steps"] for r in results.values()),
        **window.figures(step_ends, args.batch),
        **chief["score"],
        "ps_max_rss_mb": max(known) if known else None,
        "time_split": split,
        "notes": notes,
    }


def main() -> int:
    args = _ctr.parser(__doc__.splitlines()[0]).parse_args()
    if args.role is None:
        return launch(args)
    task(args, run_ps, run_worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
