"""A parameter server on PyTorch's ``torch.distributed.rpc``, as PyTorch's own tutorials build one.

Sources followed: "Implementing a Parameter Server Using Distributed RPC
Framework" (the process layout: a ``ps`` rank that only serves and then calls
``rpc.shutdown()``, trainer ranks that get an ``RRef`` to the server through
``rpc.remote`` and drive their own loop) and "Implementing Batch RPC
Processing Using Asynchronous Executions" (the update path: a static
``update_and_fetch_model(ps_rref, grads)`` called with ``rpc.rpc_sync(
ps_rref.owner(), ...)``: one round trip per step that pushes the gradients
and brings back the parameters).

* The ps owns the parameters (an ``nn.Sequential``) and a ``torch.optim.SGD``
  (lr 0.1, no momentum); workers compute gradients on their own shard.
* async: the gradient is applied on arrival under a lock (``p.grad = g``,
  ``optimizer.step()``) and the new parameters go straight back.
* sync: ``@rpc.functions.async_execution``: the handler adds the gradient to
  ``p.grad`` and returns a ``torch.futures.Future``; the N-th arrival
  divides by N, steps the optimizer, and completes the future all N callers
  wait on (exactly the tutorial's ``BatchUpdateParameterServer``).
* The ps stops applying at ``--steps`` updates; a push that arrives later is
  answered with the final parameters and the step count, and every worker
  stops once the step count it gets back reaches ``--steps``.

Two deliberate choices beyond the tutorials, both to keep this peer honest
rather than a strawman:

* Transport: ``TensorPipeRpcBackendOptions(_transports=["uv"])``
  (``--tp-transports``, default ``uv``). TensorPipe's default prefers its
  ``shm`` transport between processes on one host, whose reactor thread
  busy-polls: one core per process. With 3 processes on 2 cores that
  reactor took most of the CPU (per-thread accounting: ``TP_SHM_reactor``
  used more CPU than the training itself) and the ps measured 3-4x fewer
  updates/s (sync: ~45 vs ~150 updates/s; CPU per update ~25 ms vs ~7 ms
  summed over the 3 processes). The ``uv`` (TCP loopback, event-driven)
  transport is what a user on a small machine would pick once they saw
  that; ``--tp-transports default`` measures TensorPipe's own choice.
* Channel: ``_channels=["basic"]`` (``--tp-channels``, default ``basic``):
  tensors travel inline on the ``uv`` connection. A bare ``rpc_sync``
  echoing the MLP's four tensors (318 KB each way) took 0.91-0.93 ms with
  ``basic``, 0.99-1.05 ms with ``cma`` (the receiver reads the sender's
  memory with ``process_vm_readv``) and 1.04-1.08 ms with TensorPipe's own
  choice (so it picks ``cma`` or similar here); ``mpt_uv`` took 2.5 ms. This
  peer measured 4-18% more updates/s async and 4-19% sync with ``basic``
  than with TensorPipe's choice (three alternating pairs each).
* The reply carries the parameter tensors (a list, cloned under the lock),
  not the pickled ``nn.Module`` the batch tutorial returns: the same data
  without pickling a module's Python state every step, which cost the ps
  ~0.5 ms of CPU per update (~+35%) in async mode in our runs.

TensorPipe backend, ``init_method=tcp://127.0.0.1:<free port>``; every
process runs ``torch.set_num_threads(1)`` and ``torch.set_num_interop_threads(1)``
and the RPC agent's thread pool has ``num_worker_threads=RPC_THREADS`` (4;
the default is 16, and 1, 2, 4 and 16 measured the same within noise;
TensorPipe's own I/O threads come on top). updates/s is measured where the
updates are applied: the ps records the time of its first and its last
applied update (updates ÷ (last - first), as psdk counts). Worker 0
evaluates the final parameters (it holds them when it stops), so the ps's
peak RSS never includes the test set.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

# RPC pickles functions by qualified name and decides on the *caller* whether
# a function is ``async_execution``, so tasks need the decorated class at
# import time; the launcher (no ``--role``) must not import torch at all.
if "--role" in sys.argv:
    from torch.distributed.rpc.functions import async_execution
else:

    def async_execution(fn: Any) -> Any:  # the launcher never calls it
        return fn


RPC_THREADS = 4
PS_NAME = "ps"

# The ps's state lives in this module of the ps process (the tutorial's global ``param_server``).
_param_server: Any = None


def worker_name(i: int) -> str:
    return f"worker{i}"


def build_model(seed: int) -> Any:
    """The MLP with psdk's initial weights (TF kernels (in, out) -> torch weights (out, in))."""
    import torch
    from torch import nn

    init = c.initial_weights(seed)
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(init["hidden1/kernel"].T))
        model[0].bias.copy_(torch.from_numpy(init["hidden1/bias"]))
        model[2].weight.copy_(torch.from_numpy(init["logits/kernel"].T))
        model[2].bias.copy_(torch.from_numpy(init["logits/bias"]))
    return model


