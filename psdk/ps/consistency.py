"""Consistency policies: when a pushed gradient is applied to a shard.

* ``async``: each gradient is applied on arrival, one at a time per shard.
* ``ssp`` (stale synchronous parallel, bounded staleness ``s``): gradients
  are applied on arrival, but the reply that lets a worker start iteration c
  waits until every live worker has finished iteration c - s - 1 (dead
  workers leave the minimum), so no worker runs more than s iterations ahead
  of the slowest.
* ``sync`` (``SyncReplicasOptimizer``): a worker pushes at most one gradient
  per version, tagged with the version it was computed from; the shard
  applies the mean of the first ``replicas_to_aggregate`` gradients for its
  current version, once, and advances; gradients for an older version are
  dropped and counted. A push is answered when the shard has moved past the
  version it was computed from: that is the barrier. With fewer aggregated
  replicas than workers the rest are backup workers.

A policy decides; the ps server owns the sockets and answers the pushes a
policy hands back. A push's gradient is used once, when it is submitted
(applied, or added to the round's sum), and let go then: a push parked for
its answer holds no gradient, so parking costs no model-sized memory. A
gradient that would make the store (or the round's sum) non-finite raises
:class:`~psdk.errors.NonFiniteError` from ``submit`` with nothing changed;
a sync round whose mean cannot be applied is answered "dropped" to every
push in it, and those pushes are named in :attr:`Decision.refused`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from psdk.errors import ConfigError, NonFiniteError
from psdk.protocol.numerics import magnitude
from psdk.ps.rules import UpdateRule
from psdk.ps.store import ParameterStore
from psdk.ps.tables.requests import TableRequest
from psdk.ps.tables.served import RowGrad, merge_grads

MODES = ("async", "sync", "ssp")
USED = np.zeros(0, np.float32)
"""What a push's gradient becomes once it has been applied or summed: the frame behind it can go."""


@dataclass(frozen=True)
class SyncSpec:
    """The job's sync mode; every option of the ``sync`` config group has these keys.

    ``replicas_to_aggregate`` defaults to the number of workers; ``staleness``
    is read by the bounded-staleness mode and ignored by the others.
    ``scale_momentum``: see :meth:`rule_for`.
    """

    mode: str = "async"
    replicas_to_aggregate: int | None = None
    staleness: int = 0
    scale_momentum: bool = True

    def rule_for(self, rule: UpdateRule, num_workers: int) -> UpdateRule:
        """The update rule the ps runs: a rule's ``momentum`` μ as ``μ ** (workers - 1)`` with more than 2 async
        workers (``scale_momentum``).

        Asynchrony adds momentum of its own, about ``1 - 1/workers``
        (Mitliagkas et al. 2016, "Asynchrony begets momentum"), so a momentum
        that suits 2 workers overshoots with more: the default recipe
        (Nesterov 0.9, lr 0.1) fell to 0.886 test accuracy with 4 workers and
        to chance (0.1135) with 8. A gradient reaches the store about
        ``workers - 1`` updates late, and the rule keeps momentum's memory per
        such round: 0.9 becomes 0.73 with 4 workers and 0.48 with 8, which
        measured 0.979 and 0.975 where 0.8 and 0.6 made 0.930 and 0.964
        (``benchmarks/worker_scaling.py``; docs/sync-modes.md). Sync mode has
        no such momentum, and one or two workers keep the rule as given.
        """
        momentum = getattr(rule, "momentum", None)
        if not self.scale_momentum or self.waits_for_rounds or num_workers <= 2 or not momentum:
            return rule
        return dataclasses.replace(rule, momentum=float(momentum) ** (num_workers - 1))  # type: ignore[call-arg]

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("sync.mode", f"unknown sync mode {self.mode!r}", MODES)
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise ConfigError("sync.replicas_to_aggregate", f"must be at least 1, got {self.replicas_to_aggregate}")
        if self.staleness < 0:
            raise ConfigError("sync.staleness", f"must be >= 0, got {self.staleness}")

    def resolved(self, num_workers: int) -> SyncSpec:
        """This spec with ``replicas_to_aggregate`` filled in and checked."""
        replicas = self.replicas_to_aggregate or num_workers
        if self.waits_for_rounds and replicas > num_workers:
            raise ConfigError(
                "sync.replicas_to_aggregate",
                f"is {replicas} but the job has only {num_workers} workers, so a step would never gather "
                f"{replicas} gradients; use sync.replicas_to_aggregate={num_workers} or fewer (fewer than the "
                f"workers makes the rest backup workers), or topology.num_workers={replicas}",
            )
        return SyncSpec(self.mode, replicas, self.staleness, self.scale_momentum)

    @staticmethod
    def mode_waits_for_rounds(mode: object) -> bool:
        """Whether mode ``mode`` (a name, as a summary records it) gathers gradients into rounds; False if unknown."""
        policy = POLICIES.get(str(mode))
        return policy is not None and policy.waits_for_rounds

    @property
    def waits_for_rounds(self) -> bool:
        """Gradients are gathered into one update per version (``sync``); see ConsistencyPolicy.waits_for_rounds."""
        return self.mode_waits_for_rounds(self.mode)

    @property
    def allows_overlap(self) -> bool:
        """Whether a worker may compute its next gradient while its last push is in flight."""
        return not self.waits_for_rounds

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "staleness": self.staleness,
            "scale_momentum": self.scale_momentum,
        }


