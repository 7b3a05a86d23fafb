"""The chief's checkpoint pause of a shard, held as a lease its session must keep renewing.

A checkpoint is a consistent cut: the chief asks every shard to stop
applying pushes once it reaches one version (``pause_at``), reads their
state, and resumes them. A chief that dies in between used to leave every
shard paused for good: pushes were held, only ``resume`` or a restore
cleared the pause, and a restarted chief could not get the job going. Now
the pause belongs to the chief's session (its connection) and lasts only
while that session is heard from: every request of that session, its
heartbeats included, renews the lease, and a lease that runs out, a chief
declared dead, or a chief back on a new connection ends the pause; the
shard resumes by itself and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from psdk.ps.consistency import Push


@dataclass
class PauseLease:
    lease_s: float
    version: int | None = None
    """Pushes that would take the shard past this version wait (``None``: not paused)."""
    owner: bytes | None = None
    """The session (connection) of the chief that asked for it."""
    expires: float = 0.0
    waiters: list[tuple[bytes, int]] = field(default_factory=list)
    """The chief's ``pause_at`` requests waiting for the shard to reach ``version`` (peer, rid)."""
    pushes: list[Push] = field(default_factory=list)
    """Pushes that arrived while paused, applied when the pause ends (each holds a copy of its gradient)."""

    @property
    def held(self) -> bool:
        return self.version is not None

    def covers(self, store_version: int) -> bool:
        """Whether the shard is paused now: it has reached the version the chief asked for."""
        return self.version is not None and store_version >= self.version

    def hold(self, version: int, owner: bytes, now: float) -> None:
        self.version, self.owner, self.expires = version, owner, now + self.lease_s

    def renew(self, session: bytes, now: float) -> None:
        """A request from ``session``: if it holds the pause, the pause lasts another lease."""
        if self.version is not None and session == self.owner:
            self.expires = now + self.lease_s

    def lapsed(self, now: float) -> bool:
        return self.version is not None and now > self.expires

    def end(self) -> list[tuple[bytes, int]]:
        """No pause any more; the ``pause_at`` requests still waiting, to be answered."""
        waiters, self.waiters = self.waiters, []
        self.version, self.owner = None, None
        return waiters