class ParameterServer:
    """The tutorial's ``BatchUpdateParameterServer``, with an apply-on-arrival twin for async."""

    def __init__(self, seed: int, lr: float, batch_update_size: int, steps: int) -> None:
        import torch

        self.model = build_model(seed)
        self.lock = threading.Lock()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.steps = steps
        self.updates = 0
        self.first_update: float | None = None
        self.last_update: float | None = None
        self.cpu_first: float | None = None
        self.cpu_last: float | None = None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.future_model = torch.futures.Future()

    def get_model(self) -> tuple[int, list[Any]]:
        with self.lock:
            return self.updates, self._snapshot()

    def _snapshot(self) -> list[Any]:
        return [p.detach().clone() for p in self.model.parameters()]

    def _stepped(self) -> None:
        """Bookkeeping after an applied update (the lock is held)."""
        self.updates += 1
        now = time.time()
        if self.first_update is None:
            self.first_update, self.cpu_first = now, c.cpu_s()
        self.last_update = now
        if self.updates == self.steps:
            self.cpu_last = c.cpu_s()

    @staticmethod
    @async_execution
    def update_and_fetch_model(ps_rref: Any, grads: list[Any]) -> Any:
        """sync: aggregate ``batch_update_size`` gradients, then answer every caller at once."""
        self = ps_rref.local_value()
        with self.lock:
            fut = self.future_model
            if self.updates >= self.steps:  # finished: nobody else will arrive to complete a batch
                done = type(fut)()
                done.set_result((self.updates, self._snapshot()))
                return done
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self._stepped()
                fut.set_result((self.updates, self._snapshot()))
                self.future_model = type(fut)()
        return fut

    @staticmethod
    def apply_and_fetch_model(ps_rref: Any, grads: list[Any]) -> tuple[int, list[Any]]:
        """async: apply this gradient now and answer with the new parameters."""
        self = ps_rref.local_value()
        with self.lock:
            if self.updates < self.steps:
                for p, g in zip(self.model.parameters(), grads, strict=True):
                    p.grad = g
                self.optimizer.step()
                self._stepped()
            return self.updates, self._snapshot()


_ps_lock = threading.Lock()


def get_parameter_server(seed: int, lr: float, batch_update_size: int, steps: int) -> ParameterServer:
    """Runs on the ps (via ``rpc.remote``): the one server object, created by the first caller."""
    global _param_server
    with _ps_lock:
        if _param_server is None:
            _param_server = ParameterServer(seed, lr, batch_update_size, steps)
        return _param_server


def rpc_options(args: argparse.Namespace, port: int) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=RPC_THREADS,
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=max(10.0, args.deadline - time.time()),
        _transports=None if args.tp_transports == "default" else args.tp_transports.split(","),
        _channels=None if args.tp_channels == "default" else args.tp_channels.split(","),
    )


def set_threads() -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def run_ps(args: argparse.Namespace, port: int) -> None:
    from torch.distributed import rpc

    set_threads()
    rpc.init_rpc(PS_NAME, rank=0, world_size=args.workers + 1, rpc_backend_options=rpc_options(args, port))
    c.log("ps: serving")
    rpc.shutdown()  # waits for every worker to finish and shut down
    ps = _param_server
    c.write_result(
        args.run_dir,
        "ps",
        {
            "updates": ps.updates if ps else 0,
            "first_update": ps.first_update if ps else None,
            "last_update": ps.last_update if ps else None,
            "cpu": [ps.cpu_first, ps.cpu_last] if ps else [None, None],
            "max_rss_mb": c.max_rss_mb(),
        },
    )