class Outcome(enum.Enum):
    APPLIED = "applied"
    PARKED = "parked"
    DROPPED = "dropped"


@dataclass(eq=False)
class Push:
    """One worker's gradient for one shard, waiting for its answer (compared by identity: two pushes are
    never the same push, even with equal fields)."""

    peer: bytes
    rid: int
    worker: int
    version: int
    grad: np.ndarray
    outcome: Outcome = Outcome.PARKED
    staleness: int = 0
    bound: float | None = None
    """An upper bound on the gradient's ``|g|``, if the ps measured one that holds (see :mod:`psdk.ps.store`)."""
    tables: TableRequest = field(default_factory=TableRequest)
    """The rows it pushes (let go once used, as the gradient) and the rows its reply carries."""


@dataclass
class Decision:
    """What a submit did: the pushes to answer now and the workers whose gradients were applied."""

    answer: list[Push] = field(default_factory=list)
    applied_workers: list[int] = field(default_factory=list)
    updates: int = 0
    refused: list[Push] = field(default_factory=list)
    """Pushes of a round whose update would have made the store non-finite (answered "dropped")."""


class ConsistencyPolicy(ABC):
    waits_for_rounds: ClassVar[bool] = False
    """True where gradients are gathered into rounds, one update per version, and a gradient computed from an
    older version is dropped: a worker cannot compute while its push is in flight (its gradient would be a round
    stale), ``replicas_to_aggregate`` means something, and there is no slowest worker to report."""

    def __init__(self, store: ParameterStore, spec: SyncSpec, live: Callable[[], Collection[int]] = frozenset):
        self.store = store
        self.spec = spec
        self.live = live
        self.clock: dict[int, int] = {}
        """Iterations each worker has finished (pushes answered applied or dropped)."""

    def tick(self, worker: int) -> None:
        self.clock[worker] = self.clock.get(worker, 0) + 1

    def slowest(self) -> int:
        """Iterations finished by the slowest live worker (0 while one has not pushed yet)."""
        return min((self.clock.get(w, 0) for w in self.live()), default=0)

    def release_ready(self) -> list[Push]:
        """Parked pushes that may be answered now (e.g. after a worker died)."""
        return []

    @abstractmethod
    def submit(self, push: Push) -> Decision:
        """Take one push (its version already checked not to be in the future)."""

    def parked(self) -> list[Push]:
        """Pushes waiting for a round to close."""
        return []

    def release_parked(self) -> list[Push]:
        """Hand back every parked push (the job ended or failed) and forget them."""
        return []

    def blocked_round(self, live_workers: Collection[int]) -> str | None:
        """Why the current round can never complete with these workers, if it cannot."""
        return None


class AsyncPolicy(ConsistencyPolicy):
    def submit(self, push: Push) -> Decision:
        staleness = self.store.version - push.version
        self.store.apply(push.grad, push.bound, push.tables.rows)  # NonFiniteError: refused, nothing changed
        push.grad, push.staleness = USED, staleness
        push.tables.rows = {}
        push.outcome = Outcome.APPLIED
        self.tick(push.worker)
        return Decision(answer=[push], applied_workers=[push.worker], updates=1)


class SSPPolicy(AsyncPolicy):
    """Bounded staleness: apply on arrival; hold the reply of a worker too far ahead."""

    def __init__(self, store: ParameterStore, spec: SyncSpec, live: Callable[[], Collection[int]] = frozenset):
        super().__init__(store, spec, live)
        self._held: list[Push] = []

    def submit(self, push: Push) -> Decision:
        decision = super().submit(push)
        self._held.append(push)
        decision.answer = self.release_ready()
        return decision

    def release_ready(self) -> list[Push]:
        # The reply to a worker's k-th push starts its iteration k + 1, which needs every
        # live worker to have finished iteration k - s.
        slowest = self.slowest()
        ready = [p for p in self._held if self.clock.get(p.worker, 0) - self.spec.staleness <= slowest]
        if ready:
            self._held = [p for p in self._held if p not in ready]
        return ready

    def parked(self) -> list[Push]:
        return list(self._held)

    def release_parked(self) -> list[Push]:
        released, self._held = self._held, []
        return released


