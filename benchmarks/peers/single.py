"""Single-process baseline: the same MLP, batch, SGD and steps, in one process with one thread.

This is the denominator of every ratio in the benchmark, so it is the loop a
user would write to go fast, with nothing a distributed run avoids:

* ``--framework torch``: ``nn.Sequential`` + ``F.cross_entropy`` +
  ``torch.optim.SGD``, ``zero_grad``/``backward``/``step`` per batch,
  batches handed over with ``torch.from_numpy`` (no copy).
* ``--framework tf``: TF2 eager with a ``tf.function`` train step
  (``GradientTape`` + ``tf.keras.optimizers.SGD.apply_gradients``) on a
  Keras ``Sequential`` model, the "training loop from scratch" of TF's guide.
* ``--framework jax``: a params dict, ``jax.value_and_grad`` of the mean
  softmax cross-entropy and ``optax.sgd`` in one ``jax.jit``-compiled step,
  the loop of optax's own examples. XLA's CPU pool gets one thread the way
  the psdk-jax plugin gives it one (``psdk_jax.placement.start``: XLA sizes it
  from the CPUs it may use when its client starts); dispatch stays asynchronous,
  as in a user's loop that does not wait for each step.

All use 1 intra-op and 1 inter-op thread, train on all 55,000 images after
the 5,000 held out (one "worker" owning the whole training set), start from
psdk's initial weights for ``--seed``, and time from the end of the first
update to the end of the last: updates/s = steps ÷ (t_last - t_first), the
way psdk's ps counts. ``--workers`` and ``--mode`` are accepted and ignored.

For TF, handing the step ``tf.constant`` batches instead of numpy arrays,
or replacing the Keras optimizer with ``assign_sub``, measured the same
within noise, so the guide's form stays.

The launcher runs the training in one child process (so the timeout and
clean-up behave as for the distributed peers); that child imports only the
chosen framework.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c


def train_torch(args: argparse.Namespace, data: c.Data) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)
    init = c.initial_weights(args.seed)
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
    with torch.no_grad():  # TF layout (in, out) -> torch (out, in)
        model[0].weight.copy_(torch.from_numpy(init["hidden1/kernel"].T))
        model[0].bias.copy_(torch.from_numpy(init["hidden1/bias"]))
        model[2].weight.copy_(torch.from_numpy(init["logits/kernel"].T))
        model[2].bias.copy_(torch.from_numpy(init["logits/bias"]))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, 0)

    t_first = cpu_first = 0.0
    for step in range(args.steps):
        xb, yb = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        if step == 0:
            t_first, cpu_first = time.time(), c.cpu_s()
    t_last, cpu_last = time.time(), c.cpu_s()

    with torch.no_grad():
        pred = model(torch.from_numpy(data.test_x)).argmax(1)
        acc = float((pred == torch.from_numpy(data.test_y)).float().mean())
    return {
        "t_first": t_first,
        "t_last": t_last,
        "test_accuracy": acc,
        "loss": float(loss.detach()),
        "cpu": [cpu_first, cpu_last],
    }


def train_tf(args: argparse.Namespace, data: c.Data) -> dict[str, Any]:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    init = c.initial_weights(args.seed)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(100, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.set_weights([init["hidden1/kernel"], init["hidden1/bias"], init["logits/kernel"], init["logits/bias"]])
    opt = tf.keras.optimizers.SGD(learning_rate=args.lr)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, 0)
    t_first = cpu_first = 0.0
    for step in range(args.steps):
        xb, yb = next(batches)
        loss = train_step(xb, yb)
        if step == 0:
            t_first, cpu_first = time.time(), c.cpu_s()
    t_last, cpu_last = time.time(), c.cpu_s()

    logits = model(data.test_x, training=False)
    acc = float(tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), data.test_y), tf.float32)))
    return {
        "t_first": t_first,
        "t_last": t_last,
        "test_accuracy": acc,
        "loss": float(loss),
        "cpu": [cpu_first, cpu_last],
    }


def train_jax(args: argparse.Namespace, data: c.Data) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from psdk_jax import placement

    placement.start("cpu", 1, None, jax, in_line=False)  # one pool thread; asynchronous dispatch as usual
    params = {name: jnp.asarray(value) for name, value in c.initial_weights(args.seed).items()}
    tx = optax.sgd(args.lr)
    state = tx.init(params)

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        h = jax.nn.relu(x @ params["hidden1/kernel"] + params["hidden1/bias"])
        logits = h @ params["logits/kernel"] + params["logits/bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params: Any, state: Any, x: Any, y: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, 0)
    t_first = cpu_first = 0.0
    for step in range(args.steps):
        xb, yb = next(batches)
        params, state, loss = train_step(params, state, xb, yb.astype(np.int32))
        if step == 0:
            loss.block_until_ready()
            t_first, cpu_first = time.time(), c.cpu_s()
    loss.block_until_ready()
    t_last, cpu_last = time.time(), c.cpu_s()

    h = jax.nn.relu(data.test_x @ params["hidden1/kernel"] + params["hidden1/bias"])
    predicted = np.asarray(jnp.argmax(h @ params["logits/kernel"] + params["logits/bias"], axis=1))
    return {
        "t_first": t_first,
        "t_last": t_last,
        "test_accuracy": float(np.mean(predicted == data.test_y)),
        "loss": float(loss),
        "cpu": [cpu_first, cpu_last],
    }


TRAIN = {"torch": train_torch, "tf": train_tf, "jax": train_jax}


def task(args: argparse.Namespace) -> None:
    c.task_setup()
    data = c.load_data(args.data, 0, 1, with_test=True)
    res = TRAIN[args.framework](args, data)
    c.write_result(args.run_dir, "train", res)


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        launcher.start("train", c.task_argv(args, "train", 0, launcher.run_dir, []))
        launcher.wait(["train"], what="single-process training")
        res = launcher.result("train")
        return {
            "steps": args.steps,
            "updates_per_s": c.rate(args.steps, res["t_first"], res["t_last"]),
            "test_accuracy": res["test_accuracy"],
            "ps_max_rss_mb": None,
            "notes": f"1 process, 1 intra-op + 1 inter-op thread; final batch loss {res['loss']:.4f}; "
            + c.cpu_per_update_ms({"train": tuple(res["cpu"])}, args.steps - 1),
        }

    framework = "tensorflow" if args.framework == "tf" else args.framework  # as the other peers name them
    return c.run_launcher(args, "single", framework, body)


def main() -> int:
    p = c.parser(__doc__.splitlines()[0])
    p.add_argument("--framework", choices=sorted(TRAIN), default="torch")
    args = p.parse_args()
    if args.role is None:
        return launch(args)
    task(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
