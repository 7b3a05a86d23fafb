"""TensorFlow 1.x-style between-graph replication: 1 ps + N workers over gRPC, async or sync.

Written the way TensorFlow's distributed guide (``Distributed TensorFlow``,
TF 1.x) and its ``mnist_replica.py`` example did it, through ``tf.compat.v1``
in graph mode:

* every task builds the same ``tf.compat.v1.train.ClusterSpec`` and starts a
  ``tf.compat.v1.train.Server`` (gRPC) for itself; the ps task then only
  ``server.join()``s;
* each worker builds its own graph under
  ``tf.compat.v1.train.replica_device_setter`` (variables and the global step
  on ``/job:ps/task:0``, the computation on the worker), feeds batches with
  ``feed_dict`` and runs ``train_op`` in a ``MonitoredTrainingSession``
  (chief = worker 0, ``StopAtStepHook(last_step=steps)``);
* async: a plain ``GradientDescentOptimizer``: every worker step applies its
  gradient on the ps right away (``ApplyGradientDescent`` runs on the ps);
* sync: ``SyncReplicasOptimizer(replicas_to_aggregate=N, total_num_replicas=N)``
  with its ``make_session_run_hook``: gradients go to accumulators on the ps,
  the chief's queue runner applies their mean and hands out tokens.
* Every ``ConfigProto`` (servers and sessions) has
  ``intra_op_parallelism_threads=1, inter_op_parallelism_threads=1``, and the
  sessions use ``device_filters`` (ps + own worker) as the guide recommends.

How updates/s is read. The variables are applied on the ps, but the ps
task is a bare gRPC server with no Python hook in the update path, so the
global step is observed from the workers: every ``sess.run`` fetches
``global_step`` together with ``train_op`` and records ``(time.time(), step)``.
All workers' observations are merged; updates/s = (step_last - step_first + 1)
÷ (t_last - t_first), where ``first`` is the earliest observation and
``last`` the earliest one of the highest step. This matches psdk's
"updates ÷ (last update - first update)" up to one network round trip at
each end. (The fetched step can be read a hair before the run's own
increment in sync mode; a ±1 step error over 2,000 is negligible.)

Start and end, where TF 1.x had rough edges, handled outside the measured
interval and without changing how a step runs:

* A non-chief ``MonitoredTrainingSession`` polls for the chief's
  initialization only every 30 s (``SessionManager.recovery_wait_secs``),
  so a worker that asks too early idles for 30 s while the chief trains
  alone. The non-chief therefore creates its session only once the chief's
  exists, and all workers pass a start barrier together (marker files in
  the launcher's folder) before their first step, so the measured interval
  has every worker training.
* The final parameters are evaluated by the chief (a plain
  ``tf.compat.v1.Session`` on the same graph, reading the ps) after every
  worker has left its training loop (a second barrier), on the 10,000 test
  images.
* The ps never returns from ``server.join()`` (the classic problem): the
  launcher reads its peak RSS (``VmHWM`` in ``/proc``) and then kills it.
  A sync worker that is left waiting for a token after the chief stopped
  (the other classic problem) is killed the same way after a grace period;
  the JSON notes say whether that happened (it did not in our runs: the
  last update hands both workers a token and ``StopAtStepHook`` re-reads
  the global step before stopping).
* ``MonitoredTrainingSession(stop_grace_period_secs=2)``: on close, the
  chief's ``SyncReplicasOptimizer`` queue runner is blocked in ``take_grad``
  waiting for gradients that will never come, and the session waits the
  grace period (default 120 s) before cancelling it. This only shortens
  ``wall_s``; async mode has no queue runner.

Where the time goes (CPU per update, from the notes): async, the ps spends
~2.5 ms per update and each worker ~4 ms per local step, against ~1 ms for
the same step in one graph-mode process; the rest is TF's distributed
runtime (a RunGraph per partition, a RecvTensor per variable and per
gradient, gRPC threads: per-thread accounting puts most of it on unnamed
gRPC/TF threads and ``event_engine``, not on ``tf_Compute``). Sync doubles
that per update and adds the wait for the slower worker.

TF 2.21: every ``tf.compat.v1`` API used here still works
(``SyncReplicasOptimizer`` and ``QueueRunner`` log deprecation warnings).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

Role = Callable[[argparse.Namespace, list[int]], None]
"""A task's body: its arguments and the cluster's ports."""

GRACE_S = 10.0  # how long the launcher waits for the other workers once the chief is done


def cluster_hosts(ports: list[int], num_workers: int, num_ps: int = 1) -> dict[str, list[str]]:
    """The ``ClusterSpec`` of ``num_ps`` ps tasks and ``num_workers`` workers on ``ports``, ps first."""
    return {
        "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[num_ps : num_ps + num_workers]],
    }


def run_ps(args: argparse.Namespace, ports: list[int]) -> None:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    cluster = tf.compat.v1.train.ClusterSpec(cluster_hosts(ports, args.workers))
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    server = tf.compat.v1.train.Server(cluster, job_name="ps", task_index=0, config=config)
    c.log(f"ps 0: serving {server.target}")
    server.join()


def run_worker(args: argparse.Namespace, ports: list[int]) -> None:
    import tensorflow as tf

    index, n = args.task_index, args.workers
    is_chief = index == 0
    data = c.load_data(args.data, index, n, with_test=is_chief)
    init = c.initial_weights(args.seed)

    tf.compat.v1.disable_eager_execution()
    cluster = tf.compat.v1.train.ClusterSpec(cluster_hosts(ports, n))
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=1,
        device_filters=["/job:ps", f"/job:worker/task:{index}"],
    )
    server = tf.compat.v1.train.Server(cluster, job_name="worker", task_index=index, config=config)

    with tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}", cluster=cluster)
    ):
        global_step = tf.compat.v1.train.get_or_create_global_step()
        x = tf.compat.v1.placeholder(tf.float32, [None, 784], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        w1 = tf.compat.v1.get_variable("hidden1/kernel", initializer=init["hidden1/kernel"])
        b1 = tf.compat.v1.get_variable("hidden1/bias", initializer=init["hidden1/bias"])
        w2 = tf.compat.v1.get_variable("logits/kernel", initializer=init["logits/kernel"])
        b2 = tf.compat.v1.get_variable("logits/bias", initializer=init["logits/bias"])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))

        opt = tf.compat.v1.train.GradientDescentOptimizer(args.lr)
        if args.mode == "sync":
            opt = tf.compat.v1.train.SyncReplicasOptimizer(opt, replicas_to_aggregate=n, total_num_replicas=n)
        train_op = opt.minimize(loss, global_step=global_step)

    hooks: list[Any] = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    if args.mode == "sync":
        hooks.append(opt.make_session_run_hook(is_chief))

    deadline = args.deadline
    if not is_chief:  # see the module docstring: dodge the 30-s readiness poll
        c.wait_for_file(args.run_dir, "chief-session", deadline)
    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, index)
    obs: list[tuple[float, int]] = []
    local_steps = 0
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, config=config, hooks=hooks, stop_grace_period_secs=2
    ) as sess:
        c.log(f"worker {index}: session ready")
        if is_chief:
            Path(args.run_dir, "chief-session").touch()
        c.barrier(args.run_dir, "start", index, n, deadline)
        c.log(f"worker {index}: training")
        ps_pid = c.task_pid(args.run_dir, "ps0") if is_chief else None
        cpu0 = (c.cpu_s(), c.cpu_s(ps_pid) if ps_pid else None)
        while not sess.should_stop():
            xb, yb = next(batches)
            _, step = sess.run([train_op, global_step], feed_dict={x: xb, y: yb})
            obs.append((time.time(), int(step)))
            local_steps += 1
        cpu1 = (c.cpu_s(), c.cpu_s(ps_pid) if ps_pid else None)
        c.log(f"worker {index}: left the training loop after {local_steps} local steps, global step {obs[-1][1]}")
    c.log(f"worker {index}: session closed")

    result: dict[str, Any] = {"obs": obs, "local_steps": local_steps, "cpu": [cpu0[0], cpu1[0]]}
    if is_chief:
        result["ps_cpu"] = [cpu0[1], cpu1[1]]
    if is_chief:
        try:
            c.barrier(args.run_dir, "trained", index, n, time.time() + GRACE_S)
            result["others_finished"] = True
        except TimeoutError:
            result["others_finished"] = False
        with tf.compat.v1.Session(server.target, config=config) as plain:
            result["test_accuracy"] = float(plain.run(accuracy, feed_dict={x: data.test_x, y: data.test_y}))
            result["final_step"] = int(plain.run(global_step))
        c.log(f"worker {index}: evaluated")
    else:
        Path(args.run_dir, f"trained.{index}").touch()
    c.write_result(args.run_dir, f"worker{index}", result)


def task(args: argparse.Namespace, ps: Role = run_ps, worker: Role = run_worker) -> None:
    """One task of the cluster: ``ps`` or ``worker`` by ``--role``, on the launcher's ``--ports``."""
    c.task_setup()
    ports = [int(p) for p in args.ports.split(",")]
    if args.role == "ps":
        ps(args, ports)
    else:
        worker(args, ports)


