"""A worker's heartbeats: every shard pinged from sockets of their own, and when each last answered.

A wait for a reply gives up as soon as the ps it waits for has been silent
for longer than the heartbeat timeout, rather than at the request timeout;
the boot id each pong carries tells a ps that restarted from one that is slow.
"""

from __future__ import annotations

import contextlib
import threading
import time

from psdk.errors import TransportError
from psdk.protocol import ops as protocol
from psdk.transport import Transport


class Heartbeat(threading.Thread):
    """Pings every shard from its own sockets, and remembers when each last answered."""

    def __init__(
        self,
        transport: Transport,
        addresses: list[str],
        names: list[str],
        worker: int,
        interval_s: float,
        identity: bytes | None = None,
    ):
        super().__init__(name=f"psdk-heartbeat-{worker}", daemon=True)
        self.transport, self.addresses, self.names = transport, addresses, names
        self.worker, self.interval_s, self.identity = worker, interval_s, identity
        self.last_heard: list[float | None] = [None] * len(addresses)
        self.boot: list[str | None] = [None] * len(addresses)
        self._stop_event = threading.Event()
        self._ready = threading.Event()

    def run(self) -> None:
        endpoint = self.transport.connect(self.addresses, self.names, self.identity)
        self._ready.set()
        try:
            while not self._stop_event.is_set():
                for index in range(len(self.addresses)):
                    ping = protocol.request("ping", self.worker)
                    ping.rid = endpoint.new_rid()
                    # No connection or a full queue: the ps's silence tells the rest. Never wait here,
                    # or stop() would find this thread stuck on a socket about to be closed.
                    with contextlib.suppress(TransportError):
                        endpoint.send(index, ping, wait_s=0.0)
                deadline = time.monotonic() + self.interval_s
                while not self._stop_event.is_set() and (left := deadline - time.monotonic()) > 0:
                    for index, pong in endpoint.receive(min(left, 0.1)):
                        self.last_heard[index] = time.monotonic()
                        self.boot[index] = pong.fields.get("boot")
        finally:
            endpoint.close()

    def silence(self, index: int) -> float | None:
        heard = self.last_heard[index]
        return None if heard is None else time.monotonic() - heard

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5.0)
