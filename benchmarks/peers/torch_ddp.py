"""PyTorch DistributedDataParallel over gloo: N processes, synchronous allreduce, no ps.

What PyTorch users reach for instead of a parameter server: every rank holds
a full replica, ``DDP`` allreduces (averages) the gradients during
``backward()``, and every rank applies the same ``torch.optim.SGD`` step, so
one optimizer step = one global update made of N gradients (sync only; there
is no async DDP). Written as the "Getting Started with Distributed Data
Parallel" tutorial does: ``dist.init_process_group("gloo", ...)``, the model
wrapped in ``DDP``, a plain ``zero_grad``/``backward``/``step`` loop.

* gloo over 127.0.0.1: ``init_method=tcp://127.0.0.1:<free port>`` (rank 0
  hosts the TCPStore) and ``GLOO_SOCKET_IFNAME=lo`` unless already set, so it
  runs in a loopback-only network namespace.
* 1 intra-op and 1 inter-op thread per rank (``torch.set_num_threads(1)``,
  ``torch.set_num_interop_threads(1)``); DDP's defaults otherwise (one 25 MB
  bucket holds all 79,510 parameters, so one allreduce per step).
* updates/s on rank 0: optimizer steps ÷ (time of its last step - time of
  its first step), as psdk counts. Rank 0 evaluates the final replica on the
  test set. ``ps_max_rss_mb`` is null: there is no ps.

Where the time goes: ~2.5 ms of CPU per step and rank against ~1.1 ms for
the single-process step; a bare gloo allreduce of the 318 KB of gradients
costs ~0.6-0.7 ms of CPU on loopback, the rest is DDP's bucket copies,
hooks and the wait for the other rank. ``gradient_as_bucket_view=True``
made no measurable difference, so the tutorial's defaults stay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rank, world = args.task_index, args.workers
    data = c.load_data(args.data, rank, world, with_test=rank == 0)
    init = c.initial_weights(args.seed)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{int(args.ports)}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(10.0, args.deadline - time.time())),
    )
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
    with torch.no_grad():  # TF layout (in, out) -> torch (out, in)
        model[0].weight.copy_(torch.from_numpy(init["hidden1/kernel"].T))
        model[0].bias.copy_(torch.from_numpy(init["hidden1/bias"]))
        model[2].weight.copy_(torch.from_numpy(init["logits/kernel"].T))
        model[2].bias.copy_(torch.from_numpy(init["logits/bias"]))
    ddp = DDP(model)  # broadcasts rank 0's parameters: a barrier too
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, rank)

    cpu0 = c.cpu_s()
    t_first = 0.0
    for step in range(args.steps):
        xb, yb = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        if step == 0:
            t_first, cpu0 = time.time(), c.cpu_s()
    t_last, cpu1 = time.time(), c.cpu_s()

    result: dict[str, Any] = {"t_first": t_first, "t_last": t_last, "cpu": [cpu0, cpu1]}
    if rank == 0:
        with torch.no_grad():
            pred = model(torch.from_numpy(data.test_x)).argmax(1)
            result["test_accuracy"] = float((pred == torch.from_numpy(data.test_y)).float().mean())
    c.write_result(args.run_dir, f"rank{rank}", result)
    # Rank 0 hosts the TCPStore: if it tears down first, a rank still leaving
    # gloo can find the store gone and abort ("terminate called without an
    # active exception", seen once in CI). The other ranks leave first; rank 0
    # leaves once all of them have (a marker-file barrier, no store involved).
    if rank != 0:
        dist.destroy_process_group()
    with contextlib.suppress(TimeoutError):  # past the deadline the launcher reports the run; still leave gloo
        c.barrier(args.run_dir, "left", rank, world, args.deadline)
    if rank == 0:
        dist.destroy_process_group()


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        (port,) = c.free_ports(1)
        ranks = [f"rank{i}" for i in range(args.workers)]
        for i, name in enumerate(ranks):
            launcher.start(name, c.task_argv(args, "rank", i, launcher.run_dir, [port]))
        launcher.wait(ranks, what="training")
        results = {r: launcher.result(r) for r in ranks}
        head = results["rank0"]
        cpu = {r: tuple(res["cpu"]) for r, res in results.items()}
        return {
            "steps": args.steps,
            "updates_per_s": c.rate(args.steps, head["t_first"], head["t_last"]),
            "test_accuracy": head["test_accuracy"],
            "ps_max_rss_mb": None,
            "notes": f"DDP, gloo over 127.0.0.1, {args.workers} ranks, one allreduce bucket; updates/s on rank 0; "
            + c.cpu_per_update_ms(cpu, args.steps - 1),
        }

    return c.run_launcher(args, "torch_ddp", "torch", body)


def main() -> int:
    args = c.parser(__doc__.splitlines()[0], modes=("sync",)).parse_args()
    if args.role is None:
        return launch(args)
    c.task_setup()
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
