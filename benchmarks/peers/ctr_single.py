"""CTR single-process baseline: psdk's DLRM in plain torch, one process, ``--threads`` threads (1).

The denominator of every CTR ratio, so it is the loop a user writes to go
fast on one machine with nothing a distributed run avoids:

* the table is ``nn.Embedding(capacity, dim, sparse=True)`` (rows drawn
  N(0, 0.01**2) with ``nn.init.normal_``, psdk's scale), the dense part is
  :class:`_ctr_torch.DenseDlrm` (``nn.Sequential`` MLPs, ``bmm`` and
  ``triu_indices`` for the 351 dots), the loss is the mean
  ``binary_cross_entropy_with_logits``;
* one ``torch.optim.Adagrad(lr, initial_accumulator_value=--init-acc, eps=0)``
  over every parameter: the sparse gradient of the table takes Adagrad's
  sparse path (only the batch's rows and accumulators change), the dense
  layers the dense one. ``eps=0`` is TF1's and psdk's (torch's default is
  1e-10; with an accumulator that starts at 0.1 the two give the same
  numbers to float32 precision);
* ``zero_grad``/``backward``/``step`` per batch, batches handed over with
  ``torch.from_numpy``; the batches are the workers' streams in turn
  (:func:`_ctr.interleaved_batches`), so it trains the examples a
  distributed run trains.

``time_split`` is wall milliseconds per step inside the loop: ``batch``
(generating it), ``forward`` (lookup, model and loss), ``backward`` and
``optimizer`` (``Adagrad.step``). The measured window, examples/s and CPU per
1,000 examples are :mod:`_ctr`'s (``--warmup`` steps left out).

Measured (10M ids, 2000 steps, ``nice -n 19`` on 2 shared cores): test AUC
0.7832 (the same in every run: one process, no races), 0.040-0.047 CPU
seconds per 1,000 examples, and ``optimizer`` 0.84-0.87x ``forward`` +
``backward`` (sparse Adagrad coalesces the gradient, then updates).
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
import _ctr

PHASES = ("batch", "forward", "backward", "optimizer")


def train(args: argparse.Namespace) -> dict[str, Any]:
    import _ctr_torch as t
    import torch
    from torch import nn

    t.set_threads(args.threads)
    torch.manual_seed(args.seed)
    emb = nn.Embedding(args.capacity, args.dim, sparse=True)
    nn.init.normal_(emb.weight, 0.0, _ctr.spec(args).init_scale)
    model = t.DenseDlrm(args)
    params = [emb.weight, *model.parameters()]
    opt = torch.optim.Adagrad(params, lr=args.lr, initial_accumulator_value=args.init_acc, eps=0.0)
    batches = _ctr.interleaved_batches(args)
    clock = _ctr.StepClock(args.run_dir, 0, args.steps, args.warmup)
    split = np.zeros((args.steps, len(PHASES)))

    for step in range(args.steps):
        t0 = time.perf_counter()
        dense, cat, labels = next(batches)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = t.loss_fn(model(torch.from_numpy(dense), emb(torch.from_numpy(cat))), labels)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        split[step] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        clock.tick()
    clock.finish()

    test = _ctr.test_set(args)
    logits = t.predict(model, test.dense, lambda a, b: emb(torch.from_numpy(test.cat[a:b])))
    measured = split[args.warmup :].mean(axis=0) * 1000.0
    return {
        "step_ends": clock.times(),
        "time_split": {name: round(float(ms), 3) for name, ms in zip(PHASES, measured, strict=True)},
        "score": _ctr.score(logits, test),
        "loss": float(loss.detach()),
        "max_rss_mb": c.max_rss_mb(),
    }


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        launcher.start("train", c.task_argv(args, "train", 0, launcher.run_dir, []))
        window = _ctr.measure_window(launcher, ["train"], 1)
        launcher.wait(["train"], what="single-process training")
        res = launcher.result("train")
        return {
            "examples": args.steps * args.batch,
            **window.figures([res["step_ends"]], args.batch),
            **res["score"],
            "ps_max_rss_mb": None,
            "time_split": res["time_split"],
            "notes": f"1 process, {args.threads} intra-op thread(s); nn.Embedding(sparse=True) + "
            f"torch.optim.Adagrad(lr={args.lr}, initial_accumulator_value={args.init_acc}, eps=0); "
            f"final batch loss {res['loss']:.4f}; peak RSS {res['max_rss_mb']:.0f} MB",
        }

    return _ctr.run_launcher(args, "ctr_single", "torch", body)


def main() -> int:
    args = _ctr.parser(__doc__.splitlines()[0]).parse_args()
    if args.role is None:
        return launch(args)
    c.task_setup()
    c.write_result(args.run_dir, "train", train(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
