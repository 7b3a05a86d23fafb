"""TensorFlow 1.x's distributed MNIST softmax, ported to psdk as one script, as TF1 scripts were written.

The TensorFlow 1.x program psdk's design grew from: softmax regression (784-10) with its weights
drawn from a normal of stddev 1 (``tf.random_normal``), plain gradient descent (learning rate
0.01), batches of 100, workers applying their gradients to the ps asynchronously, every worker
looping over the whole training set (55,000 images) ``--training_epochs`` times and printing its
test accuracy at the end. One script for every task, branching on ``--job_name``: the ps serves
(``psdk.serve(...).join()``, TF1's ``tf.train.Server(...).join()``), a worker trains with torch
through ``psdk.connect`` and ``psdk.DistributedOptimizer`` and writes its summaries with
``psdk.SummaryWriter`` (TF1's ``tf.summary.FileWriter``).

Make the job's keys once, then start one process per task (one terminal or host each):

    python -m psdk keys keys_dir=keys workers=3
    H="--ps_hosts=127.0.0.1:2222 --worker_hosts=localhost,localhost,localhost --keys_dir=keys --logs_path=logs"
    python examples/tf1_mnist_softmax.py --job_name=ps --task_index=0 $H &
    for i in 0 1 2; do python examples/tf1_mnist_softmax.py --job_name=worker --task_index=$i $H & done; wait

Measured with these commands (on another port), 1 ps + 3 workers, torch on CPU, on one 2-core machine that
other jobs shared (load average about 12):

- the TF1 program's own length, 50 epochs per worker = 50 x 550 batches x 3 workers = 82,500
  global steps (the default): test accuracy 0.8888 (the TF1 program reported 0.8865-0.8894),
  in 470 s;
- ``--train_steps=20000`` on each worker, a couple of minutes: test accuracy 0.8465, in 107 s.

A normal of stddev 1 starts far from a good softmax, so at this learning rate it needs many
steps (``python -m psdk run experiment=softmax_sgd``, Glorot-initialised, reaches 0.917 in 20,000).

Each worker prints ``worker <i>: test accuracy <acc> of ...`` as its last line; worker 0 leaves
``summary.json``, ``curves.png``, ``metrics.jsonl`` and TensorBoard event files in ``--logs_path``.
tests/test_examples.py runs this script as ps + 2 workers with short steps and keys.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import psdk
from psdk.data import mnist

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--ps_hosts", required=True, help="comma-separated host:port pairs")
parser.add_argument("--worker_hosts", required=True, help="comma-separated hosts (a port is allowed, not needed)")
parser.add_argument("--job_name", required=True, choices=["ps", "worker"])
parser.add_argument("--task_index", type=int, default=0)
parser.add_argument("--keys_dir", help="the job's keys: python -m psdk keys keys_dir=DIR workers=N")
parser.add_argument("--training_epochs", type=int, default=50, help="passes over the training set by each worker")
parser.add_argument("--train_steps", type=int, help="the target global step (default: from --training_epochs)")
parser.add_argument("--batch_size", type=int, default=100)
parser.add_argument("--learning_rate", type=float, default=0.01)
parser.add_argument("--data_dir", help="the MNIST files (default: PSDK_DATA_DIR, else a download)")
parser.add_argument("--logs_path", default=str(Path(tempfile.gettempdir()) / "psdk_mnist" / "1"))
FLAGS = parser.parse_args()


def main() -> None:
    cluster = psdk.ClusterSpec({"ps": FLAGS.ps_hosts, "worker": FLAGS.worker_hosts})
    if FLAGS.job_name == "ps":
        server = psdk.serve(cluster, task_index=FLAGS.task_index, keys=FLAGS.keys_dir)
        server.join()  # until the chief ends the job
    else:
        train(cluster, FLAGS.task_index)


def train(cluster: psdk.ClusterSpec, task: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)  # the workers and the ps share this machine's cores
    torch.manual_seed(task)
    data = mnist.split(mnist.load(mnist.resolve_dir(FLAGS.data_dir)), 0, num_workers=1)  # all 55,000 for each
    images = len(data.train_y)
    batches = images // FLAGS.batch_size
    steps = FLAGS.train_steps or FLAGS.training_epochs * batches * cluster.num_workers

    model = torch.nn.Linear(784, 10)  # softmax regression: the softmax is in the cross-entropy
    with torch.no_grad():
        model.weight.normal_(0.0, 1.0)  # tf.random_normal([784, 10]): a normal of stddev 1
        model.bias.zero_()

    with (
        psdk.connect(cluster, task_index=task, steps=steps, sync="async", keys=FLAGS.keys_dir) as session,
        psdk.SummaryWriter(FLAGS.logs_path, task_index=task) as writer,
    ):
        sgd = torch.optim.SGD(model.parameters(), lr=FLAGS.learning_rate)  # never stepped: the ps's rule
        opt = psdk.DistributedOptimizer(sgd, model, session)
        opt.broadcast_parameters()  # the chief's initial weights go to the ps; the others take them
        epoch, local = 0, 0
        while not session.should_stop():
            epoch += 1
            order = torch.randperm(images)
            for i in range(batches):
                x, y = data.batch(order[i * FLAGS.batch_size : (i + 1) * FLAGS.batch_size].numpy())
                opt.zero_grad()
                loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
                loss.backward()
                result = opt.step()  # push the gradients, pull the new weights
                local += 1
                if local % 100 == 0 or result.done:
                    writer.scalar("loss", loss.item(), result.global_step)
                if local % 1000 == 0:
                    writer.scalar("accuracy", accuracy(model, data.val_x, data.val_y), result.global_step)
                    print(f"worker {task}: epoch {epoch}, global step {result.global_step}, loss {loss.item():.4f}")
                if result.done:
                    break
        session.finish()  # the chief waits here for the other workers
        if session.is_chief:
            opt.pull()  # the final parameters of the ps
        test = accuracy(model, data.test_x, data.test_y)
        if session.is_chief:
            writer.write_summary(session, test_accuracy=test, model="softmax", batch_size=FLAGS.batch_size)
        which = "the final parameters" if session.is_chief else "the parameters it pulled last"
        print(f"worker {task}: test accuracy {test:.4f} of {which} (global step {session.global_step})", flush=True)


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(1)
        return float((predicted == torch.from_numpy(y)).float().mean())


if __name__ == "__main__":
    main()