def run_worker(args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed import rpc

    set_threads()
    index, n = args.task_index, args.workers
    data = c.load_data(args.data, index, n, with_test=index == 0)
    model = build_model(args.seed)  # only its structure matters: parameters come from the ps
    rpc.init_rpc(worker_name(index), rank=index + 1, world_size=n + 1, rpc_backend_options=rpc_options(args, port))
    batch_update_size = n if args.mode == "sync" else 1
    ps_rref = rpc.remote(PS_NAME, get_parameter_server, args=(args.seed, args.lr, batch_update_size, args.steps))
    update = ParameterServer.update_and_fetch_model if args.mode == "sync" else ParameterServer.apply_and_fetch_model
    params = list(model.parameters())

    def load(values: list[Any]) -> None:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)

    step, values = ps_rref.rpc_sync().get_model()
    load(values)
    batches = c.Batches(data.train_x, data.train_y, args.batch, args.seed, index)
    c.barrier(args.run_dir, "start", index, n, args.deadline)
    cpu0, local_steps = c.cpu_s(), 0
    while step < args.steps:
        xb, yb = next(batches)
        model.zero_grad()
        loss = F.cross_entropy(model(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        step, values = rpc.rpc_sync(ps_rref.owner(), update, args=(ps_rref, [p.grad for p in params]))
        load(values)
        local_steps += 1
    cpu1 = c.cpu_s()
    c.log(f"worker {index}: {local_steps} local steps, global step {step}")

    result: dict[str, Any] = {"local_steps": local_steps, "cpu": [cpu0, cpu1], "final_step": step}
    if index == 0:
        with torch.no_grad():
            pred = model(torch.from_numpy(data.test_x)).argmax(1)
            result["test_accuracy"] = float((pred == torch.from_numpy(data.test_y)).float().mean())
    c.write_result(args.run_dir, worker_name(index), result)
    rpc.shutdown()


def task(args: argparse.Namespace) -> None:
    c.task_setup()
    port = int(args.ports)
    if args.role == "ps":
        run_ps(args, port)
    else:
        run_worker(args, port)


def launch(args: argparse.Namespace) -> int:
    def body(launcher: c.Launcher) -> dict[str, Any]:
        (port,) = c.free_ports(1)
        workers = [worker_name(i) for i in range(args.workers)]
        launcher.start("ps", c.task_argv(args, "ps", 0, launcher.run_dir, [port]))
        for i, name in enumerate(workers):
            launcher.start(name, c.task_argv(args, "worker", i, launcher.run_dir, [port]))
        launcher.wait([*workers, "ps"], what="training")
        ps = launcher.result("ps")
        results = {w: launcher.result(w) for w in workers}
        cpu = {"ps": tuple(ps["cpu"])} | {w: tuple(r["cpu"]) for w, r in results.items()}
        local = ", ".join(f"{w}: {r['local_steps']}" for w, r in results.items())
        notes = (
            f"torch.distributed.rpc, TensorPipe transports={args.tp_transports}, channels={args.tp_channels}, "
            f"num_worker_threads={RPC_THREADS}; "
            + ("update_and_fetch_model with @rpc.functions.async_execution" if args.mode == "sync" else "")
            + ("apply on arrival under a lock" if args.mode == "async" else "")
            + f"; updates/s on the ps; updates {ps['updates']}; local steps {local}; "
            + c.cpu_per_update_ms(cpu, ps["updates"])
        )
        return {
            "steps": args.steps,
            "updates_per_s": c.rate(ps["updates"], ps["first_update"], ps["last_update"]),
            "test_accuracy": results[workers[0]]["test_accuracy"],
            "ps_max_rss_mb": ps["max_rss_mb"],
            "notes": notes,
        }

    return c.run_launcher(args, "torch_rpc_ps", "torch", body)


def main() -> int:
    p = c.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--tp-transports",
        default="uv",
        help="TensorPipe transports, comma-separated, or 'default' for TensorPipe's own choice (shm first; "
        "its reactor busy-polls a core per process)",
    )
    p.add_argument(
        "--tp-channels",
        default="basic",
        help="TensorPipe CPU channels, comma-separated, or 'default' for TensorPipe's own choice (4-19%% fewer "
        "updates/s here than basic)",
    )
    args = p.parse_args()
    if args.role is None:
        return launch(args)
    task(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
