"""A ps's side of shared memory: the workers on this host whose buffers it has mapped (see :mod:`psdk.shm`).

A worker offers its buffers with ``attach``; from then on its gradient is
read where it lies, the parameters are written back into its memory, and,
with doorbells and knocks, neither crosses the socket at all. Anything that
does not work leaves that worker on plain frames: a refusal is an answer,
never a failure of the job.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from psdk.errors import ProtocolError
from psdk.logs import RateLimitedLog
from psdk.ps.outbox import Outbox
from psdk.ps.sessions import session_of
from psdk.shm import AttachedBuffers
from psdk.store import ParameterStore
from psdk.transport import Incoming, ServerEndpoint
from psdk.wire import Message

log = logging.getLogger("psdk.ps.server")


class SharedMemorySessions:
    def __init__(self, endpoint: ServerEndpoint, store: ParameterStore, outbox: Outbox, name: str):
        self.endpoint, self.store, self.outbox, self.name = endpoint, store, outbox, name
        self.by_worker: dict[int, AttachedBuffers] = {}
        self._refusals = RateLimitedLog(log)  # shared memory turned down: the worker goes on over frames
        self._grad_copy = np.zeros(0, np.float32)
        """A gradient in a worker's shared memory is copied here before it is measured (see psdk.store)."""

    def on_attach(self, peer: bytes, message: Message, worker: int) -> None:
        """Map a worker's shared memory; a refusal leaves it on frames."""
        if not self.store.initialized:
            raise ProtocolError("the store is not initialised yet (the chief initialises it)")
        self.let_go(worker)
        try:
            if not self.endpoint.shares_memory:
                raise ProtocolError(f"{self.name} does not take shared memory (transport.shared_memory=false)")
            shared = AttachedBuffers(message.fields, self.store.size, pipes=self.endpoint.knocks)
        except Exception as exc:  # not an attack on the store (nor a reason to fail): the worker goes on with frames
            self._refusals.info("%s: worker %d stays on ZeroMQ frames: %.300s", self.name, worker, exc)
            self.outbox.send(peer, message.rid, "refused", {"error": str(exc)})
            return
        shared.session = session_of(peer)
        self.by_worker[worker] = shared
        knock = shared.knock >= 0 and self.endpoint.knocks
        if knock:
            self.endpoint.listen(shared.knock, lambda: self._knocked(worker, shared))
        self.outbox.send(peer, message.rid, "attached", {"bell": shared.bell >= 0, "knock": knock})

    def _knocked(self, worker: int, shared: AttachedBuffers) -> Incoming | None:
        """A knock, as the ``push_pull`` message it stands for, from the session that attached."""
        try:
            taken = shared.take_knock()
        except Exception:  # a bug here must not end the serving loop, which called this outside handle()
            self.outbox.internal_errors.exception("%s: internal error reading worker %d's knock", self.name, worker)
            shared.hung_up = True
            taken = None
        if shared.hung_up:  # the worker closed its buffers or is gone (membership notices that on its own)
            if self.by_worker.get(worker) is shared:
                self.let_go(worker)
            else:
                self.endpoint.unlisten(shared.knock)
                shared.close()
            return None
        if taken is None:
            return None
        rid, fields = taken
        return Incoming(shared.session, Message("push_pull", {"worker": worker, **fields}, [], rid))

    def let_go(self, worker: int) -> None:
        """Unmap ``worker``'s memory (it finished, pushes in frames, or a new process of it came)."""
        shared = self.by_worker.pop(worker, None)
        if shared is not None:
            if shared.knock >= 0:
                self.endpoint.unlisten(shared.knock)
            shared.close()

    def let_go_all(self) -> None:
        for worker in list(self.by_worker):
            self.let_go(worker)

    def gradient(self, worker: int, slot: Any, needs_stable: bool) -> np.ndarray:
        """The gradient ``worker`` pushed in its memory; a copy of it when the apply ``needs_stable`` input.

        The worker may rewrite its memory during the apply (it computes the
        next gradient into it), so a rule that reads the gradient twice (to
        check it, then to apply it) gets a copy that cannot change between.
        """
        shared = self.by_worker.get(worker)
        if shared is None:
            raise ProtocolError(f"worker {worker} pushed through shared memory it has not offered to {self.name}")
        grad = shared.gradient(slot)
        if not needs_stable:
            return grad
        if self._grad_copy.shape != grad.shape:
            self._grad_copy = np.empty(grad.shape, np.float32)
        np.copyto(self._grad_copy, grad)
        return self._grad_copy

    def send_params(self, worker: int, peer: bytes, params: np.ndarray, rid: int, fields: dict[str, Any]) -> bool:
        """Answer ``rid`` through ``worker``'s memory if it has offered some; ``False``: send them in a frame.

        Never for a request of an earlier process of this worker (a late
        answer to a dead one's parked push), whose memory is not this one.
        """
        shared = self.by_worker.get(worker)
        if shared is None or shared.session != session_of(peer):
            return False
        if shared.write_params(params, rid, fields):
            self.outbox.count_rang()  # the worker's doorbell rang: no message at all
            return True
        self.outbox.deliver(peer, Message("params", {**fields, "shm": True}, [], rid))
        return True
