"""Everything that moves a message between tasks, behind one interface.

The ps (:mod:`psdk.ps`) and the client (:mod:`psdk.client`) speak only the
contract re-exported here (:mod:`psdk.transport.contract`) and exchange
:class:`~psdk.transport.wire.Message` objects. What carries them is this
package's business alone:

* :mod:`psdk.transport.wire`: the wire format, checked before anything is built;
* :mod:`psdk.transport.zeromq`: the transport of every real job (ROUTER/DEALER sockets);
* :mod:`psdk.transport.security`: its CURVE keys and the authenticator that checks them;
* :mod:`psdk.transport.zmq_guard`: its per-connection memory and connection limits;
* :mod:`psdk.transport.shm` and :mod:`psdk.transport.lending`: its same-host shared
  memory, doorbells and knocks (the ps and the client see ordinary messages);
* :mod:`psdk.transport.inproc`: threads of one process, the proof that the interface is the boundary.
"""

from psdk.transport.contract import (
    WAIT_SLICE_S,
    ClientEndpoint,
    Incoming,
    Pending,
    ServerEndpoint,
    ShardBuffers,
    Transport,
    worker_name,
)

__all__ = [
    "WAIT_SLICE_S",
    "ClientEndpoint",
    "Incoming",
    "Pending",
    "ServerEndpoint",
    "ShardBuffers",
    "Transport",
    "worker_name",
]
