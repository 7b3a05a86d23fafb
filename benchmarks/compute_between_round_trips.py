"""Why a psdk worker's forward-backward pass costs more CPU than a single process's.

Inside a job a worker computes one gradient, then sends it, receives the
new parameters and copies them in, while the ps and the other worker run on
the same two cores. This script times psdk's own torch forward-backward pass
(the MLP, batch 100, real MNIST, parameters and gradients in flat buffers as
in a job) in one process, one thread, with different things between two
passes, and prints this thread's CPU time per pass and its ratio to passes
run back to back:

- nothing (the single-process baseline's situation);
- copying four 318 KB buffers (what one round trip moves through the worker);
- sweeping 32 MB of memory (what the caches see when everything else on the
  machine ran in between);
- sleeping 1 ms (the core is left to others while the worker waits).

Compare the figures with ``time_per_step.compute_cpu_ms`` in a job's
``summary.json``. Usage: ``python benchmarks/compute_between_round_trips.py
[--steps N]`` (reads MNIST from ``$PSDK_DATA_DIR``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="passes per measurement")
    parser.add_argument("--reps", type=int, default=3, help="measurements per situation (median)")
    args = parser.parse_args()

    import torch
    from psdk_torch.backend import TorchBackend
    from psdk_torch.mnist import TorchClassifier

    from psdk.data import mnist
    from psdk.plugins.models import ModelSpec, init_weights
    from psdk.protocol.sharding import flat_size, layout, views
    from psdk.workloads.mnist.workload import MnistShard

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    data = mnist.load(mnist.resolve_dir(None))
    first_half = mnist.split(data, 0, 2, validation_size=0, with_test=False)  # 30,000 training images
    backend = TorchBackend()
    trainer = TorchClassifier(backend)
    spec = ModelSpec()
    model = backend.build_model(spec, init_weights(spec, seed=0))
    specs = layout(spec.variables())
    params = np.zeros(flat_size(specs), np.float32)
    grads = np.zeros_like(params)
    param_views, grad_views = views(params, specs), views(grads, specs)
    for name, value in backend.read_weights(model).items():
        param_views[name][...] = value
    if not backend.share_buffers(model, param_views, grad_views):
        raise SystemExit("the torch backend did not take psdk's buffers")
    batches = iter(MnistShard(first_half, 2).batches(100, seed=1))
    buffers = [np.ones(params.size, np.float32) for _ in range(8)]
    sweep = np.ones(8_000_000, np.float32)

    def copies() -> None:
        for i in range(0, 8, 2):
            np.copyto(buffers[i], buffers[i + 1])

    def sweep_memory() -> None:
        sweep[::16] += 1.0  # one float per 64-byte line: every line of 32 MB

    situations: dict[str, Callable[[], None]] = {
        "back to back": lambda: None,
        "4 x 318 KB copies between": copies,
        "32 MB swept between": sweep_memory,
        "1 ms sleep between": lambda: time.sleep(0.001),
    }

    def measure(between: Callable[[], None]) -> float:
        cpu = 0.0
        for _ in range(args.steps):
            batch = next(batches)
            between()
            started = time.thread_time()
            trainer.forward_backward(model, batch)
            cpu += time.thread_time() - started
            np.subtract(params, 0.1 * grads, out=params)  # train, as the ps would: real values
        return 1000.0 * cpu / args.steps

    measure(situations["back to back"])  # warm up
    results = {name: [] for name in situations}  # type: dict[str, list[float]]
    for _ in range(args.reps):
        for name, between in situations.items():  # interleaved
            results[name].append(measure(between))
    base = float(np.median(results["back to back"]))
    print("| between two forward-backward passes | CPU ms per pass | ÷ back to back |")
    print("| --- | --- | --- |")
    for name, values in results.items():
        median = float(np.median(values))
        print(f"| {name} | {median:.3f} | {median / base:.2f}× |")


if __name__ == "__main__":
    main()
