"""Shared memory as the ZeroMQ transport's business: what each side of a link lent, mapped, and rang.

A worker's endpoint lends a server its buffers for one shard with a
transport-level ``attach`` (never seen by the ps or the client); from then
on a request whose one array *is* a lent region travels as a wire header
naming the region (``lent``), by knock or message, and a reply the ps marks
``in_place`` is written into the worker's memory and rung, or sent as a
header naming it. Both endpoints hand their side ordinary messages: the ps
gets borrowed views of the worker's regions, the client gets its own
``params`` buffer. See :mod:`psdk.transport.shm` for the memory file and its checks.

Anything that fails leaves that link on plain frames: a refused offer is
logged, never an error of the job.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from psdk.errors import ProtocolError, PsdkError
from psdk.runtime.logs import RateLimitedLog
from psdk.transport import Incoming, ShardBuffers
from psdk.transport.compact import Packer, Unpacker
from psdk.transport.shm import HEAP, REPLY_SLOT, AttachedBuffers, WorkerBuffers
from psdk.transport.wire import MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES, MalformedMessage, Message, decode_reply

PUSH_PULL = "push_pull"
"""The one request whose float arrays in a heap (row gradients) the ps may read in place; every other
request's (a chief's init or restore, whose values are checked and then kept) are copied out."""

log = logging.getLogger(__name__)

ATTACH, ATTACHED, REFUSED = "transport:attach", "transport:attached", "transport:refused"
"""The transport's own ops: a worker's offer and the ps endpoint's two answers."""
UNLENT = "transport:unlent"
"""The ps endpoint's answer to a request naming memory it holds none of (it let go, or is a new process):
the worker's endpoint sends that request again, whole, in frames."""
CONTROL_PREFIX = "transport:"
PROBE = "transport:probe"
"""Sent by a ps endpoint to learn whether a peer's connection is still open; a worker's endpoint ignores it."""
MAX_LINKS = 256
"""Lent memories a ps endpoint maps at once (each holds up to two pipes open)."""
AWAITED_KEPT = 64
"""Request ids a worker's link remembers as unanswered: older ones were abandoned long ago."""