def start_cluster(launcher: c.Launcher, args: argparse.Namespace, num_ps: int) -> tuple[list[str], list[str]]:
    """Start ``num_ps`` ps tasks and ``args.workers`` workers on free ports; their names."""
    ports = c.free_ports(num_ps + args.workers)
    ps = [f"ps{i}" for i in range(num_ps)]
    workers = [f"worker{i}" for i in range(args.workers)]
    for i, name in enumerate(ps):
        launcher.start(name, c.task_argv(args, "ps", i, launcher.run_dir, ports))
    for i, name in enumerate(workers):
        launcher.start(name, c.task_argv(args, "worker", i, launcher.run_dir, ports))
    return ps, workers


def stop_cluster(
    launcher: c.Launcher, ps: list[str], workers: list[str], script: str, narrate: bool = False
) -> tuple[dict[str, float | None], list[str]]:
    """Wait for the chief, then up to ``GRACE_S`` for the other workers (killing the hung ones), read
    the ps tasks' peak RSS and kill them (``server.join()`` never returns); the RSS by ps and the hung."""
    launcher.wait(["worker0"], what="the chief's training and evaluation")
    if narrate:
        c.log("launcher: chief exited")
    hung = []
    try:
        launcher.wait(workers[1:], deadline=time.time() + GRACE_S)
    except TimeoutError:
        hung = [w for w in workers[1:] if launcher.procs[w].poll() is None]
        for w in hung:
            c.log(f"{script}: {w} still running {GRACE_S:.0f} s after the chief finished; killing it")
            launcher.kill(w)
    rss = {name: launcher.peak_rss_mb(name) for name in ps}
    launcher.kill(*ps)
    if narrate:
        c.log("launcher: ps killed")
    return rss, hung