class SyncPolicy(ConsistencyPolicy):
    """Aggregates ``replicas_to_aggregate`` gradients per version, in a float32 accumulator."""

    waits_for_rounds = True

    def __init__(self, store: ParameterStore, spec: SyncSpec, live: Callable[[], Collection[int]] = frozenset):
        super().__init__(store, spec, live)
        assert spec.replicas_to_aggregate is not None, "resolve the spec first"
        self.replicas = spec.replicas_to_aggregate
        self.accumulator = np.zeros(store.size, np.float32)
        self._spare = np.zeros(store.size, np.float32)
        """The sum with the next gradient goes here first, and is swapped in only if it stays finite."""
        self._sum_bound = 0.0
        self._waiting: list[Push] = []
        self._rows: dict[str, list[RowGrad]] = {}
        """The round's row gradients by table, as pushed: summed per id only when the round closes."""

    def submit(self, push: Push) -> Decision:
        version = self.store.version
        if push.version < version:
            push.outcome, push.grad = Outcome.DROPPED, USED
            push.staleness = version - push.version
            self.tick(push.worker)
            return Decision(answer=[push])
        if any(p.worker == push.worker for p in self._waiting):
            # A second gradient from one worker for one version is never aggregated.
            push.outcome, push.grad = Outcome.DROPPED, USED
            self.tick(push.worker)
            return Decision(answer=[push])
        with np.errstate(over="ignore"):  # an overflow is refused below
            np.add(self.accumulator, push.grad, out=self._spare)
        bound = magnitude(self._spare)
        if not math.isfinite(bound):
            raise NonFiniteError(f"the gradient would make the sum of the round at version {version} overflow")
        self.accumulator, self._spare, self._sum_bound = self._spare, self.accumulator, bound
        for name, grad in push.tables.rows.items():
            self._rows.setdefault(name, []).append(grad)
        push.grad, push.tables.rows = USED, {}
        self._waiting.append(push)
        if len(self._waiting) < self.replicas:
            return Decision()
        self.accumulator *= np.float32(1.0 / self.replicas)
        answered, self._waiting = self._waiting, []
        rows, self._rows = {name: merge_grads(grads) for name, grads in self._rows.items()}, {}
        try:
            # A row's mean is over the round's replicas_to_aggregate gradients, as a dense variable's: a row
            # that only some of them touched moves less (docs/tables.md says why this and not per row).
            self.store.apply(self.accumulator, self._sum_bound / self.replicas * 1.01, rows, 1.0 / self.replicas)
        except NonFiniteError:  # the mean of finite gradients overflows the parameters: nobody's step counts
            for p in answered:
                p.outcome = Outcome.DROPPED
                self.tick(p.worker)
            return Decision(answer=answered, refused=answered)
        finally:
            self.accumulator.fill(0.0)
        for p in answered:
            p.outcome = Outcome.APPLIED
            self.tick(p.worker)
        return Decision(answer=answered, applied_workers=[p.worker for p in answered], updates=1)

    def parked(self) -> list[Push]:
        return list(self._waiting)

    def release_parked(self) -> list[Push]:
        released, self._waiting = self._waiting, []
        self.accumulator.fill(0.0)
        self._rows = {}
        return released

    def blocked_round(self, live_workers: Collection[int]) -> str | None:
        if not self.store.size and not self.store.tables:  # a shard with nothing gets no pushes: no round to fill
            return None
        contributed = {p.worker for p in self._waiting}
        possible = len(contributed) + len(set(live_workers) - contributed)
        if possible >= self.replicas:
            return None
        return (
            f"the sync round at version {self.store.version} needs replicas_to_aggregate="
            f"{self.replicas} gradients but only {possible} worker(s) can still send one "
            f"(alive: {sorted(live_workers) or 'none'})"
        )


POLICIES: dict[str, type[ConsistencyPolicy]] = {"async": AsyncPolicy, "sync": SyncPolicy, "ssp": SSPPolicy}
"""Each mode's policy; its class attributes say what depends on the mode."""
assert tuple(POLICIES) == MODES


def make_policy(
    store: ParameterStore, spec: SyncSpec, live: Callable[[], Collection[int]] = frozenset
) -> ConsistencyPolicy:
    """The policy of ``spec.mode``; ``live`` tells it which workers may still push."""
    return POLICIES[spec.mode](store, spec, live)