class ServerLinks:
    """A ps endpoint's side: the memory each peer lent it, its knock pipes, and replies written in place."""

    def __init__(self, name: str, max_size: int, knocks: bool, watch: Callable[[int, bool], None]):
        self.name, self.knocks = name, knocks
        self.max_size = max_size
        """The most floats one lent memory may hold: what one message may (the endpoint lowers it with its limit)."""
        self._watch = watch
        """``watch(fd, True)``: wake the endpoint's receive when ``fd`` is readable; ``False``: stop."""
        self.by_peer: dict[bytes, AttachedBuffers] = {}
        self._users: dict[bytes, str | None] = {}
        self._by_knock: dict[int, bytes] = {}
        self._unread: set[bytes] = set()
        """Peers whose memory holds a reply they may not have read: the next one goes whole, in frames."""
        self._refusals = RateLimitedLog(log)
        self.answers: Counter[str] = Counter()
        """Offers taken (``ATTACHED``) and turned down (``REFUSED``), for logs and tests."""
        self._packer = Packer(MAX_REPLY_HEADER_BYTES)  # reply headers written in place
        self._unpackers: dict[bytes, Unpacker] = {}  # per peer: one peer's layouts cannot crowd out another's

    def attach(self, peer: bytes, user: str | None, offer: Message, allowed: bool) -> Message:
        """Map what ``peer`` offers; the answer (attached, or refused with why) for the endpoint to send."""
        self.forget(peer)
        try:
            if not allowed:
                raise ProtocolError(f"{self.name} does not take shared memory (transport.shared_memory=false)")
            if len(self.by_peer) >= MAX_LINKS:
                raise ProtocolError(f"{self.name} already maps {MAX_LINKS} workers' memory")
            lent = AttachedBuffers(offer.fields, self.max_size, pipes=self.knocks)
        except Exception as exc:  # not an attack on the ps (nor a reason to fail): the worker goes on with frames
            self.answers[REFUSED] += 1
            who = user or "a worker"  # the key's name (worker-1) under CURVE: the endpoint knows no worker ids
            self._refusals.info("%s: %s stays on ZeroMQ frames: %.300s", self.name, who, exc)
            return Message(REFUSED, {"error": str(exc)}, [], offer.rid)
        self.answers[ATTACHED] += 1
        self.by_peer[peer], self._users[peer] = lent, user
        self._unpackers[peer] = Unpacker(MAX_HEADER_BYTES)
        if lent.knock >= 0:
            self._by_knock[lent.knock] = peer
            self._watch(lent.knock, True)
        return Message(ATTACHED, {"bell": lent.bell >= 0, "knock": lent.knock >= 0}, [], offer.rid)

    def unlent(self, peer: bytes, message: Message) -> Message | None:
        """The answer to ``message`` if it names memory ``peer`` has not lent (None: it has, resolve it)."""
        if peer in self.by_peer:
            return None
        why = f"{self.name} holds no memory of this connection (it let it go, or restarted): send it whole"
        return Message(UNLENT, {"error": why}, [], message.rid)

    def heard(self, peer: bytes) -> None:
        """A request came from ``peer``: it has read every reply written into its memory before.

        A worker asks again only once it has its answer, so one reply at a
        time lies in its memory. One that asks before (a pipelined status
        request, a misbehaving peer with several pushes parked) gets the
        replies beyond the first in frames: none overwrites one unread.
        """
        self._unread.discard(peer)

    def resolve(self, peer: bytes, message: Message) -> Message:
        """``message`` with the regions it names as its arrays (borrowed), or a ProtocolError saying why not."""
        lent = self.by_peer.get(peer)
        if lent is None:
            raise MalformedMessage(f"the request names memory its sender has not lent to {self.name}", message.rid)
        if message.arrays:
            raise MalformedMessage("a request carries its arrays in frames or in lent memory, not both", message.rid)
        names = message.lent
        if HEAP in names[:-1] or names[:1] == [HEAP]:
            raise MalformedMessage(f"a request names the {HEAP} once, last, after a region", message.rid)
        try:
            message.arrays = [lent.region(slot) for slot in names if slot != HEAP]
            if names[-1] == HEAP:  # ids copied out now: the ps never indexes with ids the worker could change
                message.arrays += lent.take_arrays(message.rid, borrow_values=message.op == PUSH_PULL)
        except ProtocolError as exc:
            raise MalformedMessage(str(exc), message.rid) from None
        except Exception as exc:  # what a worker wrote must never end the ps: a refusal, whatever it was
            raise MalformedMessage(f"unreadable arrays in shared memory: {exc!r:.200}", message.rid) from None
        message.lent, message.borrowed = [], True
        return message

    def knocked(self, fd: int) -> Incoming | None:
        """The request a knock on ``fd`` stands for, from the connection that attached; ``None`` if none."""
        peer = self._by_knock.get(fd)
        lent = self.by_peer.get(peer) if peer is not None else None
        if peer is None or lent is None:
            self._watch(fd, False)
            return None
        try:
            taken = lent.take_knock()
        except Exception:  # a bug here must not end the serving loop
            self._refusals.exception("%s: internal error reading a worker's knock", self.name)
            lent.hung_up, taken = True, None
        if lent.hung_up:  # the worker closed its buffers or is gone (the ps notices that on its own)
            self.forget(peer)
            return None
        if taken is None:
            return None
        rid, header = taken
        self.heard(peer)
        user = self._users.get(peer)
        try:
            message = self._unpackers[peer].unpack(header)
            if not message.lent:
                raise MalformedMessage("a knocked request must name the memory holding its arrays", message.rid)
            return Incoming(peer, self.resolve(peer, message), user=user, nbytes=len(header))
        except MalformedMessage as exc:
            return Incoming(peer, None, exc, rid=exc.rid if exc.rid is not None else rid, user=user)

    def reply_room(self, peer: bytes, rid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Room in ``peer``'s memory for the rows of the reply to ``rid``, if :meth:`write` will put it there."""
        lent = self.by_peer.get(peer)
        if lent is None or peer in self._unread:
            return None
        return lent.reply_room(rid, shapes)

    def write(self, peer: bytes, message: Message) -> bool | None:
        """Put ``message``'s arrays in ``peer``'s memory (the first as its parameters, any others in its heap):
        True if rung, False if its header must still go (naming :func:`reply_regions`), ``None`` if it could
        not be written there at all (send it whole)."""
        lent = self.by_peer.get(peer)
        if lent is None or not message.arrays or peer in self._unread:
            return None
        array, rest = message.arrays[0], message.arrays[1:]
        if array.dtype != np.float32 or array.shape != (lent.size,) or not lent.fits(rest):
            return None
        self._unread.add(peer)
        header = self._packer.pack(message, reply_regions(message)) if lent.bell >= 0 else None
        return lent.write_reply(array, message.rid, header, rest)

    def forget(self, peer: bytes) -> None:
        lent = self.by_peer.pop(peer, None)
        self._users.pop(peer, None)
        self._unpackers.pop(peer, None)
        self._unread.discard(peer)
        if lent is not None:
            if lent.knock >= 0:
                self._by_knock.pop(lent.knock, None)
                self._watch(lent.knock, False)
            lent.close()

    def close(self) -> None:
        for peer in list(self.by_peer):
            self.forget(peer)


def reply_regions(message: Message) -> list[str]:
    """What a reply written into lent memory names: the parameters, and the heap if it has more arrays."""
    return [REPLY_SLOT, HEAP] if len(message.arrays) > 1 else [REPLY_SLOT]


@dataclass
class _Lent:
    """What a worker lent one server, and how far that server took it."""

    memory: WorkerBuffers
    params: np.ndarray
    offer_rid: int = 0
    attached: bool = False
    knocks: bool = False
    awaited: list[int] = field(default_factory=list)
    """Requests sent over this link not answered yet, oldest first: only their replies may land in ``params``."""
    sent: dict[int, Message] = field(default_factory=dict)
    """Requests that left naming this memory, as they were: sent again whole if the server holds it no more."""


class ClientLinks:
    """A worker endpoint's side: its lent buffers per server, their doorbells, knocks and landed replies."""

    def __init__(self, peers: list[str], doorbells: bool, watch: Callable[[int, bool], None]):
        self.peers, self.doorbells = peers, doorbells
        self._watch = watch
        self.by_index: dict[int, _Lent] = {}
        self._by_bell: dict[int, int] = {}
        self._packer = Packer(MAX_HEADER_BYTES)  # knocked request headers
        self._unpacker = Unpacker(MAX_REPLY_HEADER_BYTES)  # rung reply headers

    def lend(self, index: int, size: int, rid: int, heap: int = 0) -> tuple[ShardBuffers, Message | None]:
        """Buffers for server ``index`` and the offer to send it (None: memory could not be had, frames it is).

        ``heap``: bytes for a request's arrays after its first, and as many for a reply's (0: none).
        """
        self.release(index)
        try:
            memory = WorkerBuffers(size, heap)
        except OSError as exc:  # e.g. a memfd limit: plain frames work as well, only slower
            log.info("no shared memory for %s (%s); its arrays go over ZeroMQ", self.peers[index], exc)
            return ShardBuffers.private(size), None
        lent = self.by_index[index] = _Lent(memory, np.zeros(size, np.float32))
        if self.doorbells:
            self._by_bell[memory.bell] = index
            self._watch(memory.bell, True)
        return ShardBuffers(memory.grads, memory.outbox, lent.params), self.offer(index, rid)

    def offer(self, index: int, rid: int) -> Message | None:
        lent = self.by_index.get(index)
        if lent is None:
            return None
        lent.offer_rid, lent.attached, lent.knocks = rid, False, False
        return Message(ATTACH, lent.memory.offer(self.doorbells), [], rid)

    def outgoing(self, index: int, message: Message) -> tuple[Message, bytes | None]:
        """``message`` as it leaves: with its array named in lent memory if it lies there, and the header to
        knock with (if the server listens for knocks), else None: send the message."""
        lent = self.by_index.get(index)
        if lent is None:
            return message, None
        if message.rid not in lent.awaited:  # else sent again whole (the server let go of the memory)
            lent.awaited.append(message.rid)
        del lent.awaited[:-AWAITED_KEPT]
        slot = lent.memory.slot_of(message.arrays[0]) if lent.attached and message.arrays else None
        # A step's push (from the shard's long-lived buffers) is the request any rooms lent were for: it ends them
        # (here if it leaves without the heap; else its write into the heap does).
        if message.stable and (slot is None or len(message.arrays) == 1):
            lent.memory.end_rooms()
        if slot is None:
            return message, None
        names = [slot] if len(message.arrays) == 1 else [slot, HEAP]
        if len(names) > 1 and not lent.memory.put_arrays(message.rid, message.arrays[1:], message.stable):
            return message, None  # arrays the heap cannot hold: the whole message goes in frames
        light = Message(message.op, message.fields, [], message.rid, lent=names)
        lent.sent[message.rid] = message
        if len(lent.sent) > AWAITED_KEPT:  # the oldest, abandoned long ago
            del lent.sent[next(iter(lent.sent))]
        return light, self._packer.pack(message, names) if lent.knocks else None

    def room(self, index: int, shapes: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """Room in the up heap lent to server ``index`` (see :meth:`Heap.lend`) until the next step's push to it;
        None unless the server holds that memory and has answered every request sent it (none may still be
        reading the heap)."""
        lent = self.by_index.get(index)
        if lent is None or not lent.attached or lent.awaited:
            return None
        return lent.memory.lend_room(shapes)

    def knock(self, index: int, rid: int, header: bytes) -> bool:
        """Knock for request ``rid``; ``False``: the pipe broke (the server let go, or died), send it whole."""
        lent = self.by_index[index]
        if not lent.memory.fits(header):
            return False  # sent as a message, naming the region
        if lent.memory.knock(rid, header):
            return True
        self._lost(index, "its knock pipe broke")
        return False

    def _lost(self, index: int, why: str) -> None:
        """The server holds this memory no more: requests go whole until it is lent again (``renew``)."""
        lent = self.by_index.get(index)
        if lent is not None and lent.attached:
            log.info("%s let this worker's memory go (%s); arrays go over ZeroMQ", self.peers[index], why)
            lent.attached = lent.knocks = False

    def rung(self, fd: int) -> tuple[int, Message] | None:
        """Server index and reply a ring on doorbell ``fd`` announced, landed in ``params``; None if none."""
        index = self._by_bell.get(fd)
        lent = self.by_index.get(index) if index is not None else None
        if index is None or lent is None:
            return None
        taken = lent.memory.take_reply()
        if taken is None:
            return None
        message = decode_reply([taken[1]], self.peers[index], lambda frames: self._unpacker.unpack(frames[0]))
        landed = self.landed(index, message)
        return None if landed is None else (index, landed)

    def answered(self, index: int, message: Message) -> Message | None:
        """Take in the transport's own answer ``message``; the request to send again whole, if any.

        A request the server refused as naming memory it does not hold and
        that is no longer kept (long abandoned) comes back as an error reply.
        """
        if message.op == PROBE:
            return None
        if message.op == UNLENT:
            self._lost(index, str(message.fields.get("error")))
            lent = self.by_index.get(index)
            again = lent.sent.pop(message.rid, None) if lent is not None else None
            if again is not None:
                return again
            return Message("error", {"error": message.fields.get("error"), "kind": "protocol"}, [], message.rid)
        lent = self.by_index.get(index)
        if lent is not None and message.rid in lent.awaited:  # an offer: the server reads no heap for it
            lent.awaited.remove(message.rid)
        if lent is None or message.rid != lent.offer_rid:
            return None  # the answer to an offer since replaced
        lent.attached = message.op == ATTACHED
        if not lent.attached:
            log.info(
                "%s does not share memory (%s); arrays go over ZeroMQ", self.peers[index], message.fields.get("error")
            )
            self.release(index)  # its doorbell and memory file need not stay open: the buffers stay usable
            return None
        lent.knocks = bool(message.fields.get("knock")) and bool(message.fields.get("bell"))
        if lent.knocks:
            lent.memory.knocks_heard()
        return None

    def landed(self, index: int, message: Message) -> Message | None:
        """A reply as the client takes it, its array resolved from lent memory; None: not one to take."""
        lent = self.by_index.get(index)
        if not message.lent:
            if lent is not None and message.rid in lent.awaited:  # answered: never sent again, nothing to land
                lent.awaited.remove(message.rid)
                lent.sent.pop(message.rid, None)
            return message
        if lent is None or message.lent not in ([REPLY_SLOT], [REPLY_SLOT, HEAP]) or message.arrays:
            raise PsdkError(f"{self.peers[index]} answered through shared memory this worker did not lend it")
        if message.rid not in lent.awaited:
            return None  # a late answer to an abandoned request: its memory is not read
        lent.awaited.remove(message.rid)
        lent.sent.pop(message.rid, None)
        rest = lent.memory.read_params(lent.params, message.rid, heap=len(message.lent) > 1)
        message.arrays, message.lent = [lent.params, *rest], []
        return message

    def sharing(self, index: int) -> str:
        lent = self.by_index.get(index)
        if lent is None or not lent.attached:
            return "frames"
        return "shared memory, doorbell and knocks" if lent.knocks else "shared memory"

    def release(self, index: int) -> None:
        lent = self.by_index.pop(index, None)
        if lent is not None:
            if lent.memory.bell >= 0 and self._by_bell.pop(lent.memory.bell, None) is not None:
                self._watch(lent.memory.bell, False)
            lent.memory.close()

    def close(self) -> None:
        for index in list(self.by_index):
            self.release(index)