def summarize(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> tuple[float | None, int]:
    """updates/s from every worker's (time, global step) observations; see the module docstring."""
    obs = sorted((t, s) for r in results.values() for t, s in r["obs"])
    if not obs:
        return None, 0
    t_first, s_first = obs[0]
    s_last = max(s for _, s in obs)
    t_last = min(t for t, s in obs if s == s_last)
    return c.rate(s_last - s_first + 1, t_first, t_last), s_last


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        ps, workers = start_cluster(launcher, args, 1)
        rss, hung = stop_cluster(launcher, ps, workers, "tf1_ps_worker", narrate=True)
        ps_rss = rss["ps0"]
        results = {w: launcher.result(w) for w in workers if w not in hung}
        ups, last_step = summarize(args, results)
        chief = results["worker0"]
        cpu = {"ps0": tuple(chief["ps_cpu"])} | {w: tuple(r["cpu"]) for w, r in results.items()}
        local = ", ".join(f"{w}: {r['local_steps']}" for w, r in results.items())
        notes = (
            f"tf.compat.v1 graph mode, gRPC, TF {tf_version()}; updates/s from global-step observations on the "
            f"workers; final global step {chief['final_step']}; local steps {local}; "
            "ps killed by the launcher after the workers (server.join never returns); "
            + c.cpu_per_update_ms(cpu, last_step)
        )
        if args.mode == "sync":
            notes += "; SyncReplicasOptimizer"
        if hung:
            notes += f"; {', '.join(hung)} hung after the chief stopped and was killed"
        return {
            "steps": args.steps,
            "updates_per_s": ups,
            "test_accuracy": chief["test_accuracy"],
            "ps_max_rss_mb": ps_rss,
            "notes": notes,
        }

    return c.run_launcher(args, "tf1_ps_worker", "tensorflow", body)


def tf_version() -> str:
    """TF's version without importing it into the launcher."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


def main() -> int:
    args = c.parser(__doc__.splitlines()[0]).parse_args()
    if args.role is None:
        return launch(args)
    task(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
